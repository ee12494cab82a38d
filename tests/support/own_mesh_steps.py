"""Steps whose code brings its own mesh or needs one in context, written as libraries write them.

Each `make_<name>(mesh)` returns `(step_fn, args)` with `jax.ShapeDtypeStruct` arguments
carrying NamedShardings on `mesh` (Auto axes `data` and `context`, sizes from
`cause_steps`), the step `value_and_grad` of a mean square through one model:

  make_own_axis_names_step   a block that shard_maps over a `Mesh` it builds itself over the
                             same devices, with its own axis names, then the routed MoE
                             flattened outside shard_map (the bug)
  make_folded_axes_step      a MoE whose experts run in shard_map over the library's own
                             expert mesh: one axis folding the step's data and context
  make_with_mesh_step        pjit-era code written to run under `with mesh:` (bare
                             PartitionSpecs in `pjit` and in a sharding constraint)
  make_context_mesh_step     code that reads the context mesh (Flax linen's logical
                             constraints, as MaxText's decoders use them): without a
                             mesh it lowers, without its constraint
  make_explicit_reshard_step `reshard` to a bare PartitionSpec on Explicit axes (needs
                             `jax.set_mesh`)
  make_no_context_fits_step  a step no mesh context lowers: pjit with bare PartitionSpecs
                             and a shard_map that takes the context's mesh

`jax.jit(step).lower(*args)` lowers the first two as they are and fails inside
`jax.set_mesh(mesh)` ("The context mesh ... should match the mesh passed to shard_map").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardlint.examples.steps import _experts, _loss_step, _route, routed_moe

from .cause_steps import TOP_K, _batch, _moe_params


def _library_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """The mesh a library builds for itself: the first devices, laid out its own way."""
    devices = np.asarray(jax.devices()[:math.prod(shape)]).reshape(shape)
    return Mesh(devices, names)


def sequence_parallel_norm(x_BSD):
    """A library's norm that runs per shard over its own (dp, sp) mesh."""
    own = _library_mesh((2, 4), ("dp", "sp"))

    def local(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    spec = P("dp", "sp", None)
    return jax.shard_map(local, mesh=own, in_specs=spec, out_specs=spec)(x_BSD)  # <- own names


def make_own_axis_names_step(mesh):
    def model(params, x_BSD):
        h_BSD = sequence_parallel_norm(x_BSD)
        return h_BSD + routed_moe(params, h_BSD, TOP_K)

    return _loss_step(model), (_moe_params(mesh), _batch(mesh))


def expert_mesh_moe(params, x_BSD):
    """A library's MoE: tokens flattened, then routed and run per shard over its own
    expert mesh, one axis over every device (the step's data and context folded)."""
    own = _library_mesh((len(jax.devices()),), ("expert",))
    b, s, d = x_BSD.shape

    def local(params, tokens_TD):
        weights_TK, experts_TK = _route(tokens_TD, params["w_gate"], TOP_K)
        return _experts(tokens_TD, weights_TK, experts_TK, params["w_in"], params["w_out"])

    tokens_TD = x_BSD.reshape(b * s, d)  # <- flatten
    out_TD = jax.shard_map(local, mesh=own, in_specs=(P(), P("expert", None)),  # <- folded
                           out_specs=P("expert", None))(params, tokens_TD)
    return out_TD.reshape(b, s, d)


def make_folded_axes_step(mesh):
    return _loss_step(expert_mesh_moe), (_moe_params(mesh), _batch(mesh))


def make_with_mesh_step(mesh):
    """Written for `with mesh:`: its shardings are bare PartitionSpecs that name the
    mesh's axes, resolved against the mesh the caller entered."""
    from jax.experimental.pjit import pjit

    gate = pjit(lambda x, w: x @ w, in_shardings=(P("data", "context", None), P()),
                out_shardings=P("data", "context", None))

    def model(params, x_BSD):
        x_BSD = jax.lax.with_sharding_constraint(x_BSD, P("data", None, None))  # <- with mesh
        return x_BSD * jax.nn.sigmoid(gate(x_BSD, params["w_gate"])).sum(-1, keepdims=True)

    return _loss_step(model), (_moe_params(mesh), _batch(mesh))


def make_context_mesh_step(mesh):
    """Flax linen's logical constraint: a no-op where no mesh is in context."""
    import flax.linen as nn

    rules = (("batch", "data"), ("length", None), ("embed", None))

    def model(params, x_BSD):
        with nn.logical_axis_rules(rules):
            x_BSD = nn.with_logical_constraint(x_BSD, ("batch", "length", "embed"))  # <- logical
        return x_BSD @ params["w_gate"]

    return _loss_step(model), (_moe_params(mesh), _batch(mesh))


def make_no_context_fits_step(mesh):
    """pjit with bare PartitionSpecs (needs `with mesh:`) and a shard_map that takes the
    mesh in context (needs `jax.set_mesh`): no one context lowers both."""
    from jax.experimental.pjit import pjit

    double = pjit(lambda x: 2 * x, in_shardings=P("data"), out_shardings=P("data"))
    halve = jax.shard_map(lambda x: x / 2, in_specs=P("data"), out_specs=P("data"))

    def model(params, x_BSD):
        return halve(double(x_BSD)) @ params["w_gate"]  # <- no context fits

    return _loss_step(model), (_moe_params(mesh), _batch(mesh))



def make_explicit_reshard_step(mesh):
    """Explicit sharding as its guide writes it (`mesh` with Explicit axes): a `reshard` to
    a bare PartitionSpec, resolved against the mesh set with `jax.set_mesh`."""

    def model(params, x_BSD):
        x_BSD = jax.sharding.reshard(x_BSD, P("data", None, None))  # <- reshard
        return x_BSD @ params["w_gate"]

    return _loss_step(model), (_moe_params(mesh), _batch(mesh))


def make_logical_constraint_moe_step(mesh):
    """Flax linen's logical constraint on the routed MoE's input (batch over data, length
    over context: a no-op where no mesh is in context), then the MoE that loses it."""
    import flax.linen as nn

    rules = (("batch", "data"), ("length", "context"), ("embed", None))

    def model(params, x_BSD):
        with nn.logical_axis_rules(rules):
            x_BSD = nn.with_logical_constraint(x_BSD, ("batch", "length", "embed"))  # <- logical before moe
        return routed_moe(params, x_BSD, TOP_K)

    return _loss_step(model), (_moe_params(mesh), _batch(mesh))
