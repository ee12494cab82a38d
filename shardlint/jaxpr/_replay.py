"""Replay jaxpr equations as JAX itself does (`jax.core.eval_jaxpr`), keeping each one's
source location and name stack so the rewritten step's HLO still points at the user's
lines. The rewritten step's equations outside its routed regions are replayed so, as the
user's code traced them; inside a region they are bound at one shard's shapes
(`shard.ShardBinder`), where sharding parameters (`SHARDING_PARAMS`) and annotations
(`ANNOTATIONS`) of the global program do not apply.

An equation that carries a jaxpr is bound again with that jaxpr rewritten (`bind_with`).
JAX's private `source_info_util` calls it needs live in `shardlint._jax`.
"""

from __future__ import annotations

from .. import _jax
from ._levels import CALLS, INLINED, is_literal

# Parameters that name a sharding of the global mesh, and ops that only annotate one.
SHARDING_PARAMS = ("sharding", "out_sharding")
ANNOTATIONS = ("reshard", "sharding_constraint", "mesh_cast")


def bind_eqn(eqn, invals: list) -> list:
    with _jax.as_traced(eqn):
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def replay(closed_or_open, invals: list) -> list:
    jaxpr = getattr(closed_or_open, "jaxpr", closed_or_open)
    consts = list(getattr(closed_or_open, "consts", ()))
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, invals))
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, bind_eqn(eqn, [read(env, a) for a in eqn.invars])))
    return [read(env, v) for v in jaxpr.outvars]


def read(env: dict, atom):
    return atom.val if is_literal(atom) else env[atom]


def bind_with(eqn, new_inner, invals: list) -> list:
    """Binds `eqn` again on `invals` with its inner jaxpr replaced by `new_inner` (a
    ClosedJaxpr with the same inputs and outputs, stacked values excepted)."""
    name = eqn.primitive.name
    with _jax.as_traced(eqn):
        if name in INLINED:
            return replay(new_inner, invals)
        params = dict(eqn.params)
        if name in ("remat2", "checkpoint"):
            jaxpr, consts = _jax.open_jaxpr(new_inner)
            params["jaxpr"] = jaxpr
            invals = consts + list(invals)
        else:
            params[CALLS[name]] = new_inner
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    return list(out) if eqn.primitive.multiple_results else [out]
