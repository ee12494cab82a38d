"""A shard_map step that issues one collective of each kind, for parser tests.

Each collective's line carries a marker comment so tests can find the line number the
compiled module's stack-frame tables must point at, without hard-coding it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .markers import marker_line as line_of_marker


def make_collectives_step(mesh, a2a_axis: str, scatter_axis: str, permute_axis: str, sum_axis: str):
    def body(x, y):
        a = jax.lax.all_to_all(y, a2a_axis, 0, 0, tiled=True)  # <- all-to-all
        r = jax.lax.psum_scatter(x, scatter_axis, scatter_dimension=0, tiled=True)  # <- reduce-scatter
        n = mesh.shape[permute_axis]
        p = jax.lax.ppermute(y, permute_axis, [(i, (i + 1) % n) for i in range(n)])  # <- collective-permute
        s1, s2 = jax.lax.psum((x * 2, y * 3), sum_axis)  # <- all-reduce
        g = jax.lax.all_gather(x, sum_axis, tiled=True)  # <- all-gather
        return a.sum() + r.sum() + p.sum() + s1.sum() + s2.sum() + g.sum()

    names = mesh.axis_names
    x_spec, y_spec = P(names[0], names[1]), P(a2a_axis)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, y_spec), out_specs=P(), **_no_check())
    size = 8 * mesh.size
    args = (jax.ShapeDtypeStruct((size, size), jnp.float32, sharding=NamedSharding(mesh, x_spec)),
            jax.ShapeDtypeStruct((size, 4), jnp.float32, sharding=NamedSharding(mesh, y_spec)))
    return fn, args


def _no_check():
    # The outputs are reduced by hand on purpose; JAX 0.10+ spells the switch check_vma.
    return {"check_vma": False}


def marker_line(kind: str) -> int:
    return line_of_marker(__file__, kind)


def make_remat_step(mesh):
    """A reshape whose operand and result shardings XLA cannot convert between: the
    partitioner logs an involuntary full rematerialization (JAX 0.10.2 and 0.12.0.1)."""

    def step(x):
        y = x.reshape(6, 4, 40)  # <- remat reshape
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, mesh.axis_names[1], None)))

    return step, (jax.ShapeDtypeStruct((24, 40), jnp.float32,
                                       sharding=NamedSharding(mesh, P(mesh.axis_names[1], None))),)
