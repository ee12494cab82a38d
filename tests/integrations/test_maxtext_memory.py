"""Why raising MaxText's context degree saves no memory, said by `analyze --sweep`.

MaxText 0.2.5's real training step on its dense capacity path (mixtral-style, 2 layers,
seq 2048, 8 simulated devices, context N x fsdp 8/N: every device holds as many tokens at
every N, so the ideal temp is flat). The temp grows with N; the sweep names MaxText's own
MoE lines as the ones that grow, and they account for the temp above the ideal.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed: pip install -e '.[maxtext]' (Python 3.12+)")

from shardlint.cli import main  # noqa: E402

pytestmark = pytest.mark.maxtext

CAPACITY_PATH = dict(decoder_block="mixtral", base_num_decoder_layers=2, base_emb_dim=128, base_mlp_dim=256,
                     base_moe_mlp_dim=256, num_experts=8, num_experts_per_tok=2, base_num_query_heads=4,
                     base_num_kv_heads=4, head_dim=32, vocab_size=256, max_target_length=2048,
                     per_device_batch_size=1, dtype="float32", weight_dtype="float32",
                     attention="dot_product", scan_layers="false", sparse_matmul="false",
                     capacity_factor=1.25, ici_fsdp_parallelism=-1)


@pytest.fixture(scope="module")
def capacity_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("maxtext_sweep") / "sweep.json"
    sets = [word for key, value in CAPACITY_PATH.items() for word in ("--set", f"{key}={value}")]
    code = main(["analyze", "shardlint.integrations.maxtext:make_step", "--devices", "8", *sets,
                 "--sweep", "ici_context_parallelism=1,2,4,8", "--json", str(out)])
    return code, json.loads(out.read_text())["sweep"]


def test_the_capacity_path_grows_above_its_flat_ideal(capacity_sweep):
    _, sweep = capacity_sweep
    before = sweep["before"]
    assert len(set(before["ideal"])) == 1   # 8 devices at every point
    temps = before["temp"]
    assert temps == sorted(temps) and temps[-1] > 1.5 * temps[0]


def test_the_sweep_names_maxtexts_moe_lines(capacity_sweep):
    """The lines the headline names account for the temp above the ideal (more than all of
    it: the attention's buffers fall below theirs), and MaxText's MoE lines are among them,
    growing."""
    _, sweep = capacity_sweep
    before = sweep["before"]
    listed = before["lines"][:before["listed"]]
    moe = [line for line in listed if line["source"] and line["source"]["file"] == "maxtext/layers/moe.py"]
    assert len(moe) >= 3 and all(line["scaling"] in ("flat", "grows") for line in moe)
    assert before["above_ideal_explained"] >= 0.9
    assert sum(line["excess"] for line in moe) >= 0.9 * (before["temp"][-1] - before["ideal"][-1])
    assert "moe.py" in before["headline"]
