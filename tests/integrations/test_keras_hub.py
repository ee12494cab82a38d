"""shardlint on keras-hub's Qwen3-MoE on Keras's JAX backend (`keras-hub` from the
registry): the training step `model.fit` runs, through `shardlint.integrations.keras_hub`.

Keras's own distribution: a `DeviceMesh` of axes `(batch, model)` at 2 x 4 on 8 CPU
devices, keras-hub's own partition rules (`Qwen3MoeBackbone.get_layout_map`: embedding
dimensions over `batch`, FSDP style, and heads over `model`) and `ModelParallel`, which
shards the input batch over `batch`. Keras has no sequence parallelism. Two layers, small
dims chosen so that no weight has the sequence's length (128) or the flattened tokens'
(512). keras-hub's Qwen3-MoE flattens `(batch, seq)`, routes with `top_k` and runs every
expert on every token (a batched einsum), combining with a dense `[experts, tokens]`
routing matrix.

TRUTH_* are what XLA's compiled program gathers (`support.hlo_gathers`), beside what
shardlint says of them. Runs where keras-hub is installed (CI's Python 3.12 environment
with the newest JAX: `pip install -e '.[test,keras-hub]'`).
"""

from __future__ import annotations

import importlib.util
import inspect
import json

import jax
import pytest

# Not imported here: Keras fixes its backend when first imported, and the target asks for JAX.
if importlib.util.find_spec("keras_hub") is None:
    pytest.skip("keras-hub is not installed: pip install -e '.[keras-hub]'", allow_module_level=True)

import shardlint  # noqa: E402
from shardlint import cli  # noqa: E402
from shardlint.analyzer.compile._compile import mesh_of  # noqa: E402
from shardlint.integrations import keras_hub  # noqa: E402
from shardlint.rewrites import verify_same  # noqa: E402

from support.hlo_gathers import activation_gathers, has_length  # noqa: E402
from support.cli_words import set_words as _sets  # noqa: E402

pytestmark = pytest.mark.keras_hub

TARGET = "shardlint.integrations.keras_hub:make_step"
SMALL = dict(vocabulary_size=200, num_layers=2, num_query_heads=4, num_key_value_heads=4, head_dim=16,
             hidden_dim=64, intermediate_dim=96, moe_intermediate_dim=96, num_experts=8, top_k=2,
             sequence_length=128)
MODEL_PARALLEL = dict(SMALL, mesh_shape=[2, 4], batch_size=4)
TOKEN_LENGTHS = {128, 256, 512}   # sequence, one batch shard's tokens, all tokens

# XLA at batch=2 x model=4, keras-hub 0.32.0 / Keras 3.15.1, the same with JAX 0.10.2 and
# 0.12.1: in each of the two MoE layers, the router's probabilities are gathered over
# `model` and then over `batch` before each of the two top_k (routing, and the
# load-balancing loss), the flattened tokens over `batch` before the experts' einsum, the
# dense routing matrix over `batch`; in the backward the combine's tokens, weights and
# every expert's output over `batch`.
TRUTH_MODEL_PARALLEL = {
    ("f32[256,8]", ("model",), "forward"): 4,
    ("f32[512,8]", ("batch",), "forward"): 4,
    ("f32[512,64]", ("batch",), "forward"): 2,
    ("f32[8,512]", ("batch",), "forward"): 2,
    ("f32[8,512]", ("batch",), "backward"): 2,
    ("f32[512,2]", ("batch",), "backward"): 2,
    ("f32[8,512,64]", ("batch",), "backward"): 2,
}


@pytest.fixture(scope="module")
def model_parallel():
    fn, args = keras_hub.make_step(**MODEL_PARALLEL)
    return fn, args, shardlint.analyze(fn, *args)


def _decoder_line(snippet: str) -> int:
    from keras_hub.src.models.qwen3_moe import qwen3_moe_decoder

    lines = inspect.getsource(qwen3_moe_decoder).splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if snippet in line]
    assert len(hits) == 1, (snippet, hits)
    return hits[0]


def _in_decoder(source) -> bool:
    return source is not None and source.file.endswith("keras_hub/src/models/qwen3_moe/qwen3_moe_decoder.py")


def _routers_gathers_on_top_k(analysis, shape: str) -> set[str]:
    """The gathers over `batch` of the router's probabilities (`shape`) that shardlint puts
    on a finding at the routing top_k (its user frames pass the decoder's line; the innermost
    is Keras's `ops` wrapper)."""
    top_k = _decoder_line("top_p, top_i = ops.top_k(router_probs, k=self.top_k)")
    at_top_k = {cid for f in analysis.findings if f.op == "top_k"
                and any(_in_decoder(s) and s.line == top_k for s in f.stack) for cid in f.collectives}
    return at_top_k & {c.id for c in analysis.all_gathers() if "sparse_moe_block" in c.xla_op_path
                       and c.shape == shape and c.axes == ("batch",)}


def test_keras_lays_out_its_own_mesh_and_batch(model_parallel):
    _, (_, data), analysis = model_parallel
    assert analysis.mesh == {"batch": 2, "model": 4}
    x, y, sample_weight = data
    assert [tuple(a.sharding.spec) for a in (x["token_ids"], x["padding_mask"], y, sample_weight)] == \
        [("batch", None)] * 4


def test_xla_gathers_the_routing_and_the_tokens(model_parallel):
    _, _, analysis = model_parallel
    moe = [c for c in analysis.collectives if "sparse_moe_block" in c.xla_op_path]
    assert activation_gathers(moe, TOKEN_LENGTHS) == TRUTH_MODEL_PARALLEL


def test_shardlint_puts_the_routers_gathers_over_the_batch_on_top_k(model_parallel):
    _, _, analysis = model_parallel
    # One per layer at least (the load-balancing loss's top_k may claim the others).
    assert len(_routers_gathers_on_top_k(analysis, "f32[512,8]")) >= 2
    # Every gather of the MoE's 512 tokens is explained as lost.
    tokens = [c for c in analysis.all_gathers() if "sparse_moe_block" in c.xla_op_path and has_length(c, {512})]
    assert tokens and all(c.cause == "lost" for c in tokens), tokens


def test_every_finding_of_a_lost_sharding_is_linked_to_a_collective(model_parallel):
    """Every drop and every op the partitioner could not split names the gathers it costs:
    with JAX 0.12 the router's probabilities are gathered for top_k over `model`, then over
    `batch`, and each gather is a top_k finding's (once, 'top_k drops model' claimed none)."""
    _, _, analysis = model_parallel
    lost = [f for f in analysis.findings if f.kind != "full-rematerialization"]
    assert lost and [f"{f.source} {f.op}" for f in lost if not f.collectives] == []


@pytest.mark.xfail(jax.__version_info__ >= (0, 12), strict=True, reason=(
    "issue 41, item 4 (JAX 0.12; JAX 0.10.2 logs none here): XLA's 'involuntary full rematerialization' "
    "messages become findings with no collective linked, one of them with no line (fake_parameter.2); "
    "the layer norm's gather (qwen3_moe_layernorm.py:40) is claimed by the partitioner's finding at that op"))
def test_every_rematerialization_finding_is_linked_to_a_collective(model_parallel):
    _, _, analysis = model_parallel
    remats = [f for f in analysis.findings if f.kind == "full-rematerialization"]
    assert [f"{f.source} {f.op}" for f in remats if not f.collectives or f.source is None] == []


def test_rewrite_routes_each_batch_shards_tokens_with_the_same_numbers(model_parallel):
    """keras-hub's load-balancing loss (`compute_load_balancing_loss`, in `model.fit`'s step)
    sums over every token of the layer and divides by `maximum(count, 1e-9)`: those sums leave
    the per-shard region summed across the batch shards, and the loss is keras-hub's own."""
    fn, args, before = model_parallel
    fixed = shardlint.rewrite(fn, mesh_of(args), args=args, analysis=before, verify=True)
    assert fixed.changed is True
    after = shardlint.analyze(fixed, *args)
    assert not [c for c in after.all_gathers() if "sparse_moe_block" in c.xla_op_path and "batch" in c.axes]
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-5)


def test_data_parallel_routing_is_gathered_over_the_batch():
    """batch=8 x model=1: keras-hub's layout map then shards the embedding dimension over all
    8 devices (its heads too, hence 8 heads)."""
    fn, args = keras_hub.make_step(**dict(SMALL, num_query_heads=8, num_key_value_heads=8, head_dim=8,
                                          mesh_shape=[8, 1], batch_size=16))
    analysis = shardlint.analyze(fn, *args)
    assert len(_routers_gathers_on_top_k(analysis, "f32[2048,8]")) >= 2


def test_cli_rewrites_keras_hubs_routing(tmp_path, capsys):
    out = tmp_path / "after.json"
    code = cli.main(["analyze", TARGET, "--devices", "8", *_sets(MODEL_PARALLEL), "--rewrite", "--json", str(out)])
    err = capsys.readouterr().err
    assert code in (0, 1) and "NothingToRewrite" not in err, err
    findings = json.loads(out.read_text())["findings"]
    assert not [f for f in findings if "qwen3_moe_decoder.py" in json.dumps(f["stack"])
                and "batch" in f["axes"]]


@pytest.mark.parametrize("options, message", [
    (dict(SMALL, num_layer=2), "Qwen3MoeBackbone takes no argument 'num_layer' (--set num_layer=...); it takes "),
    ({k: v for k, v in SMALL.items() if k != "num_experts"},
     "Qwen3MoeBackbone needs num_experts (--set num_experts=...)"),
    (dict(SMALL, mesh_shape=[3, 2]), "mesh_shape [3, 2] must be [batch, model] with batch x model = 8 devices"),
])
def test_cli_config_mistakes_are_one_line(options, message, capsys):
    code = cli.main(["analyze", TARGET, "--devices", "8", *_sets(options)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("shardlint: error: " + message), err[-1]
    assert not any(line.startswith("Traceback") for line in err)


def test_another_keras_backend_is_one_line(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    with pytest.raises(keras_hub.KerasHubError, match="KERAS_BACKEND is 'torch': keras-hub's step runs on "
                                                      "Keras's JAX backend"):
        keras_hub.make_step(**SMALL)
