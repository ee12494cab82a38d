"""Replay one jaxpr equation as JAX itself does (`jax.core.eval_jaxpr`), keeping its source
location and name stack so the rewritten step's HLO still points at the user's lines.

This is the one place in the rewrite that uses JAX's private `core`/`source_info_util`;
its calls are the same in JAX 0.10 through 0.12.
"""

from __future__ import annotations

from jax._src import core, source_info_util


def bind_eqn(eqn, invals: list) -> list:
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def read(env: dict, atom):
    return atom.val if isinstance(atom, core.Literal) else env[atom]
