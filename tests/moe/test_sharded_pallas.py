"""ShardedRoutedMoE's Pallas path inside its shard_map on 8 simulated devices: outputs and
every gradient equal to the XLA path's (`ragged_dot`), on a data x context mesh and with
the expert weights sharded over an expert axis (all-to-all, or each device's experts on
all its tokens) or over a tensor axis (also sequence-parallel).

The Pallas path needs the expert weights whole along D on each device (`_plan.plan`),
so every case here keeps `weight_axes=()`; the memory-lean default shards D and takes
`ragged_dot`. The kernels run in Pallas interpret mode, one device's values at a time in
a host callback (`_compat.per_device`: JAX's interpreters fail on values that vary over
`shard_map` axes); everything around them (the layout, the permutation, the custom VJPs
and their varying-axes casts, the psums) is the program a TPU runs. Interpret mode is
slow: tiny shapes, and in the default run two float32 cases (data x context, and the
expert axis that shards no tokens, where `permute_rows` must cast x), the others `slow`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_paths
from shardlint import moe

# the Pallas path's kernels: the sort, SwiGLU and combine as one (`_gmm.tiled_experts`: 2
# products and a gather forward; 5 products, a gather and a dot back), or the SwiGLU alone
# (the all-to-all path: `grouped_swiglu`, rows back by `permute_rows`; 2 forward, 5 back)
KERNELS = {"expert_all_to_all": 7}

DP_CP = ("data", "context")
CASES = {
    # id: (mesh shape, mesh axis names, ShardedRoutedMoE keywords)
    "data_context": ((2, 4), DP_CP, {"batch_axes": "data", "seq_axes": "context"}),
    "expert_all_to_all": ((2, 2, 2), DP_CP + ("expert",),
                          {"batch_axes": ("data", "expert"), "seq_axes": "context",
                           "expert_axis": "expert"}),
    # the expert axis shards no tokens: each device's experts on all its tokens, psum
    "expert_local": ((2, 2, 2), DP_CP + ("expert",),
                     {"batch_axes": "data", "seq_axes": "context", "expert_axis": "expert"}),
    "tensor": ((2, 2, 2), DP_CP + ("tensor",),
               {"batch_axes": "data", "seq_axes": "context", "tensor_axis": "tensor"}),
    "tensor_seq_parallel": ((2, 2, 2), DP_CP + ("tensor",),
                            {"batch_axes": "data", "seq_axes": ("context", "tensor"),
                             "tensor_axis": "tensor"}),
}
FAST = {("data_context", "float32"), ("expert_local", "float32")}
PARAMS = [pytest.param(case, dtype, id=f"{case}-{dtype}",
                       marks=() if (case, dtype) in FAST else pytest.mark.slow)
          for case in CASES for dtype in ("float32", "bfloat16")]


def _layer(lib, case: str, dtype: str = "float32", **sizes):
    shape, names, kw = CASES[case]
    mesh = lib.make_mesh(shape, names)
    cfg = lib.config(dtype=jnp.dtype(dtype), **sizes)
    return moe.ShardedRoutedMoE(cfg, mesh, weight_axes=(), **kw), mesh


def _inputs(lib, layer, mesh, dtype: str, emb: int | None = None):
    """init's params in the layer's layout (E over the expert axis, F over the tensor
    axis) and x, r over the token axes."""
    params = jax.device_put(layer.init(jax.random.key(0)), layer.param_shardings())
    shape = (lib.B, lib.S, emb or lib.D)
    x, r = (jax.device_put(v.astype(dtype), NamedSharding(mesh, P(layer.batch_axes,
                                                                     layer.seq_axes)))
            for v in lib.activations(shape))
    return params, x, r


@pytest.mark.parametrize("case, dtype", PARAMS)
def test_pallas_path_equals_the_xla_path(lib, case, dtype):
    """Outputs and every gradient equal; the interpret run took the Pallas path on every
    device: no ragged_dot, and the kernels of the experts' forward and backward pass
    (`KERNELS`) each in a host callback."""
    layer, mesh = _layer(lib, case, dtype)
    params, x, r = _inputs(lib, layer, mesh, dtype)
    step = pallas_paths.traced_step(layer, "interpret", row_tile=8)
    jaxpr = jax.make_jaxpr(step)(params, x, r).jaxpr
    assert len(pallas_paths.equations(jaxpr, "pure_callback")) == KERNELS.get(case, 10)
    assert not pallas_paths.equations(jaxpr, "ragged_dot")
    want = pallas_paths.layer_vjp(layer, params, x, r, "xla")
    got = pallas_paths.layer_vjp(layer, params, x, r, "interpret", row_tile=8)
    pallas_paths.assert_close(got, want, dtype)


def test_the_compiled_kernels_type_check_inside_shard_map(lib):
    """The TPU's program (kernels compiled, not interpreted) traces on a data x context
    mesh: the ten pallas_calls of the experts' forward and backward pass, each stating
    outputs that vary over both axes as its rows do. D and F tile by 128, as the compiled
    kernels need (tests/tpu compiles it for a TPU)."""
    layer, mesh = _layer(lib, "data_context", "bfloat16", emb_dim=128, mlp_dim=128)
    params, x, r = _inputs(lib, layer, mesh, "bfloat16", emb=128)
    jaxpr = jax.make_jaxpr(pallas_paths.traced_step(layer, "pallas"))(params, x, r).jaxpr
    calls = pallas_paths.equations(jaxpr, "pallas_call")
    assert sorted(eqn.params["name"] for eqn in calls) == sorted(
        ["shardlint_gmm_up", "shardlint_gmm", "shardlint_gmm_down_grad",
         "shardlint_gmm_up_grad", "shardlint_rows_dot"] + ["shardlint_tgmm"] * 3
        + ["shardlint_gather_sum"] * 2)
    assert {frozenset(v.aval.manual_axis_type.varying) for eqn in calls
            for v in eqn.outvars} == {frozenset(DP_CP)}
    assert not pallas_paths.equations(jaxpr, "ragged_dot")


@pytest.fixture(scope="module")
def lib(moe_testlib):
    return moe_testlib
