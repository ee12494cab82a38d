"""Qwen3NextSparseMoeBlock: routed + sigmoid-gated shared expert, on both layers; on a
mesh in the default memory-lean layout (every weight's embed dimension sharded over the
token axes) unless a case asks for `weight_axes=()`."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlint import moe

QWEN = dict(softmax_before_topk=True, norm_topk_prob=True, shared_expert_dim=24)
CASES = {
    "cp2x4": ((2, 4), ("data", "context"), P("data", "context"), {}),
    "cp1x8": ((1, 8), ("data", "context"), P("data", "context"), {}),
    "ep_a2a": ((2, 2, 2), ("data", "context", "expert"), P(("data", "expert"), "context"),
               {"expert_axis": "expert", "batch_axes": ("data", "expert"),
                "seq_axes": "context"}),
    "tp": ((2, 2, 2), ("data", "context", "tensor"), P("data", "context"),
           {"tensor_axis": "tensor", "batch_axes": "data", "seq_axes": "context"}),
    "cp4x2": ((4, 2), ("data", "context"), P("data", "context"), {}),
    "cp2x4_whole": ((2, 4), ("data", "context"), P("data", "context"), {"weight_axes": ()}),
}


@pytest.fixture(scope="module")
def lib(moe_testlib):
    return moe_testlib


def _reference(lib, strategy):
    block = moe.Qwen3NextSparseMoeBlock(lib.config(strategy=strategy, **QWEN))
    x, r = lib.activations()
    return lib.compiled_vjp(("qwen_ref", strategy), block, block.init(jax.random.key(0)), x, r)


def _sharded(lib, case, strategy):
    shape, names, x_spec, kwargs = CASES[case]
    mesh = lib.make_mesh(shape, names)
    block = moe.Qwen3NextSparseMoeBlock(lib.config(strategy=strategy, **QWEN), mesh, **kwargs)
    x, r = lib.activations()
    return lib.compiled_vjp(("qwen", case, strategy), block, block.init(jax.random.key(0)),
                            x, r, mesh, x_spec, block.param_specs())


def test_block_is_routed_plus_gated_shared_expert(lib):
    cfg = lib.config(**QWEN)
    block = moe.Qwen3NextSparseMoeBlock(cfg)
    params = block.init(jax.random.key(0))
    assert params["shared_expert"]["wi_0"].shape == (lib.D, 24)
    assert params["shared_expert"]["wo"].shape == (24, lib.D)
    assert params["shared_expert_gate"].shape == (lib.D, 1)
    x, _ = lib.activations()
    y = np.asarray(jax.jit(block)(params, x), np.float64)
    routed = np.asarray(jax.jit(moe.RoutedMoE(cfg))(params["moe"], x), np.float64)
    s = {k: np.asarray(v, np.float64) for k, v in params["shared_expert"].items()}
    xn = np.asarray(x, np.float64)
    h0, h1 = xn @ s["wi_0"], xn @ s["wi_1"]
    shared = (h0 / (1 + np.exp(-h0)) * h1) @ s["wo"]
    gate = 1 / (1 + np.exp(-(xn @ np.asarray(params["shared_expert_gate"], np.float64))))
    np.testing.assert_allclose(y, routed + gate * shared, rtol=1e-5, atol=1e-5)
    assert np.abs(gate * shared).max() > 0.1  # the shared expert contributes


@pytest.mark.parametrize("case,strategy", [("cp2x4", "sparse"), ("cp1x8", "sparse"),
                                           ("cp4x2", "sparse"), ("ep_a2a", "sparse"),
                                           ("tp", "sparse"), ("cp2x4_whole", "sparse"),
                                           ("cp2x4", "dense"), ("cp4x2", "dense"),
                                           ("ep_a2a", "dense")])
def test_block_on_a_mesh_equals_the_reference_block(lib, case, strategy):
    want = _reference(lib, strategy).run()
    got = _sharded(lib, case, strategy).run()
    lib.assert_tree_close(got, want)


def test_block_on_a_mesh_keeps_the_sequence_sharded(lib):
    hlo = _sharded(lib, "cp2x4_whole", "sparse").hlo
    assert "all-gather" not in hlo
    assert "moe/shared_expert" in hlo


def test_block_param_specs_shard_every_embed_dimension(lib):
    shape, names, _, kwargs = CASES["cp2x4"]
    block = moe.Qwen3NextSparseMoeBlock(lib.config(**QWEN), lib.make_mesh(shape, names),
                                        **kwargs)
    lean = ("data", "context")
    assert block.param_specs() == {
        "moe": block.routed.param_specs(),
        "shared_expert": {"wi_0": P(lean, None), "wi_1": P(lean, None), "wo": P(None, lean)},
        "shared_expert_gate": P(lean, None)}
    params = jax.eval_shape(block.init, jax.random.key(0))
    shardings = block.param_shardings()
    assert jax.tree.structure(shardings) == jax.tree.structure(params)
    with pytest.raises(TypeError, match="without a mesh has no layout"):
        moe.Qwen3NextSparseMoeBlock(lib.config(**QWEN)).param_specs()


def test_sharded_keywords_need_a_mesh(lib):
    with pytest.raises(TypeError, match="expert_axis"):
        moe.Qwen3NextSparseMoeBlock(lib.config(), expert_axis="expert")
