"""Property test: for random experts, top_k, shapes and meshes the sharded layer equals
the reference (forward and input/weight gradients). Few examples by default (each is two
compiles); the slow variant draws many more."""

from __future__ import annotations

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from shardlint import moe

MESHES = [((1, 8), ("data", "context"), {}), ((2, 4), ("data", "context"), {}),
          ((4, 2), ("data", "context"), {}),
          ((2, 2, 2), ("data", "context", "expert"), {"expert_axis": "expert"}),
          ((2, 2, 2), ("data", "context", "tensor"), {"tensor_axis": "tensor"})]


@st.composite
def layouts(draw):
    shape, names, kwargs = draw(st.sampled_from(MESHES))
    ep = shape[2] if "expert_axis" in kwargs else 1
    num_experts = ep * draw(st.integers(1, 8 // ep))
    top_k = draw(st.integers(1, min(num_experts, 3)))
    batch = shape[0] * (2 if "expert_axis" in kwargs else 1) * draw(st.integers(1, 2))
    seq = shape[1] * draw(st.sampled_from([1, 2, 3]))
    strategy = draw(st.sampled_from(["sparse", "dense"]))
    before = draw(st.booleans())
    return shape, names, kwargs, num_experts, top_k, batch, seq, strategy, before


def _check(lib, layout):
    shape, names, kwargs, num_experts, top_k, batch, seq, strategy, before = layout
    cfg = lib.config(num_experts=num_experts, top_k=top_k, strategy=strategy,
                     softmax_before_topk=before, norm_topk_prob=before)
    mesh = lib.make_mesh(shape, names)
    batch_axes = ("data", "expert") if "expert_axis" in kwargs else ("data",)
    x_spec = P(batch_axes, "context")
    layer = moe.ShardedRoutedMoE(cfg, mesh, batch_axes=batch_axes, seq_axes="context",
                                 **kwargs)
    params = layer.init(jax.random.key(5))
    x, r = lib.activations((batch, seq, lib.D), seed=6)
    key = (shape, names, tuple(sorted(kwargs.items())), *layout[3:])
    want = lib.compiled_vjp(("prop_ref", key), moe.RoutedMoE(cfg), params, x, r).run()
    got = lib.compiled_vjp(("prop", key), layer, params, x, r, mesh, x_spec,
                           layer.param_specs()).run()
    lib.assert_tree_close(got, want)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(layout=layouts())
def test_sharded_equals_reference_for_random_layouts(moe_testlib, layout):
    _check(moe_testlib, layout)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(layout=layouts())
def test_sharded_equals_reference_for_many_random_layouts(moe_testlib, layout):
    _check(moe_testlib, layout)
