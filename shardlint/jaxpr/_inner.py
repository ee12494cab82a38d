"""Where a layer can live inside a step: the jaxprs that equations carry, and how to bind
such an equation again with its inner jaxpr rewritten.

A nested `jax.jit` (and so a pre-jitted step, `nnx.jit`) is a `jit` equation, `lax.scan`
over stacked layers a `scan` equation whose body runs once per layer, `jax.checkpoint` a
`remat2` equation (in the forward and, `differentiated=True`, in the rematerialized
backward); `jax.checkpoint` around a whole scan stages its forward as a plain call of the
known part (`closed_call` on JAX 0.10, `eval_jaxpr` on 0.12). Their inner jaxprs take the
equation's operands one for one (a scan body sees one slice of each stacked operand) and
give its results one for one (a scan stacks the per-layer results), so a value's position
says where it goes. Custom-derivative calls (`custom_jvp_call`, `custom_vjp_call`) are
entered too; rebinding one with a changed body would disagree with its derivative rule, so
it is inlined instead (the rewritten step is not differentiated again).
"""

from __future__ import annotations

import dataclasses

from .. import _jax
from ._replay import replay

_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "scan": "jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
          "eval_jaxpr": "call_jaxpr", "closed_call": "call_jaxpr"}
_INLINED = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
            "custom_vjp_call_jaxpr": "fun_jaxpr"}


@dataclasses.dataclass(frozen=True)
class Sub:
    """The inner jaxpr of an equation, as an open jaxpr and its constants."""

    key: str               # the equation's parameter that holds it
    jaxpr: object          # open Jaxpr
    consts: tuple          # its constants (a ClosedJaxpr's), () for an open parameter
    stacks: bool           # a scan body: operands past `sliced_from` arrive one slice each
    sliced_from: int = 0


def sub_of(eqn) -> Sub | None:
    """The one inner jaxpr of an equation that shardlint rewrites inside, else None
    (`while` and `cond` bodies are not entered: their layers are not MoE layers)."""
    name = eqn.primitive.name
    key = _CALLS.get(name) or _INLINED.get(name)
    if key is None or key not in eqn.params:
        return None
    inner = eqn.params[key]
    jaxpr = getattr(inner, "jaxpr", inner)
    if not hasattr(jaxpr, "eqns") or len(jaxpr.invars) != len(eqn.invars):
        return None
    consts = tuple(getattr(inner, "consts", ()))
    if name == "scan":
        num_consts, num_carry = _jax.scan_counts(eqn.params)
        return Sub(key, jaxpr, consts, True, num_consts + num_carry)
    return Sub(key, jaxpr, consts, False)


def carries(eqn) -> tuple[int, int]:
    """(first, end) of the operand positions a scan carries from one layer to the next."""
    if eqn.primitive.name != "scan":
        return (0, 0)
    num_consts, num_carry = _jax.scan_counts(eqn.params)
    return (num_consts, num_consts + num_carry)


def bind_with(eqn, new_inner, invals: list) -> list:
    """Binds `eqn` again on `invals` with its inner jaxpr replaced by `new_inner` (a
    ClosedJaxpr with the same inputs and outputs, stacked values excepted)."""
    name = eqn.primitive.name
    with _jax.as_traced(eqn):
        if name in _INLINED:
            return replay(new_inner, invals)
        params = dict(eqn.params)
        if name in ("remat2", "checkpoint"):
            jaxpr, consts = _jax.open_jaxpr(new_inner)
            params["jaxpr"] = jaxpr
            invals = consts + list(invals)
        else:
            params[_CALLS[name]] = new_inner
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    return list(out) if eqn.primitive.multiple_results else [out]
