"""Replay jaxpr equations as JAX itself does (`jax.core.eval_jaxpr`), keeping each one's
source location and name stack so the rewritten step's HLO still points at the user's
lines.

Inside `shard_map`'s manual axes three things must change, all because the step was
traced on the global (Auto) mesh: output-sharding parameters are dropped, sharding
annotations (`reshard`, `sharding_constraint`, `mesh_cast`) pass their operand through,
and calls to inner jaxprs (`jit`, custom-derivative calls, remat) are inlined, since their
recorded types name the Auto mesh and would clash with the manual operands.

JAX's private `core`/`source_info_util` calls it needs live in `shardlint._jax`.
"""

from __future__ import annotations

from .. import _jax

_SHARDING_PARAMS = ("sharding", "out_sharding")
_INNER_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_ANNOTATIONS = ("reshard", "sharding_constraint", "mesh_cast")


def bind_eqn(eqn, invals: list, *, manual: bool = False) -> list:
    with _jax.as_traced(eqn):
        if manual and eqn.primitive.name in _ANNOTATIONS:
            return list(invals)
        inner = inner_jaxpr(eqn) if manual else None
        if inner is not None:
            return replay(inner, invals, manual=True)
        params = eqn.primitive.get_bind_params(eqn.params)
        if manual:
            params = {k: (None if k in _SHARDING_PARAMS else v) for k, v in params.items()}
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def replay(closed_or_open, invals: list, *, manual: bool) -> list:
    jaxpr = getattr(closed_or_open, "jaxpr", closed_or_open)
    consts = list(getattr(closed_or_open, "consts", ()))
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, invals))
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, bind_eqn(eqn, [read(env, a) for a in eqn.invars], manual=manual)))
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
