"""Replay jaxpr equations as JAX itself does (`jax.core.eval_jaxpr`), keeping each one's
source location and name stack so the rewritten step's HLO still points at the user's
lines. The rewritten step's equations outside its routed regions are replayed so, as the
user's code traced them; inside a region they are bound at one shard's shapes
(`shard.ShardBinder`), where sharding parameters (`SHARDING_PARAMS`) and annotations
(`ANNOTATIONS`) of the global program do not apply.

JAX's private `core`/`source_info_util` calls it needs live in `shardlint._jax`.
"""

from __future__ import annotations

from .. import _jax

# Parameters that name a sharding of the global mesh, and ops that only annotate one.
SHARDING_PARAMS = ("sharding", "out_sharding")
ANNOTATIONS = ("reshard", "sharding_constraint", "mesh_cast")
_INNER_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


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


def inner_jaxpr(eqn):
    """An equation's inner jaxpr that takes its operands one for one (a jit, remat,
    custom-derivative call or shard_map body), else None."""
    for key in _INNER_JAXPR_PARAMS:
        inner = eqn.params.get(key)
        if inner is not None and hasattr(getattr(inner, "jaxpr", inner), "eqns"):
            jaxpr = getattr(inner, "jaxpr", inner)
            if len(jaxpr.invars) == len(eqn.invars):
                return inner
    return None


def read(env: dict, atom):
    return atom.val if _jax.is_literal(atom) else env[atom]
