"""`shardlint.rewrite` on steps whose libraries shard_map over a `Mesh` they build themselves
(tests/support/own_mesh_steps.py): the rewrite runs the step's lossy MoE per shard and
leaves the library's own shard_map as the library wrote it, or leaves the step unchanged
where its MoE already runs per shard; the numbers are the original's either way.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardlint
from shardlint.jaxpr import sub_of
from shardlint.rewrites._verify import random_like
from support import own_mesh_steps as own


@pytest.fixture(scope="module")
def own_names(mesh):
    fn, args = own.make_own_axis_names_step(mesh)
    fixed = shardlint.rewrite(fn, mesh, args=args, verify=True)   # raises if the numbers differ
    return fn, args, fixed, shardlint.analyze(fn, *args), shardlint.analyze(fixed, *args)


def test_the_moe_after_a_block_on_the_librarys_own_mesh_runs_per_shard(own_names):
    _, _, fixed, before, after = own_names
    assert fixed.changed
    assert [f for f in before.findings if f.op == "reshape" and f.axes == ("context",)]
    assert after.findings == () and after.all_gathers() == ()
    assert after.memory.temp_bytes < before.memory.temp_bytes / 4


def test_the_librarys_shard_map_keeps_its_own_mesh(own_names):
    _, args, fixed, *_ = own_names
    text = fixed.lower(*args).as_text()
    assert '["dp"=2, "sp"=4]' in text          # the library's block, as it wrote it
    assert '["data"=2, "context"=4]' in text   # the rewrite's per-shard MoE


def test_a_moe_already_per_shard_on_a_folded_expert_mesh_is_left_as_it_is(mesh):
    fn, args = own.make_folded_axes_step(mesh)
    with pytest.warns(shardlint.NothingToRewrite):
        fixed = shardlint.rewrite(fn, mesh, args=args, verify=True)
    assert fixed.changed is False
    want, got = jax.jit(fn)(*random_like(args)), fixed(*random_like(args))
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_step_that_reads_the_mesh_in_context_is_rewritten_with_its_constraints(mesh):
    """Linen's logical constraint is a no-op with no mesh in context: the step is traced
    for the rewrite as jax.jit traces it where the analysis found it reads the mesh, so the
    rewritten step keeps the constraint the user wrote outside the routed region."""
    pytest.importorskip("flax")
    fn, args = own.make_logical_constraint_moe_step(mesh)
    fixed = shardlint.rewrite(fn, mesh, args=args, verify=True)
    assert fixed.changed
    with jax.set_mesh(mesh):
        want = _constraints(jax.make_jaxpr(fn)(*args).jaxpr)
    assert want == [P("data", "context", None)]
    assert _constraints(jax.make_jaxpr(fixed)(*args).jaxpr) == want
    assert shardlint.analyze(fixed, *args).findings == ()


def _constraints(jaxpr) -> list:
    """The specs of the sharding constraints in a jaxpr and the bodies it calls."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            found.append(eqn.params["sharding"].spec)
        sub = sub_of(eqn)
        if sub is not None:
            found += _constraints(sub.jaxpr)
    return found
