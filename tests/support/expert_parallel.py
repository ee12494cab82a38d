"""An expert-parallel MoE layer as public libraries write their default path: tokens sharded
over an `expert` axis go to the shard that holds their expert by `jax.lax.ragged_all_to_all`
inside a `shard_map`, through that shard's experts, and back the same way. XLA:CPU has no
ragged-all-to-all (`UNIMPLEMENTED`); the TPU compiler compiles it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

TOKENS, EMB, MLP = 64, 16, 32   # per expert shard


def make_step(mesh):
    """value_and_grad of a mean square through the layer, over its expert weights."""
    shards = mesh.shape["expert"]

    def layer(w_in, w_out, x_TD):
        # Each shard sends an equal part of its tokens to every shard (the router's counts
        # in a real layer), runs its own expert on what arrives, and sends the results back.
        sizes = jnp.full((shards,), x_TD.shape[0] // shards, jnp.int32)
        offsets = jnp.cumsum(sizes) - sizes
        arrived_TD = jax.lax.ragged_all_to_all(x_TD, jnp.zeros_like(x_TD), offsets, sizes, offsets, sizes,
                                               axis_name="expert")   # <- dispatch
        out_TD = jax.nn.silu(arrived_TD @ w_in[0]) @ w_out[0]
        return jax.lax.ragged_all_to_all(out_TD, jnp.zeros_like(out_TD), offsets, sizes, offsets, sizes,
                                         axis_name="expert")   # <- combine

    moe = jax.shard_map(layer, mesh=mesh, in_specs=(P("expert"), P("expert"), P("expert")),
                        out_specs=P("expert"))

    def step(params, x_TD):
        return jax.value_and_grad(lambda p: jnp.mean(moe(p["w_in"], p["w_out"], x_TD) ** 2))(params)

    def spec(shape, *axes):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(*axes)))

    params = {"w_in": spec((shards, EMB, MLP), "expert"), "w_out": spec((shards, MLP, EMB), "expert")}
    return step, (params, spec((TOKENS * shards, EMB), "expert"))
