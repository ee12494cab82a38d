"""A jaxpr's levels: the jaxprs its equations carry, and what flows where inside one.

Where a layer can live inside a step: a nested `jax.jit` (and so a pre-jitted step,
`nnx.jit`) is a `jit` equation, `lax.scan` over stacked layers a `scan` equation whose body
runs once per layer, `jax.checkpoint` a `remat2` equation (in the forward and,
`differentiated=True`, in the rematerialized backward); `jax.checkpoint` around a whole scan
stages its forward as a plain call of the known part (`closed_call` on JAX 0.10,
`eval_jaxpr` on 0.12). Their inner jaxprs (`sub_of`) take the equation's operands one for
one (a scan body sees one slice of each stacked operand) and give its results one for one
(a scan stacks the per-layer results), so a value's position says where it goes.
Custom-derivative calls (`custom_jvp_call`, `custom_vjp_call`) are entered too; rebinding one
with a changed body would disagree with its derivative rule, so it is inlined instead (the
rewritten step is not differentiated again). Every jaxpr an equation holds, whatever it is,
is JAX's own answer (`jax.extend.core.jaxprs_in_params`): `equations` walks them all.

Inside one level, equations are named by their index and values by their Var: who reads a
value, what reaches or follows an equation, and the connected parts of a set of equations.
The planner and the grower ask these of a level many times.
"""

from __future__ import annotations

import dataclasses

from jax.extend.core import Literal, jaxprs_in_params

from .. import _jax

# The equations whose inner jaxpr a rewrite enters, and the parameter that holds it: calls
# bound again with the body rewritten, and custom-derivative calls inlined (`bind_with`).
CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "scan": "jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
         "eval_jaxpr": "call_jaxpr", "closed_call": "call_jaxpr"}
INLINED = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
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
    key = CALLS.get(name) or INLINED.get(name)
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


def equations(jaxpr):
    """Every equation of an open jaxpr, and of the jaxprs its equations hold (calls, loop and
    branch bodies, shard_maps), at any depth."""
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in jaxprs_in_params(eqn.params):
            yield from equations(inner)


def is_literal(atom) -> bool:
    """A jaxpr Literal (constant operand), as opposed to a Var."""
    return isinstance(atom, Literal)


def variables(atoms) -> list:
    """The Vars among `atoms` (an equation's operands, a jaxpr's outputs): no literals."""
    return [a for a in atoms if not is_literal(a)]


def consumers_of(eqns) -> dict:
    users: dict = {}
    for i, e in enumerate(eqns):
        for v in variables(e.invars):
            users.setdefault(v, []).append(i)
    return users


def reaches(eqns, consumers, targets: set[int]) -> set[int]:
    """Equations with a dataflow path into `targets` (computed backwards)."""
    reaches: set[int] = set()
    for i in range(len(eqns) - 1, -1, -1):
        for v in eqns[i].outvars:
            if any(c in targets or c in reaches for c in consumers.get(v, ())):
                reaches.add(i)
                break
    return reaches


def connected_parts(eqns, region: set[int], producer, holds) -> set[int]:
    """The region's equations in connected parts that have an equation `holds` accepts;
    other token flattens (a cross-entropy over flattened tokens) stay as they are."""
    parent = {i: i for i in region}

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in region:
        for v in variables(eqns[i].invars):
            p = producer.get(v)
            if p in region:
                parent[find(i)] = find(p)
    routed = {find(i) for i in region if holds(i)}
    return {i for i in region if find(i) in routed}


def downstream(eqns, consumers, starts: set[int]) -> set[int]:
    """`starts` and every equation their results flow into."""
    seen, stack = set(starts), list(starts)
    while stack:
        i = stack.pop()
        for v in eqns[i].outvars:
            for c in consumers.get(v, ()):
                if c not in seen:
                    seen.add(c)
                    stack.append(c)
    return seen
