"""Bind a step's global equations again at one shard's shapes: what a routed region's
per-shard program is (`_emit` binds the region's own equations with it inside its
`shard_map`), and what the per-shard shape pass runs over the whole jaxpr (`trace/_shard_shapes.py`).

Operands give most results their shapes: a broadcast follows its operand, a reshape keeps
its segments and unfolds tokens as an earlier reshape folded them, a slice to the end of a
dimension ends at the shard's end. A value made from nothing (an iota, a broadcast scalar,
a constant) is made at the size the shape pass found it met with (`sizes`), and a capacity
literal takes a shard's value (`literals`). Sharding parameters are dropped and sharding
annotations pass their operand through: the step was traced on the global mesh, and inside
the region's `shard_map` the token axes are manual.
"""

from __future__ import annotations

import jax
import numpy as np

from ... import _jax
from ...jaxpr import ANNOTATIONS, is_literal, read, SHARDING_PARAMS, sub_of
from ._shape_rules import broadcast_shape, reshaped, slice_limits, slice_sizes


class ShardBinder:
    """Binds the step's global equations on shard-sized operands.

    Shape parameters come from the operands (and `sizes`, for values made from nothing),
    capacity literals from `literals`. Sharding parameters are dropped and sharding
    annotations pass their operand through: the step was traced on the global mesh, and
    inside the region's `shard_map` the token axes are manual. Calls are entered (their
    recorded types are the global ones); a scan is bound again with its body bound so."""

    def __init__(self, sizes: dict, literals: dict, folds: dict):
        self.sizes, self.literals, self.folds = sizes, literals, folds
        self.bodies: dict = {}    # (body, operand types) -> the body traced again

    def run(self, jaxpr, consts, invals) -> list:
        env = {v: self.constant(v, c) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, invals))
        for eqn in jaxpr.eqns:
            operands = [self.operand(eqn, k, a, None if is_literal(a) else env[a])
                        for k, a in enumerate(eqn.invars)]
            env.update(zip(eqn.outvars, self.bind(eqn, operands)))
        return [read(env, v) for v in jaxpr.outvars]

    def operand(self, eqn, k: int, atom, value):
        """`eqn`'s operand at position `k`: `value`, or a literal (a capacity at a shard's)."""
        return self.literals.get((id(eqn), k), atom.val) if is_literal(atom) else value

    def constant(self, var, value):
        shape = self.sizes.get(var)
        return value if shape is None else np.asarray(value)[tuple(slice(0, n) for n in shape)]

    def bind(self, eqn, invals: list) -> list:
        name = eqn.primitive.name
        with _jax.as_traced(eqn, its_mesh=False):
            if name in ANNOTATIONS:
                return list(invals)
            sub = sub_of(eqn)
            if sub is not None:
                return self.call(eqn, sub, invals)
            params = self.params(eqn, invals)
            out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        return list(out) if eqn.primitive.multiple_results else [out]

    def params(self, eqn, invals) -> dict:
        params = {k: (None if k in SHARDING_PARAMS else v) for k, v in eqn.params.items()}
        name = eqn.primitive.name
        resized = self.sizes.get(eqn.outvars[0]) if len(eqn.outvars) == 1 else None
        shape_in = np.shape(invals[0]) if invals else ()
        if name == "broadcast_in_dim":
            params["shape"] = resized or broadcast_shape(eqn, shape_in)
        elif name == "iota" and resized:
            params["shape"] = resized
        elif name == "reshape" and params.get("dimensions") is None:
            params["new_sizes"] = resized or self.reshape_sizes(eqn, shape_in)
        elif name == "slice":
            params["limit_indices"] = slice_limits(eqn, shape_in)
        elif name == "dynamic_slice":
            params["slice_sizes"] = slice_sizes(eqn, shape_in)
        return params

    def reshape_sizes(self, eqn, shape_in) -> tuple:
        return reshaped(eqn.invars[0].aval.shape, shape_in, eqn.params["new_sizes"], self.folds)[0]

    def call(self, eqn, sub, invals) -> list:
        """A call entered on the shard-sized operands; a scan bound again with its body so."""
        if not sub.stacks:
            return self.run(sub.jaxpr, sub.consts, invals)
        avals = [_jax.struct_of(inner.aval, np.shape(x)[1:] if k >= sub.sliced_from else np.shape(x))
                 for k, (x, inner) in enumerate(zip(invals, sub.jaxpr.invars))]
        key = (id(sub.jaxpr), tuple((a.shape, a.dtype, a.weak_type) for a in avals))
        if key not in self.bodies:   # a body JAX shares between calls stays shared
            self.bodies[key] = jax.make_jaxpr(lambda *xs: self.run(sub.jaxpr, sub.consts, xs))(*avals)
        params = dict(eqn.params, **{sub.key: self.bodies[key]})
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        return list(out)
