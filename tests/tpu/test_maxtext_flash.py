"""MaxText's training step with its own attention on TPU (flash: a Pallas splash kernel in a
wrapper of its own that checks the global batch against the mesh inside its `shard_map`),
compiled by libtpu for a `v5p:2x2x2` topology with no TPU attached, is rewritten: the
routed MoE runs per shard, the attention stays as MaxText wrote it.

Before the rewrite bound only the routed regions at one shard's shapes, it retraced the whole
step there and was refused at context 2 ("Batch dimension should be shardable among the
devices in data and fsdp axis got query.shape[0]=2/devices_in_data_fsdp=4"). Needs MaxText
(Python 3.12) and a matching libtpu; run with `python -m pytest -q -m tpu -n 0`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed: pip install -e '.[maxtext]' (Python 3.12+)")

import shardlint  # noqa: E402
from shardlint.analyzer.compile._compile import mesh_of  # noqa: E402
from shardlint.analyzer.compile._topology import topology_devices  # noqa: E402
from shardlint.integrations import maxtext  # noqa: E402

pytestmark = [pytest.mark.tpu, pytest.mark.maxtext]

TOPOLOGY = "v5p:2x2x2"
# The dense dropless path of a small mixtral, bf16, flash attention: 512-token blocks need
# 512 tokens per context shard, so seq 1024 at context 2 (fsdp 4 fills the other chips).
CONFIG = dict(decoder_block="mixtral", base_num_decoder_layers=2, base_emb_dim=256, base_mlp_dim=256,
              base_moe_mlp_dim=256, num_experts=8, num_experts_per_tok=2, base_num_query_heads=4,
              base_num_kv_heads=4, head_dim=128, vocab_size=256, max_target_length=1024, dtype="bfloat16",
              weight_dtype="bfloat16", sparse_matmul=False, capacity_factor=-1, scan_layers=False,
              attention="flash", ici_context_parallelism=2, ici_fsdp_parallelism=-1)


def _moe_findings(analysis):
    return [f for f in analysis.findings if f.source and f.source.file.endswith("maxtext/layers/moe.py")]


@pytest.fixture(scope="module")
def flash_step():
    devices = topology_devices(TOPOLOGY)
    # One sequence per chip of the topology (per_device_batch_size's default here).
    fn, args = maxtext.make_step(devices=devices, per_device_batch_size=1, **CONFIG)
    return fn, args, shardlint.analyze(fn, *args)


def test_the_flash_attention_step_is_rewritten_and_its_attention_kept(flash_step):
    fn, args, before = flash_step
    assert before.platform == "tpu" and _moe_findings(before)
    messages = []
    fixed = shardlint.rewrite(fn, mesh_of(args), args=args, analysis=before, progress=messages.append)
    assert fixed.changed is True
    assert "not verifying the rewrite's numbers: its devices only compile" in messages
    after = shardlint.analyze(fixed, *args)
    assert _moe_findings(after) == []
    # The splash kernel's own wrapper is bound as MaxText traced it: its shard_map's K/V
    # collectives over context are the same before and after.
    attention = lambda a: sorted((c.kind, c.axes, c.shape) for c in a.collectives  # noqa: E731
                                 if c.source and c.source.file.endswith("maxtext/layers/attention_op.py"))
    assert attention(after) == attention(before)
