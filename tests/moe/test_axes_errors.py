"""Where ShardedRoutedMoE reads the token axes from, and how it refuses bad layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint import moe


@pytest.fixture(scope="module")
def lib(moe_testlib):
    return moe_testlib


def test_explicit_keywords_win(lib):
    mesh = lib.make_mesh((2, 4), ("data", "context"))
    layer = moe.ShardedRoutedMoE(lib.config(), mesh, seq_axes="data")
    x = jax.device_put(jnp.zeros((4, 16, lib.D)), NamedSharding(mesh, P("data", "context")))
    assert layer.token_axes(x) == moe.TokenAxes((), ("data",), "explicit")


def test_concrete_array_sharding_is_read_and_kept(lib):
    mesh = lib.make_mesh((2, 4), ("data", "context"))
    cfg = lib.config()
    layer = moe.ShardedRoutedMoE(cfg, mesh)
    x, _ = lib.activations()
    xs = jax.device_put(x, NamedSharding(mesh, P(None, ("data", "context"))))
    assert layer.token_axes(xs) == moe.TokenAxes((), ("data", "context"), "array")
    params = layer.init(jax.random.key(0))
    y = layer(params, xs)  # eager call on a concrete, sharded array
    assert y.sharding.is_equivalent_to(xs.sharding, 3)
    want = jax.jit(moe.RoutedMoE(cfg))(params, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,names,x_shape,tensor,want", [
    ((2, 4), ("data", "context"), (4, 16), None, (("data",), ("context",))),
    ((1, 8), ("data", "context"), (2, 16), None, ((), ("context",))),
    ((4, 2), ("data", "context"), (4, 16), None, (("data",), ("context",))),
    # the tensor axis never shards tokens by the rule; size-1 axes are skipped
    ((2, 2, 2), ("data", "context", "tensor"), (2, 16), "tensor", (("data",), ("context",))),
    # the expert axis takes part (MaxText shards the batch over it too)
    ((2, 2, 2), ("data", "expert", "context"), (4, 16), None,
     (("data", "expert"), ("context",))),
    # nothing divides: left replicated rather than wrong
    ((8,), ("data",), (3, 5), None, ((), ())),
])
def test_rule_under_jit_on_auto_axes(lib, shape, names, x_shape, tensor, want):
    mesh = lib.make_mesh(shape, names)
    layer = moe.ShardedRoutedMoE(lib.config(), mesh, tensor_axis=tensor)
    seen = []
    jax.jit(lambda x: seen.append(layer.token_axes(x)) or x).lower(
        jax.ShapeDtypeStruct(x_shape + (lib.D,), jnp.float32))
    assert seen == [moe.TokenAxes(*want, "rule")]


def test_explicit_mesh_type_is_read_and_the_layer_runs(lib):
    mesh = lib.make_mesh((2, 4), ("data", "context"), AxisType.Explicit)
    cfg = lib.config()
    layer = moe.ShardedRoutedMoE(cfg, mesh)
    params = layer.init(jax.random.key(0))
    x, _ = lib.activations()
    want = jax.jit(moe.RoutedMoE(cfg))(params, x)
    xs = jax.device_put(x, NamedSharding(mesh, P("context", "data")))  # unusual on purpose
    seen = []

    def f(p, x):
        seen.append(layer.token_axes(x))
        return layer(p, x)

    y = jax.jit(f)(params, xs)
    assert seen == [moe.TokenAxes(("context",), ("data",), "type")]
    assert y.sharding.is_equivalent_to(xs.sharding, 3)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_construction_reports_every_static_problem(lib):
    mesh = lib.make_mesh((4, 2), ("expert", "tensor"))
    with pytest.raises(moe.MoeShardingError) as err:
        moe.ShardedRoutedMoE(lib.config(num_experts=6, top_k=2, mlp_dim=31), mesh,
                             expert_axis="expert", tensor_axis="tensor")
    text = str(err.value)
    assert "num_experts=6 is not divisible by the expert-parallel degree 4" in text
    assert "mlp_dim=31 is not divisible by the tensor-parallel degree 2" in text
    assert "expert_axis=None" in text  # the way out
    assert isinstance(err.value, ValueError)

    with pytest.raises(moe.MoeShardingError, match="'experts' is not a mesh axis"):
        moe.ShardedRoutedMoE(lib.config(), mesh, expert_axis="experts")


def test_call_reports_every_shape_problem(lib):
    mesh = lib.make_mesh((2, 4), ("data", "context"))
    layer = moe.ShardedRoutedMoE(lib.config(), mesh, batch_axes="data", seq_axes="context")
    params = layer.init(jax.random.key(0))
    with pytest.raises(ValueError) as err:
        layer(params, jnp.zeros((3, 30, lib.D)))
    text = str(err.value)
    assert "sequence length 30 is not divisible by the context degree 4" in text
    assert "pad the sequence to a multiple of it" in text
    assert "batch size 3 is not divisible by the data-parallel degree 2" in text
    assert text.count("\n  - ") == 2


def test_top_k_over_experts_is_refused_before_any_layer_exists():
    with pytest.raises(ValueError, match=r"top_k=5 > num_experts=4"):
        moe.MoeConfig(num_experts=4, top_k=5, emb_dim=8, mlp_dim=8)
