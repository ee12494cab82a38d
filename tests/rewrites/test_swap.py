"""shardlint.rewrite on models built on shardlint.moe: RoutedMoE is swapped for
ShardedRoutedMoE at trace time, and the result is verified like the jaxpr route's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardlint
from shardlint import moe
from shardlint.rewrites import SwappedStep
from shardlint.rewrites._verify import random_like

from support import context_mesh

B, S = 8, 32


def _block_step(mesh, cfg):
    block = moe.Qwen3NextSparseMoeBlock(cfg)  # mesh=None: the reference RoutedMoE inside

    def step(params, x_BSD):
        return jax.value_and_grad(lambda p: jnp.mean(block(p, x_BSD) ** 2))(params)

    params = jax.eval_shape(block.init, jax.random.key(0))
    replicated = NamedSharding(mesh, P())
    params = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), params)
    x = jax.ShapeDtypeStruct((B, S, cfg.emb_dim), jnp.float32, sharding=NamedSharding(mesh, P("data", "context", None)))
    return step, (params, x)


SPARSE = moe.MoeConfig(num_experts=4, top_k=2, emb_dim=16, mlp_dim=32)
DENSE_NO_DROP = moe.MoeConfig(num_experts=4, top_k=2, emb_dim=16, mlp_dim=32, strategy="dense", capacity_factor=2.0)
DENSE_DROPPING = moe.MoeConfig(num_experts=4, top_k=2, emb_dim=16, mlp_dim=32, strategy="dense", capacity_factor=1.0)


@functools.cache
def _case(cfg, context):
    mesh = context_mesh(context)
    step, args = _block_step(mesh, cfg)
    before = shardlint.analyze(step, *args)
    fixed = shardlint.rewrite(step, mesh, args=args, analysis=before, verify=True)
    return step, args, fixed, before, shardlint.analyze(fixed, *args)


@pytest.mark.parametrize("cfg", [SPARSE, DENSE_NO_DROP], ids=["sparse", "dense-no-drop"])
@pytest.mark.parametrize("context", [2, 4, 8])
def test_qwen3_next_block_is_swapped_and_keeps_tokens_sharded(cfg, context):
    step, args, fixed, before, after = _case(cfg, context)
    assert isinstance(fixed, SwappedStep)
    assert any("context" in f.axes for f in before.findings)
    assert after.findings == ()
    assert not [c for c in after.all_gathers() if "context" in c.axes]
    values = random_like(args)
    want, got = jax.jit(step)(*values), fixed(*values)
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert after.memory.temp_bytes < before.memory.temp_bytes


def test_dense_capacity_that_drops_is_refused(mesh):
    step, args = _block_step(mesh, DENSE_DROPPING)
    with pytest.raises(shardlint.RewriteError, match="capacity_factor >= num_experts/top_k = 2"):
        shardlint.rewrite(step, mesh, args=args)
