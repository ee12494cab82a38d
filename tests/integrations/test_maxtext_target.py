"""`shardlint.integrations.maxtext:make_step`: MaxText's real training step from the command line.

A 2-layer mixtral-style decoder with small dims at data=2 x context=4 on 8 simulated CPU
devices, built the way MaxText's AOT path builds it (config, mesh, shaped train state and
batch, in/out shardings, donation). The dense MoE path gathers its routing tensors over
the sequence at moe.py's lines; `shardlint.rewrite` runs them per shard and the numbers
stay the same; the sparse path loses nothing in the MoE. Both with `scan_layers` on and
off. Runs where MaxText is installed (CI's Python 3.12 environment).
"""

from __future__ import annotations

import json

import jax
import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed: pip install -e '.[maxtext]' (Python 3.12+)")

import shardlint  # noqa: E402
from shardlint import cli  # noqa: E402
from shardlint.analyzer.compile._compile import mesh_of  # noqa: E402
from shardlint.integrations import maxtext  # noqa: E402
from shardlint.rewrites import verify_same  # noqa: E402

from support.cli_words import set_words as _sets  # noqa: E402

pytestmark = pytest.mark.maxtext

TARGET = "shardlint.integrations.maxtext:make_step"
SMALL = dict(base_emb_dim=64, base_mlp_dim=128, base_moe_mlp_dim=128, num_experts=8,
             num_experts_per_tok=2, decoder_block="mixtral", base_num_decoder_layers=2,
             base_num_query_heads=4, base_num_kv_heads=4, head_dim=16, vocab_size=256,
             dtype="float32", weight_dtype="float32", capacity_factor=-1, per_device_batch_size=1)
CPU = dict(SMALL, max_target_length=128, ici_data_parallelism=2, ici_context_parallelism=4)


@pytest.fixture(scope="module", autouse=True)
def jax_as_it_was():
    """MaxText's trainer, imported by make_step, replaces `jax.lax.top_k` and
    `jax.lax.with_sharding_constraint` with compat shims for the whole process (its tunix
    adapter); the tests after these get JAX's own back."""
    import jax

    saved = jax.lax.top_k, jax.lax.with_sharding_constraint
    yield
    jax.lax.top_k, jax.lax.with_sharding_constraint = saved


def _moe_findings(analysis):
    return [f for f in analysis.findings if f.source and f.source.file.endswith("maxtext/layers/moe.py")]


def test_attention_all_to_alls_are_explained_at_attention(dense):
    """XLA moves attention scores between two shardings over `context` in the backward
    (all-to-alls labelled with attention_op.py's ops). They were once attributed to the
    embedding's scatter-add, through a zero constant XLA shares into their fusion under the
    scatter-add's name, and called `layout` after the constraint next to it."""
    _, _, analysis = dense
    moves = [c for c in analysis.collectives if c.kind == "all-to-all" and c.xla_source is not None
             and c.xla_source.file.endswith("maxtext/layers/attention_op.py")]
    assert moves, analysis.collectives
    assert all(c.source.file.endswith("maxtext/layers/attention_op.py") and c.cause == "lost" for c in moves), moves
    claiming = [f for f in analysis.findings if set(f.collectives) & {c.id for c in moves}]
    assert {c.id for c in moves} <= {cid for f in claiming for cid in f.collectives}
    # All-to-alls move shards and gather nothing: no finding says the op "cannot be split".
    assert {f.kind for f in claiming} == {"resharded-operand"}, claiming


# MaxText's remat policies besides its default ("full"): "minimal" saves the dots for the
# backward, "none" saves everything a scanned layer computes.
DENSE = {"layers": dict(scan_layers=False), "scan_layers": dict(scan_layers=True),
         "scan_layers, remat minimal": dict(scan_layers=True, remat_policy="minimal"),
         "scan_layers, remat none": dict(scan_layers=True, remat_policy="none")}


# "minimal" sits between MaxText's default and "none" in what the backward saves, and "none"
# runs rewritten in tests/integrations/test_maxtext_capacity.py: both with -m slow (CI's
# time limit).
_SLOW_DENSE = {"scan_layers, remat minimal", "scan_layers, remat none"}


@pytest.fixture(scope="module", ids=list(DENSE), params=[
    pytest.param(v, marks=pytest.mark.slow) if k in _SLOW_DENSE else v for k, v in DENSE.items()])
def dense(request):
    fn, args = maxtext.make_step(**CPU, sparse_matmul=False, **request.param)
    return fn, args, shardlint.analyze(fn, *args)


def test_dense_path_loses_the_sequence_at_moe_lines(dense):
    _, _, analysis = dense
    lost = _moe_findings(analysis)
    assert lost, [f"{f.source} {f.op}" for f in analysis.findings]
    assert {f.op for f in lost} >= {"top_k"}
    assert all("context" in f.axes for f in lost)


@pytest.fixture(scope="module")
def dense_rewritten(dense):
    fn, args, before = dense
    fixed = shardlint.rewrite(fn, mesh_of(args), args=args, verify=True)   # raises if numbers differ
    return fixed, shardlint.analyze(fixed, *args)


def test_dense_path_rewritten_per_shard_with_the_same_numbers(dense, dense_rewritten):
    _, _, before = dense
    fixed, after = dense_rewritten
    assert fixed.changed
    assert _moe_findings(after) == []
    # Nothing new is lost elsewhere (with scanned layers, XLA also drops the while loop's
    # own gather of what the MoE's routing had needed).
    outside = lambda a: {(f"{f.source}", f.op) for f in a.findings if f not in _moe_findings(a)}  # noqa: E731
    assert outside(after) <= outside(before)


# Qwen3-Next's layers (gated delta-net and full attention, a shared expert) with small dims,
# its dense MoE path, at context 2 x tensor 4: the shape of benchmarks/maxtext_config.py.
QWEN3_NEXT = dict(model_name="qwen3-next-80b-a3b", override_model_config=True, base_num_decoder_layers=4,
                  num_experts=8, num_experts_per_tok=2, base_emb_dim=64, base_mlp_dim=128, base_moe_mlp_dim=128,
                  base_num_query_heads=4, base_num_kv_heads=4, head_dim=16, vocab_size=256, max_target_length=128,
                  per_device_batch_size=1, dtype="float32", weight_dtype="float32", sparse_matmul=False,
                  capacity_factor=-1, scan_layers=True, ici_fsdp_parallelism=1,
                  context_parallel_load_balance=False,   # GatedDeltaNet: device order is sequence order
                  ici_data_parallelism=1, ici_context_parallelism=2, ici_tensor_parallelism=4)


@pytest.fixture(scope="module", params=[4, 2], ids=["4layers", "2layers"])
def qwen3_next(request):
    """At one shard's sizes JAX hands Qwen3-Next's 4-layer scan 98 operands where it hands
    it 93 globally (a constant-building shard_map returns 21 values instead of 16): the
    rewrite pairs the two traces by use (before, it failed: 'Cannot concatenate arrays').
    With 2 layers the whole layer scan is checkpointed, and JAX 0.12 stages its forward as
    one `eval_jaxpr` call, which the rewrite enters (before, it rewrote the backward only)."""
    fn, args = maxtext.make_step(**dict(QWEN3_NEXT, base_num_decoder_layers=request.param))
    before = shardlint.analyze(fn, *args)
    # Its numbers are the slow test's below: running both steps takes half an hour here.
    fixed = shardlint.rewrite(fn, mesh_of(args), args=args, analysis=before, verify=False)
    return fn, args, before, fixed


def test_qwen3_next_under_tensor_parallelism_is_rewritten(qwen3_next):
    """With JAX 0.11 and 2 layers, the two gathers over `tensor` of moe.py:4267's backward
    (f32[8,64,8,64]) were read as requested by an ask of another length after the rewrite:
    a finding hidden (`_causes._may_have_asked`)."""
    fn, args, before, fixed = qwen3_next
    assert fixed.changed is True
    after = shardlint.analyze(fixed, *args)
    over = lambda a, axis: [f"{f.source.line} {f.op}" for f in _moe_findings(a) if axis in f.axes]  # noqa: E731
    assert {f.split()[1] for f in over(before, "context")} >= {"top_k", "scatter"}
    assert over(after, "context") == []
    # What XLA loses over `tensor` in MaxText's own expert einsums is not the rewrite's to fix.
    assert over(after, "tensor") == over(before, "tensor")


@pytest.mark.slow
def test_qwen3_next_under_tensor_parallelism_computes_the_same_numbers(qwen3_next):
    """About 25 minutes on 2 CPU cores: on 8 simulated devices the layers' collective
    permutes wait on one another for a minute at a time."""
    fn, args, _, fixed = qwen3_next
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-5)


def test_sparse_path_loses_nothing_in_the_moe():
    fn, args = maxtext.make_step(**CPU, sparse_matmul=True, scan_layers=True)
    assert _moe_findings(shardlint.analyze(fn, *args)) == []


def test_cli_analyzes_and_rewrites_a_maxtext_config(tmp_path, capsys):
    out = tmp_path / "after.json"
    code = cli.main(["analyze", TARGET, "--devices", "8", *_sets(CPU), "--set", "sparse_matmul=false",
                     "--set", "scan_layers=false", "--rewrite", "--json", str(out)])
    err = capsys.readouterr().err
    assert "verifying the rewrite on random inputs" in err and "error" not in err
    findings = json.loads(out.read_text())["findings"]
    assert code == 1   # attention's own gathers over context stay, as MaxText writes them
    assert not [f for f in findings if "maxtext/layers/moe.py" in json.dumps(f.get("source"))]


@pytest.mark.parametrize("options, message", [
    ({"ici_contxt_parallelism": 4}, "MaxText has no config key 'ici_contxt_parallelism' "
                                    "(--set ici_contxt_parallelism=...); did you mean ici_context_parallelism"),
    ({"ici_data_parallelism": 2, "ici_context_parallelism": 8},
     "MaxText cannot lay its mesh over 8 devices with ici_data_parallelism=2, ici_fsdp_parallelism=-1, "
     "ici_context_parallelism=8: the product of the ici_*_parallelism keys"),
])
def test_cli_config_mistakes_are_one_line(options, message, capsys):
    code = cli.main(["analyze", TARGET, "--devices", "8", *_sets(dict(SMALL, **options))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("shardlint: error: " + message), err[-1]
    assert not any(line.startswith("Traceback") for line in err)


@pytest.mark.tpu
def test_tpu_topology_with_the_real_compiler(tmp_path, capsys):
    """v5p:2x2x1 through libtpu AOT: MaxText builds its mesh over the topology's 4 chips.
    On TPU MaxText picks its flash attention, whose 512-token blocks need 512 tokens per
    shard: seq 2048 over context 4."""
    out = tmp_path / "tpu.json"
    tpu = dict(SMALL, max_target_length=2048, ici_data_parallelism=1, ici_context_parallelism=4)
    code = cli.main(["analyze", TARGET, "--topology", "v5p:2x2x1", *_sets(tpu), "--set", "sparse_matmul=false",
                     "--set", "scan_layers=false", "--json", str(out)])
    assert code == 1, capsys.readouterr().err
    analysis = json.loads(out.read_text())
    assert analysis["mesh"]["context"] == 4
    moe = [f for f in analysis["findings"] if "maxtext/layers/moe.py" in json.dumps(f.get("source"))]
    assert moe and all("context" in f["axes"] for f in moe)


def test_the_batch_is_per_device_of_the_mesh_it_is_laid_over():
    """MaxText's global batch is per_device_batch_size x the devices JAX runs on; over
    fewer of them (as over a TPU topology's chips from a CPU host), make_step counts the
    mesh's devices, as MaxText counts the pod's."""
    four = jax.devices()[:4]
    _, (_, batch) = maxtext.make_step(devices=four, **dict(SMALL, max_target_length=128, ici_fsdp_parallelism=4))
    assert batch["inputs"].shape == (4, 128)
    assert batch["inputs"].sharding.spec[0] is not None   # over the four devices' fsdp axis
