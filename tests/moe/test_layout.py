"""The memory-lean weight layout as shardlint's analyzer sees it, and how bad layouts are
refused.

A value_and_grad step of the weight-sharded layer (w.r.t. params and x) is analyzed on
abstract arguments carrying `param_shardings()`: every all-gather must be a `weights`
gather (one per weight, over the layer's weight axes), never an activation gather, and
the analysis has no finding.
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
                      {"expert_axis": "expert"}, {}, False),
    "qwen-cp2x4-sparse": ((2, 4), DP_CP, P("data", "context"), {}, QWEN, True),
}

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
    weight_axes = layer.routed.weight_axes if qwen else layer.weight_axes
    return shardlint.analyze(step, params, x, params_argnums=(0,)), params, weight_axes

@pytest.mark.parametrize("case", sorted(CASES))
def test_every_all_gather_is_a_weights_gather(lib, case):
    analysis, params, weight_axes = _analysis(lib, case)
    gathers = analysis.all_gathers()
    assert weight_axes, "the default layout shards the weights"
    assert len(gathers) == len(jax.tree.leaves(params)), gathers  # one per weight
    assert all(c.cause == "weights" for c in gathers), [(c.id, c.cause) for c in gathers]
    assert {a for c in gathers for a in c.axes} == set(weight_axes)
    assert analysis.findings == ()
    assert analysis.by_cause("lost") == () and analysis.by_cause("requested") == ()
    # the gradients leave reduce-scattered to the weights' sharding
    assert [c for c in analysis.collectives if c.kind == "reduce-scatter"]

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

def test_defaults_follow_the_given_token_axes(lib):
    mesh = lib.make_mesh((2, 2, 2), ("data", "context", "tensor"))
    cfg = lib.config()
    assert moe.ShardedRoutedMoE(cfg, mesh).weight_axes == ("data", "context", "tensor")
    assert moe.ShardedRoutedMoE(cfg, mesh, tensor_axis="tensor").weight_axes == (
        "data", "context")
    assert moe.ShardedRoutedMoE(cfg, mesh, seq_axes="context").weight_axes == ("context",)
    assert moe.ShardedRoutedMoE(cfg, mesh, weight_axes=()).param_specs()["wi_0"] == P(
        None, None, None)

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
