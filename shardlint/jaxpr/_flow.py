"""Dataflow over one level's equations, by index: who reads a value, what reaches or
follows an equation, and the connected parts of a set of equations.

The planner and the grower ask these of a jaxpr level many times; equations are named by
their index in the level, values by their Var.
"""

from __future__ import annotations

from .. import _jax


def variables(atoms):
    return [a for a in atoms if not _jax.is_literal(a)]


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
