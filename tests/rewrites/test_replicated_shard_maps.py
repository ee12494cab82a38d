"""A library's own shard_maps in which every device computes the same thing (Levanter's
Mixtral routes in three whose specs split nothing) are calls of their bodies: the rewrite
inlines them and routes each shard's tokens through what they did, forward and backward
(`shardlint.rewrites.trace._inline`). A shard_map that splits anything stays as written."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardlint
from shardlint.jaxpr import equations
from shardlint.rewrites import verify_same
from shardlint.rewrites.trace._inline import inline_same_on_every_device
from shardlint.jaxpr._replay import replay
from shardlint.rewrites._verify import random_like

from support import rewrite_steps

def _shard_maps(closed) -> int:
    return sum(e.primitive.name == "shard_map" for e in equations(closed.jaxpr))


def _routing_findings(analysis):
    return [f for f in analysis.findings if f.source and f.source.file.endswith("support/rewrite_steps.py")]


@pytest.mark.parametrize("layers", ["one", "scan"])
def test_routing_in_shard_maps_that_split_nothing_runs_per_shard(layers, mesh):
    fn, args = rewrite_steps.make_replicated_routing_step(mesh, layers)
    before = shardlint.analyze(fn, *args)
    assert "reshape" in {f.op for f in _routing_findings(before)}   # the flatten, before the experts
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before)   # verified by default
    assert fixed.changed is True
    after = shardlint.analyze(fixed, *args)
    assert _routing_findings(after) == []
    assert not [c for c in after.all_gathers() if c.cause == "lost"]
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-6)


def test_the_differentiated_forms_are_inlined_with_the_same_numbers(mesh):
    """value_and_grad splits each shard_map into a forward that saves residuals over every
    mesh axis (a device's value repeated) and a backward that sums over the mesh: inlined,
    the residuals pass as one device's value and the sum is the value times the devices."""
    fn, args = rewrite_steps.make_replicated_routing_step(mesh, "scan")
    values = random_like(args)
    closed = jax.make_jaxpr(fn)(*args)
    assert _shard_maps(closed) >= 6
    inlined = inline_same_on_every_device(closed)
    assert _shard_maps(inlined) == 0
    leaves = jax.tree_util.tree_leaves(values)
    want = jax.jit(lambda *xs: replay(closed, list(xs)))(*leaves)
    got = jax.jit(lambda *xs: replay(inlined, list(xs)))(*leaves)
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec, body", [
    (P("data"), lambda x: x * 2),                                         # splits the tokens
    (P(), lambda x: x + jax.lax.axis_index("context").astype(x.dtype)),   # a device's own index
    (P(), lambda x: jax.lax.all_gather(x, "data", tiled=True)[: x.shape[0]]),
])
def test_a_shard_map_that_differs_per_device_stays(spec, body, mesh):
    mapped = functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(body)
    closed = jax.make_jaxpr(mapped)(jnp.ones((8, 4)))
    assert _shard_maps(inline_same_on_every_device(closed)) == 1


def test_a_step_that_returns_a_constant_beside_them(mesh):
    """A jaxpr's outputs may be literals (a constant the step returns), which hold no copy."""
    mapped = functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(
        lambda x: jax.lax.top_k(x, 2)[0])
    closed = jax.make_jaxpr(lambda x: (mapped(x), 1.0))(jnp.arange(32.0).reshape(8, 4))
    inlined = inline_same_on_every_device(closed)
    assert _shard_maps(inlined) == 0
    x = jnp.arange(32.0).reshape(8, 4)
    for want, got in zip(replay(closed, [x]), replay(inlined, [x])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
