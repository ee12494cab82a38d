"""The memory-lean weight layout as shardlint's analyzer sees it, and how bad layouts are
refused.

A value_and_grad step of the weight-sharded layer (w.r.t. params and x) is analyzed on
abstract arguments carrying `param_shardings()`: every all-gather must be a `weights`
gather over the layer's weight axes (of every weight gathered whole, in pieces or in one;
under `weight_gather="ring"` the router kernel's and the Qwen shared expert's, while the
expert matrices travel by collective-permute), never an activation gather, and the
analysis has no finding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardlint
from shardlint import moe

DP_CP = ("data", "context")
QWEN = dict(softmax_before_topk=True, norm_topk_prob=True, shared_expert_dim=24)
CASES = {
    # id: (mesh shape, mesh axis names, x spec, layer keywords, config overrides, Qwen block)
    "cp2x4-sparse": ((2, 4), DP_CP, P("data", "context"), {}, {}, False),
    "cp4x2-dense": ((4, 2), DP_CP, P("data", "context"), {}, {"strategy": "dense"}, False),
    "cp1x8-sparse": ((1, 8), DP_CP, P("data", "context"), {}, {}, False),
    "ep-a2a-sparse": ((2, 2, 2), DP_CP + ("expert",), P(("data", "expert"), "context"),
                      {"expert_axis": "expert", "weight_gather": "ring"}, {}, False),
    "qwen-cp2x4-sparse": ((2, 4), DP_CP, P("data", "context"), {}, QWEN, True),
    "cp2x4-sparse-ring": ((2, 4), DP_CP, P("data", "context"), {"weight_gather": "ring"},
                          {}, False),
    "qwen-cp2x4-dense-ring": ((2, 4), DP_CP, P("data", "context"),
                              {"weight_gather": "ring"}, {"strategy": "dense", **QWEN}, True),
}
EXPERT_MATRICES = ("wi_0", "wi_1", "wo")

@pytest.fixture(scope="module")
def lib(moe_testlib):
    return moe_testlib

def _as_axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

def _analysis(lib, case):
    shape, names, x_spec, kwargs, overrides, qwen = CASES[case]
    mesh = lib.make_mesh(shape, names)
    axes = {"batch_axes": _as_axes(x_spec[0]), "seq_axes": _as_axes(x_spec[1])}
    cfg = lib.config(**overrides)
    layer = (moe.Qwen3NextSparseMoeBlock(cfg, mesh, **axes, **kwargs) if qwen
             else moe.ShardedRoutedMoE(cfg, mesh, **axes, **kwargs))
    params = jax.tree.map(
        lambda w, s: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=s),
        jax.eval_shape(layer.init, jax.random.key(0)), layer.param_shardings())
    x = jax.ShapeDtypeStruct((lib.B, lib.S, lib.D), jnp.float32,
                             sharding=NamedSharding(mesh, x_spec))
    step = jax.value_and_grad(lambda p, x: jnp.mean(layer(p, x) ** 2), argnums=(0, 1))
    routed = layer.routed if qwen else layer
    return shardlint.analyze(step, params, x, params_argnums=(0,)), params, routed

@pytest.mark.parametrize("case", sorted(CASES))
def test_every_all_gather_is_a_weights_gather(lib, case):
    analysis, params, routed = _analysis(lib, case)
    weight_axes = routed.weight_axes
    gathers = analysis.all_gathers()
    assert weight_axes, "the default layout shards the weights"
    assert routed.weight_gather == CASES[case][3].get("weight_gather", "whole")
    moe_params = params["moe"] if "moe" in params else params
    travelling = len(EXPERT_MATRICES) if routed.weight_gather == "ring" else 0
    # each weight gathered whole for the forward pass and again for the backward pass
    # (XLA:CPU may merge the two: it drops the optimization barrier between them); the
    # expert matrices under "whole" in pieces, a first one and a loop over the others
    gathered_whole = len(jax.tree.leaves(params)) - travelling
    in_pieces = len(EXPERT_MATRICES) - travelling
    assert gathered_whole <= len(gathers) <= 2 * gathered_whole + 2 * in_pieces, gathers
    assert all(c.cause == "weights" for c in gathers), [(c.id, c.cause) for c in gathers]
    assert {a for c in gathers for a in c.axes} == set(weight_axes)
    assert analysis.findings == ()
    assert analysis.by_cause("lost") == () and analysis.by_cause("requested") == ()
    # the gradients leave reduce-scattered to the weights' sharding (the router's at
    # least); under the ring, the expert matrices and their gradients' slices go round
    # the weight axes by collective-permute, and nothing else does
    assert [c for c in analysis.collectives if c.kind == "reduce-scatter"]
    permutes = [c for c in analysis.collectives if c.kind == "collective-permute"]
    if travelling:
        assert permutes and all(c.axes == tuple(weight_axes) for c in permutes), permutes
        # one slice of an expert matrix (or of its gradient) per permute
        assert all(moe_params[k].dtype == jnp.float32 for k in EXPERT_MATRICES)
        slices = {"f32[%s]" % ",".join(map(str, routed.param_shardings()[k].shard_shape(
            moe_params[k].shape))) for k in EXPERT_MATRICES}
        assert {c.shape for c in permutes} <= slices, ({c.shape for c in permutes}, slices)
    else:
        assert "expert_axis" in CASES[case][3] or not permutes, permutes

def test_weight_axes_are_checked_at_construction(lib):
    mesh = lib.make_mesh((2, 2, 2), ("data", "context", "expert"))
    with pytest.raises(moe.MoeShardingError) as err:
        moe.ShardedRoutedMoE(lib.config(emb_dim=6), mesh, expert_axis="expert",
                             weight_axes=("data", "expert", "fsdp", "data"))
    text = str(err.value)
    assert "weight_axes ['fsdp'] are not mesh axes" in text
    assert "weight_axes ['expert'] already shard the experts" in text
    assert "name an axis twice" in text
    with pytest.raises(moe.MoeShardingError,
                       match=r"emb_dim=6 is not divisible by 4.*weight_axes=\.\.\."):
        moe.ShardedRoutedMoE(lib.config(emb_dim=6), mesh, weight_axes=("data", "context"))
    with pytest.raises(moe.MoeShardingError, match=r"weight_gather='all' is not one of "
                                                   r"\('whole', 'ring'\)"):
        moe.ShardedRoutedMoE(lib.config(), mesh, weight_gather="all")
    with pytest.raises(moe.MoeShardingError, match=r"weight_axes=\(\) shards them over none"):
        moe.ShardedRoutedMoE(lib.config(), mesh, weight_axes=(), weight_gather="ring")

def test_defaults_follow_the_given_token_axes(lib):
    mesh = lib.make_mesh((2, 2, 2), ("data", "context", "tensor"))
    cfg = lib.config()
    assert moe.ShardedRoutedMoE(cfg, mesh).weight_axes == ("data", "context", "tensor")
    assert moe.ShardedRoutedMoE(cfg, mesh, tensor_axis="tensor").weight_axes == (
        "data", "context")
    assert moe.ShardedRoutedMoE(cfg, mesh, seq_axes="context").weight_axes == ("context",)
    assert moe.ShardedRoutedMoE(cfg, mesh, weight_axes=()).param_specs()["wi_0"] == P(
        None, None, None)
    # the whole gather in 2 pieces per weight device, the ring when asked
    slices = lambda **kw: moe.ShardedRoutedMoE(cfg, mesh, **kw).weight_slices
    assert (slices().ring, slices().size, slices().pieces) == (False, 8, 16)
    assert (slices(seq_axes="context").size, slices(seq_axes="context").pieces) == (2, 4)
    assert slices(weight_axes=()).size == 1
    assert slices(seq_axes="context", weight_gather="ring").ring

def test_a_weight_axis_that_does_not_shard_the_tokens_is_refused(lib):
    mesh = lib.make_mesh((2, 4), DP_CP)
    layer = moe.ShardedRoutedMoE(lib.config(), mesh, batch_axes=(), seq_axes="context",
                                 weight_axes=("data", "context"))
    params = jax.eval_shape(layer.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((lib.B, lib.S, lib.D), jnp.float32)
    with pytest.raises(moe.MoeShardingError) as err:
        jax.eval_shape(layer, params, x)
    text = str(err.value)
    assert "weight_axes ['data'] shard the weights but not the tokens of this call" in text
    assert "weight_axes=('context',)" in text  # the way out


@pytest.mark.parametrize("gather", ["whole", "ring"])
def test_a_device_holds_less_than_the_expert_matrices(lib, gather):
    """Weights large next to the tokens (emb 256, 64 tokens, 8 devices): gathering the
    expert matrices whole at once put all of them, and their whole gradients, in temp
    (14.0 MiB against 6 MiB of matrices, measured before they came in pieces). In pieces
    or round the ring a device holds a fraction of them: temp below the matrices."""
    mesh = lib.make_mesh((1, 8), DP_CP)
    cfg = lib.config(emb_dim=256, mlp_dim=256)
    x = jax.ShapeDtypeStruct((1, 64, 256), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "context")))
    layer = moe.ShardedRoutedMoE(cfg, mesh, batch_axes=(), seq_axes="context",
                                 weight_gather=gather)
    params = jax.tree.map(
        lambda w, s: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=s),
        jax.eval_shape(layer.init, jax.random.key(0)), layer.param_shardings())
    step = jax.jit(jax.value_and_grad(lambda p, x: jnp.mean(layer(p, x) ** 2),
                                      argnums=(0, 1)))
    temp = step.lower(params, x).compile().memory_analysis().temp_size_in_bytes
    matrices = sum(params[k].size * 4 for k in EXPERT_MATRICES)
    assert temp < matrices, (temp, matrices)


@pytest.mark.parametrize("gather", ["whole", "ring"])
def test_a_scan_of_layers_keeps_no_layer_s_whole_matrices_for_its_backward(lib, gather):
    """A scanned stack without remat: each more layer adds its activations to temp, never
    its gathered expert matrices (before the whole gather had its own backward pass,
    autodiff saved them: 2 -> 4 layers added 12.9 MB against 1.9 MB now)."""
    mesh = lib.make_mesh((1, 8), DP_CP)
    cfg = lib.config(emb_dim=256, mlp_dim=256)
    layer = moe.ShardedRoutedMoE(cfg, mesh, batch_axes=(), seq_axes="context",
                                 weight_gather=gather)
    shapes = jax.eval_shape(layer.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, 64, 256), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "context")))

    def loss(stacked, x):
        x, _ = jax.lax.scan(lambda h, p: (h + layer(p, h), None), x, stacked)
        return jnp.mean(x ** 2)

    def temp(layers):
        stacked = jax.tree.map(lambda w, s: jax.ShapeDtypeStruct(
            (layers,) + w.shape, w.dtype, sharding=NamedSharding(mesh, P(None, *s.spec))),
            shapes, layer.param_shardings())
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return step.lower(stacked, x).compile().memory_analysis().temp_size_in_bytes

    matrices = sum(shapes[k].size * 4 for k in EXPERT_MATRICES)
    two, four = temp(2), temp(4)
    assert four - two < matrices, (two, four, matrices)
