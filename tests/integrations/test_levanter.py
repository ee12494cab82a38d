"""shardlint on Levanter's Mixtral (`marin-levanter` from the registry, haliax named axes):
the training step Levanter's `Trainer` runs, through `shardlint.integrations.levanter`.

Levanter's own context parallelism (a `context` mesh axis with `position` mapped to it, as
its gpt2_small_fast_context.yaml does) at data=2 x context=4 on 8 CPU devices: 2 scanned
layers, small dims chosen so that no weight has the sequence's length (128) or the
flattened tokens' (512, and 1024 repeated top-2). Levanter's Mixtral flattens `(batch,
position)` into a `token` axis that its mapping leaves unmapped (mapping it, as its
mixtral_8x7b.yaml does with `token: data`, fails in its own unpermute shard_map: "Axis token
has different sizes ... 512 != 1024"), so its router's output is constrained to replicated
and its route, permute and unpermute `shard_map`s take every token on every device.

TRUTH_* are what XLA's compiled program gathers (`support.hlo_gathers`: per-device shape,
mesh axes, forward or backward), beside what shardlint says of them. Runs where Levanter is
installed (CI's Python 3.12 environment with JAX 0.11: `pip install -e '.[test,levanter]'`).
"""

from __future__ import annotations

import inspect
import json

import pytest

pytest.importorskip("levanter", reason="Levanter is not installed: pip install -e '.[levanter]' (Python 3.12+)")

import shardlint  # noqa: E402
from shardlint import cli  # noqa: E402
from shardlint.analyzer.compile._compile import mesh_of  # noqa: E402
from shardlint.integrations import levanter  # noqa: E402
from shardlint.rewrites import verify_same  # noqa: E402

from support.hlo_gathers import activation_gathers, direction, has_length  # noqa: E402
from support.cli_words import set_words as _sets  # noqa: E402

pytestmark = pytest.mark.levanter

TARGET = "shardlint.integrations.levanter:make_step"
SMALL = dict(max_seq_len=128, hidden_dim=64, intermediate_dim=96, num_layers=2, num_heads=4, num_kv_heads=4,
             n_routed_experts=8, num_experts_per_tok=2, gradient_checkpointing=False, use_flash_attention=False,
             train_batch_size=4, vocab_size=200)
CONTEXT = dict(SMALL, axes={"context": 4}, shared_mapping={"position": "context"})
TOKEN_LENGTHS = {128, 512, 1024}   # sequence, tokens, tokens x top-2

# XLA at data=2 x context=4 (JAX 0.11.2, marin-levanter 0.2.227): each scanned layer's body
# (x2 per step) gathers the MoE's input over the sequence and then over the batch (every
# token on every device), the router's probabilities over the batch, and in the backward
# the combine's and the expert matmuls' tokens over the batch; attention gathers its K/V
# over the sequence, forward and backward.
TRUTH_CONTEXT = {
    ("f32[2,128,64]", ("context",), "forward"): 1,    # the MoE's input over the sequence ...
    ("f32[4,128,64]", ("data",), "forward"): 1,       # ... then over the batch: every token
    ("f32[512,8]", ("data",), "forward"): 1,          # router probabilities, before top_k
    ("f32[2,128,64]", ("context",), "unnamed"): 1,    # (no op name from XLA)
    ("f32[512,2,64]", ("data",), "backward"): 1,      # the combine's expert outputs
    ("f32[512,2]", ("data",), "backward"): 1,         # ... and its weights
    ("f32[1024,64]", ("data",), "backward"): 1,       # the expert matmuls' sorted tokens
    ("f32[2,4,128,16]", ("context",), "forward"): 2,  # attention's K and V
    ("f32[2,4,128,16]", ("context",), "backward"): 2,
}

# ... and after the rewrite: attention's alone.
TRUTH_CONTEXT_REWRITTEN = {
    ("f32[2,4,128,16]", ("context",), "forward"): 2,
    ("f32[2,4,128,16]", ("context",), "backward"): 2,
}


@pytest.fixture(scope="module")
def context():
    fn, args = levanter.make_step(**CONTEXT)
    return fn, args, shardlint.analyze(fn, *args)


def _line(module, snippet: str) -> int:
    lines = inspect.getsource(module).splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if snippet in line]
    assert len(hits) == 1, (snippet, hits)
    return hits[0]


def _mixtral_line(snippet: str) -> int:
    import levanter.models.mixtral as mixtral

    return _line(mixtral, snippet)


def _in_mixtral(source) -> bool:
    return source is not None and source.file.endswith("levanter/models/mixtral.py")


def test_levanter_lays_out_its_own_mesh_and_batch(context):
    _, args, analysis = context
    assert analysis.mesh == {"data": 2, "replica": 1, "model": 1, "context": 4, "replica_dcn": 1}
    _, batch = args
    assert tuple(batch.tokens.array.sharding.spec) == (("replica_dcn", "replica", "data"), "context")


def test_xla_gathers_every_token_onto_every_device(context):
    _, _, analysis = context
    assert activation_gathers(analysis.collectives, TOKEN_LENGTHS) == TRUTH_CONTEXT


def test_shardlint_finds_the_routing_gathers_at_levanters_lines(context):
    _, _, analysis = context
    top_k = _mixtral_line("selected_weights_, selected_experts_ = jax.lax.top_k(router_probs_")
    take = _mixtral_line("x_repeat_sort_ = jnp.take(x_flat_")
    unflatten = _mixtral_line("out_repeat_unflat_ = jnp.reshape(")
    moe = [f for f in analysis.findings if _in_mixtral(f.source)]
    assert {(f.op, f.source.line) for f in moe} >= {("top_k", top_k), ("scatter-add", take),
                                                    ("reshape", unflatten)}
    assert all(f.cause == "lost" and f.axes == ("data",) for f in moe)
    # Every gather of the flattened tokens (512 of them, 1024 repeated) is claimed by a
    # finding, as lost.
    claimed = {cid for f in analysis.findings for cid in f.collectives}
    tokens = [c for c in analysis.all_gathers() if has_length(c, {512, 1024})]
    assert tokens and all(c.cause == "lost" and c.id in claimed for c in tokens), tokens
    # The MoE's input, gathered over the sequence and the batch before it is flattened.
    flatten = [f for f in analysis.findings if f.op == "reshape" and set(f.axes) == {"data", "context"}]
    assert flatten and flatten[0].feeds_grouped_matmul


def test_the_moe_inputs_gathers_are_put_on_its_flatten(context):
    """XLA gathers the MoE's input one axis at a time (the sequence, then the batch): both
    gathers are the flatten's, which dropped both axes."""
    _, _, analysis = context
    flatten = _mixtral_line("x_flat = hax.flatten_axes(x, old_axes=squash_axes")
    inputs = {c.id for c in analysis.all_gathers() if c.shape in ("f32[2,128,64]", "f32[4,128,64]")
              and c.xla_op_path and "transpose(" not in c.xla_op_path}
    assert len(inputs) == 2
    at_flatten = [f for f in analysis.findings
                  if any(_in_mixtral(s) and s.line == flatten for s in f.stack)]
    assert at_flatten and inputs <= {cid for f in at_flatten for cid in f.collectives}


def test_rewrite_routes_each_shards_tokens_with_the_same_numbers(context):
    """Levanter routes in its own shard_maps whose specs split nothing (`token` is mapped to no
    mesh axis): every device computes the same, so the rewrite inlines them (`_inline`) and
    routes each shard's tokens itself."""
    fn, args, before = context
    fixed = shardlint.rewrite(fn, mesh_of(args), args=args, analysis=before, verify=True)
    assert fixed.changed is True
    after = shardlint.analyze(fixed, *args)
    assert not [f for f in after.findings if _in_mixtral(f.source)]
    assert not [c for c in after.all_gathers() if c.cause == "lost" and has_length(c, {512, 1024})]
    # XLA's program now gathers only attention's K/V over the sequence, as before; what it
    # gathers over data are Levanter's FSDP weights, whole for the rewrite's shard_map.
    assert activation_gathers(after.collectives, TOKEN_LENGTHS) == TRUTH_CONTEXT_REWRITTEN
    assert {c.cause for c in after.all_gathers() if "data" in c.axes} == {"weights"}
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-5)


# Levanter's usual mixed precision (`mp: p=f32,c=bfloat16`): XLA gathers the same.
@pytest.fixture(scope="module")
def bf16():
    fn, args = levanter.make_step(**dict(CONTEXT, mp="p=f32,c=bfloat16"))
    return fn, args, shardlint.analyze(fn, *args)


def test_bf16_compute_gathers_what_f32_does(bf16):
    _, _, analysis = bf16
    assert activation_gathers(analysis.collectives, TOKEN_LENGTHS) == TRUTH_CONTEXT


def _verdicts(analysis) -> dict:
    return {(c.shape, c.axes, direction(c)): (c.cause, c.needed_by) for c in analysis.all_gathers()
            if has_length(c, TOKEN_LENGTHS)}


def test_bf16_gathers_are_explained_as_f32s_are(bf16, context):
    """In bf16, XLA gathers f32 values before the convert that made the flatten's operand,
    and a scanned layer stores the gathered router probabilities for the backward before
    top_k reads them: the same verdicts as in f32, at the same ops."""
    assert _verdicts(bf16[2]) == _verdicts(context[2])


def test_attentions_kv_gathers_are_lost_at_its_matmul_forward_and_backward(context):
    """Nobody asked for attention's K/V over the sequence: a sharding Levanter asks of the
    expert activations (`[1024, 96]`, tokens whole) does not explain a gather of the
    sequence (128), though a scanned layer's weight slice shares its stack with both."""
    _, _, analysis = context
    kv = [c for c in analysis.all_gathers() if c.shape == "f32[2,4,128,16]"]
    assert len(kv) == 4
    assert {(c.cause, c.needed_by) for c in kv} == {("lost", "dot_general")}


# Batch-only (Levanter's default mapping, data=8): the same gathers over `data` alone.
@pytest.fixture(scope="module")
def batch_only():
    fn, args = levanter.make_step(**dict(SMALL, train_batch_size=16))
    return fn, args, shardlint.analyze(fn, *args)


@pytest.mark.slow
def test_batch_only_routing_is_gathered_over_data(batch_only):
    _, _, analysis = batch_only
    top_k = _mixtral_line("selected_weights_, selected_experts_ = jax.lax.top_k(router_probs_")
    assert ("top_k", top_k, ("data",)) in {(f.op, f.source and f.source.line, f.axes) for f in analysis.findings}


@pytest.mark.slow
def test_batch_only_routing_is_rewritten(batch_only):
    fn, args, before = batch_only
    fixed = shardlint.rewrite(fn, mesh_of(args), args=args, analysis=before, verify=True)
    assert fixed.changed is True
    after = shardlint.analyze(fixed, *args)
    assert after.findings == ()
    # What XLA still gathers over data are Levanter's FSDP weights.
    assert {c.cause for c in after.all_gathers()} == {"weights"}


@pytest.mark.slow
def test_cli_analyzes_and_rewrites_levanters_step(tmp_path, capsys):
    out = tmp_path / "after.json"
    code = cli.main(["analyze", TARGET, "--devices", "8", *_sets(CONTEXT), "--rewrite", "--json", str(out)])
    assert code in (0, 1), capsys.readouterr().err
    findings = json.loads(out.read_text())["findings"]
    assert not [f for f in findings if "levanter/models/mixtral.py" in json.dumps(f.get("source"))]


@pytest.mark.parametrize("options, message", [
    (dict(hiden_dim=64), "Levanter's MixtralConfig, TrainerConfig and MeshConfig have no key 'hiden_dim' "
                         "(--set hiden_dim=...); did you mean hidden_dim"),
    (dict(axes={"context": 3}), "Levanter cannot lay its mesh over 8 devices with axes {'context': 3}: "),
    (dict(num_layers="two"), "Levanter rejects the config: "),
])
def test_cli_config_mistakes_are_one_line(options, message, capsys):
    code = cli.main(["analyze", TARGET, "--devices", "8", *_sets(options)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("shardlint: error: " + message), err[-1]
    assert not any(line.startswith("Traceback") for line in err)
