"""A rewritten body jitted as the original step was.

Both rewrite routes end with a flat function of the step's leaves (the jaxpr route's
emitted regions, the swap route's re-traced Python). A step the user jitted with in/out
shardings and donation keeps them: its own `jit` equation (found by tracing the step once
at the arguments' shapes) is bound again around the new body, and the arguments it
donates whole are donated by the outer `jax.jit` too.
"""

from __future__ import annotations

from typing import Callable

import jax

from .. import _jax
from .._wrapped import unwrap
from ._replay import bind_with


def jit_equation(step: Callable, args: tuple):
    """The `jit` equation of a `jax.jit` step at these arguments' shapes (its shardings,
    donation and name); None for a plain function."""
    if unwrap(step) is step:
        return None
    leaves, tree = jax.tree_util.tree_flatten(args)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]

    def flat(*xs):
        return jax.tree_util.tree_leaves(step(*jax.tree_util.tree_unflatten(tree, xs)))

    eqns = jax.make_jaxpr(flat)(*abstract).jaxpr.eqns
    return eqns[0] if len(eqns) == 1 and eqns[0].primitive.name in ("jit", "pjit") else None


def jitted_like(run_flat: Callable, args: tuple, out_tree: Callable[[], object], jit_eqn,
                name: str):
    """`jax.jit` of the step whose leaves `run_flat` maps to output leaves (`out_tree()`
    their tree, known once `run_flat` has been traced), inside `jit_eqn` when the original
    had one."""
    donate: tuple[int, ...] = ()
    if jit_eqn is not None:
        run_flat, donate = _in_own_jit(run_flat, jit_eqn, args)

    def rewritten(*call_args):
        leaves = run_flat(*jax.tree_util.tree_leaves(call_args))
        return jax.tree_util.tree_unflatten(out_tree(), leaves)

    rewritten.__name__ = name
    return jax.jit(rewritten, donate_argnums=donate)


def _in_own_jit(run_flat, jit_eqn, args):
    """`run_flat` bound inside the pre-jitted step's own jit equation (its in/out
    shardings), and the arguments it donates (those whose every leaf it donates)."""
    inner = jit_eqn.params["jaxpr"].jaxpr
    avals = [_jax.struct_of(v.aval) for v in inner.invars]

    def in_own_jit(*flat):
        return bind_with(jit_eqn, jax.make_jaxpr(run_flat)(*avals), list(flat))

    donated = iter(jit_eqn.params["donated_invars"])
    donate = tuple(i for i, leaves in enumerate(jax.tree_util.tree_leaves(a) for a in args)
                   if all([next(donated) for _ in leaves]) and leaves)
    return in_own_jit, donate
