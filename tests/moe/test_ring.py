"""The schedules of `shardlint.moe.layers._ring`: the weight ring's products, and the whole
gather's in one piece or in 2n pieces, equal the product with the whole weights,
gradients included, on 2, 4 and 8 devices; and the layer computes the reference's numbers
with either inside `lax.scan` under `jax.checkpoint`, as a scanned stack of layers is
written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint import moe
from shardlint._jax import shard_map
from shardlint.moe.layers._ring import WeightSlices

T, D, N = 16, 16, 8


def _bilinear(x, w, aux):
    return jnp.einsum("td,dn->tn", x, w)


def _expanding(x, w, aux):
    return jnp.einsum("tn,nd->td", x, w)


SCHEDULES = {"ring": lambda n: dict(ring=True),
             "one-piece": lambda n: dict(ring=False),
             "pieces": lambda n: dict(ring=False, pieces=2 * n)}


@pytest.mark.parametrize("ring_size", [2, 4, 8])
@pytest.mark.parametrize("kind", ["contract", "expand"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_schedule_equals_the_whole_product_with_its_gradients(moe_testlib, ring_size, kind,
                                                              schedule):
    mesh = moe_testlib.make_mesh((8 // ring_size, ring_size), ("other", "ring"))
    kx, kw, kr = jax.random.split(jax.random.key(0), 3)
    contract = kind == "contract"
    x = jax.random.normal(kx, (T, D) if contract else (T, N))
    w = jax.random.normal(kw, (D, N) if contract else (N, D))
    r = jax.random.normal(kr, (T, N) if contract else (T, D))
    product = _bilinear if contract else _expanding
    # D of the weights over the ring; the rows (tokens) over every axis, the ring's too,
    # as the layer requires of its weight axes
    w_spec = P("ring", None) if contract else P(None, "ring")
    rows = P(("other", "ring"), None)

    def per_shard(x, w):
        ring = WeightSlices(("ring",), ring_size, **SCHEDULES[schedule](ring_size))
        return (ring.contract if contract else ring.expand)(product, x, w)

    ringed = shard_map(per_shard, mesh=mesh, in_specs=(rows, w_spec), out_specs=rows,
                       checked=True)
    loss = lambda f: (lambda x, w: jnp.sum(f(x, w) * r))
    want = jax.value_and_grad(loss(lambda x, w: product(x, w, ())), argnums=(0, 1))(x, w)
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
    got = jax.jit(jax.value_and_grad(loss(ringed), argnums=(0, 1)))(
        put(x, rows), put(w, w_spec))
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gather", ["whole", "ring"])
def test_layer_in_a_remat_scan_equals_the_reference(moe_testlib, gather):
    """Three stacked layers under `lax.scan(jax.checkpoint(...))`: loss and every
    gradient of ShardedRoutedMoE (on 8 weight devices, the matrices gathered in 16
    pieces or passed round the ring) equal RoutedMoE's."""
    lib = moe_testlib
    mesh = lib.make_mesh((2, 4), ("data", "context"))
    cfg = lib.config()
    ref = moe.RoutedMoE(cfg)
    fast = moe.ShardedRoutedMoE(cfg, mesh, batch_axes="data", seq_axes="context",
                                weight_gather=gather)
    params = jax.vmap(ref.init)(jax.random.split(jax.random.key(0), 3))
    x, _ = lib.activations()

    def step(layer):
        def loss(params, x):
            body = lambda h, p: (h + layer(p, h), None)
            h, _ = jax.lax.scan(jax.checkpoint(body), x, params)
            return jnp.mean(h ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    stacked = jax.tree.map(lambda s: NamedSharding(mesh, P(None, *s)), fast.param_specs())
    got = step(fast)(jax.device_put(params, stacked),
                     jax.device_put(x, NamedSharding(mesh, P("data", "context"))))
    want = step(ref)(params, x)
    assert float(want[0]) > 0.1
    lib.assert_tree_close(got, want)
