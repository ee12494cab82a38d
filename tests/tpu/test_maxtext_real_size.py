"""MaxText's own Mixtral-8x7B preset at the size users train it, one decoder layer of it, on
v5p-64: the user's report, found and fixed (the guard of issue 54; the whole preset's
table is `benchmarks/maxtext_real_size.py`'s, in docs/maxtext.md).

`model_name=mixtral-8x7b` with `base_num_decoder_layers=1` (the preset's dims: emb 4096,
mlp 14336, 8 experts top-2), the dense capacity path, seq 32768, one sequence per chip,
context N x FSDP over `v5p:4x4x4`, compiled by libtpu ahead of time. There XLA keeps the
routing ops sharded and only the dispatch sums the context-sharded sequence into slots: the
analysis names it (`contracted-tokens`), the rewrite starts its region there, and the
rewritten step's temp and FLOPs per chip are those of context 1. At context 8 the step as
written does not fit a chip (the compiler refuses it: 105 GiB of temporaries) and is
analyzed anyway; rewritten, it fits; so it does with one sequence per FSDP shard
(per_device_batch_size=1/8). About 6 minutes of compiles: `slow`. Needs MaxText
(Python 3.12) and a matching libtpu; run with `python -m pytest -q -m tpu -n 0`.
"""

from __future__ import annotations

import functools
import warnings

import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed: pip install -e '.[maxtext]' (Python 3.12+)")

import shardlint  # noqa: E402
from shardlint.analyzer import FindingKind, fit_of  # noqa: E402
from shardlint.analyzer.compile._compile import mesh_of  # noqa: E402
from shardlint.analyzer.compile._topology import topology_devices  # noqa: E402
from shardlint.integrations import maxtext  # noqa: E402

pytestmark = [pytest.mark.tpu, pytest.mark.maxtext, pytest.mark.slow]

TOPOLOGY = "v5p:4x4x4"
CONFIG = dict(model_name="mixtral-8x7b", override_model_config=True, base_num_decoder_layers=1,
              sparse_matmul=False, capacity_factor=1.25, max_target_length=32768, per_device_batch_size=1,
              ici_fsdp_parallelism=-1, attention="flash")


@functools.cache
def _point(context: int, **options):
    split = dict(allow_split_physical_axes=True) if context >= 8 else {}
    fn, args = maxtext.make_step(devices=topology_devices(TOPOLOGY), ici_context_parallelism=context,
                                 **{**CONFIG, **options}, **split)
    before = shardlint.analyze(fn, *args)
    if context == 1:
        return before, None
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardlint.NothingToRewrite)   # "nothing to rewrite" fails
        fixed = shardlint.rewrite(fn, mesh_of(args), args=args, analysis=before, capacity="per-shard",
                                  verify=False)
        return before, shardlint.analyze(fixed, *args)


def _dispatches(analysis):
    return [f for f in analysis.findings if f.kind == FindingKind.CONTRACTED]


def test_context_4_the_dispatch_is_found_and_rewritten_to_context_1s_temp_and_flops():
    first, _ = _point(1)
    before, after = _point(4)
    found = _dispatches(before)
    assert found and all(f.source.file.endswith("maxtext/layers/moe.py") and f.axes == ("context",)
                         for f in found)
    assert any("BSM,BSEC -> EBCM" in f.op_path and not f.backward for f in found)
    assert before.memory.temp_bytes > 2 * first.memory.temp_bytes     # 54.9 GiB against 21.2
    assert not _dispatches(after)
    assert after.memory.temp_bytes <= 1.15 * first.memory.temp_bytes
    assert after.memory.flops <= 1.1 * first.memory.flops


def test_context_8_does_not_fit_as_written_is_analyzed_and_fits_rewritten():
    first, _ = _point(1)
    before, after = _point(8)
    assert before.does_not_fit is not None
    assert before.does_not_fit.needed_bytes > before.does_not_fit.available_bytes
    assert _dispatches(before) and not fit_of(before).fits
    assert after.does_not_fit is None and fit_of(after).fits
    assert after.memory.temp_bytes <= 1.15 * first.memory.temp_bytes


def test_context_8_with_one_sequence_per_fsdp_shard_is_rewritten():
    """per_device_batch_size=1/8: MaxText loads 64 sequences and its train step slices off the
    8 it trains on, one per FSDP shard, each split over the 8 context chips. That batch of 8
    is the batch, not a capacity (the rewrite refused it as `bfloat16[8,32768,4096] has a
    dimension sized by one shard's capacity`); rewritten, it gathers no sequence."""
    before, after = _point(8, per_device_batch_size=0.125)
    assert _dispatches(before) and not _dispatches(after)
    assert after.memory.temp_bytes < before.memory.temp_bytes


def test_the_plan_at_one_real_size_point_fits_after_the_fix_where_it_did_not_before(tmp_path):
    """`shardlint plan` as docs/plan.md runs it, at one real-size point: one layer of the
    preset at context 8 with one 32768-token sequence per chip, against a limit between
    what the step needs as written and fixed (the no-fit analysis above: about 105 GiB of
    temporaries as written, context 1's once fixed). The point's process loads libtpu beside
    this one's (ALLOW_MULTIPLE_LIBTPU_LOAD, set by the engine)."""
    import json
    import subprocess
    import sys

    words = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in CONFIG.items()]
    done = subprocess.run(
        [sys.executable, "-m", "shardlint", "plan", "shardlint.integrations.maxtext:make_step",
         "--topology", TOPOLOGY, *[w for word in words for w in ("--set", word)],
         "--set", "allow_split_physical_axes=true", "--grid", "ici_context_parallelism=8",
         "--per-shard-capacity", "--json", str(tmp_path / "plan.json")],
        capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    row, = json.loads((tmp_path / "plan.json").read_text())["rows"]
    point = row["point"]
    assert not point["before"]["fits"] and point["before"]["refused"]     # libtpu refused it
    assert point["after"]["fits"] and point["regions"] >= 1
    assert point["after"]["need_bytes"] < point["before"]["need_bytes"] / 2
