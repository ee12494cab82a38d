"""Split a level's region into groups that each run as one `shard_map`, and say how each
group's values cross its boundary.

The forward and the backward of a layer are separate groups (the loss lies between
them): a group may not depend on itself through equations outside it. At the boundary,
values that carry tokens keep their sharding (`Level`'s specs); per-shard values that
another group needs (group sizes) travel stacked along a leading shard axis; values the
rest of the program reads (weight gradients) must be plain sums over tokens and are
`psum`med; and a body's results that only other bodies read may leave per shard.
"""

from __future__ import annotations

import dataclasses

from ...jaxpr import variables
from . import _refusals


@dataclasses.dataclass
class Group:
    eqns: list[int]                       # indices into the jaxpr's equations, in order
    inputs: list = dataclasses.field(default_factory=list)        # global Vars read
    outputs: list = dataclasses.field(default_factory=list)       # global Vars written for others
    summed: set = dataclasses.field(default_factory=set)          # outputs psum'd for the outside
    stacked: set = dataclasses.field(default_factory=set)         # per-shard values for other groups


def convex_groups(eqns, region: set[int]) -> list[Group]:
    """Split region equations so no group depends on itself through outside equations."""
    groups: list[Group] = []
    taint: dict = {}          # Var -> groups it depends on through an outside equation
    group_of_var: dict = {}
    current: Group | None = None
    for i, e in enumerate(eqns):
        ins = variables(e.invars)
        through = set().union(*(taint.get(v, set()) for v in ins)) if ins else set()
        if i in region:
            if current is None or id(current) in through:
                current = Group([])
                groups.append(current)
            current.eqns.append(i)
            for v in e.outvars:
                taint[v] = through
                group_of_var[v] = id(current)
        else:
            for v in ins:
                if v in group_of_var:
                    through = through | {group_of_var[v]}
            for v in e.outvars:
                taint[v] = through
    return groups


def boundaries(level, eqns, producer, consumers, outvars: dict, crossable, *,
               sharded: set, shard_ordered: set, labels: set, per_shard: set,
               per_shard_capacity: bool = False, counts: frozenset | set = frozenset()) -> None:
    """Fills each group's inputs and outputs, and the level's per-shard results.

    `sharded` values carry tokens along a dimension sharded like the input's; those in
    `shard_ordered` hold them in per-shard order, and those in `labels` hold only positions
    within a shard (in block form), and those in `counts` running totals over a shard's
    tokens (capacity positions). `per_shard` values have no global form (a dimension sized
    by a per-shard capacity).
    """
    group_of = {i: gi for gi, grp in enumerate(level.groups) for i in grp.eqns}
    tokens = sharded | per_shard
    for grp in level.groups:
        mine = set(grp.eqns)
        produced = {v for i in grp.eqns for v in eqns[i].outvars}
        seen_in: set = set()
        for i in grp.eqns:
            for v in variables(eqns[i].invars):
                if v not in produced and v not in seen_in:
                    seen_in.add(v)
                    grp.inputs.append(v)
        for i in grp.eqns:
            for v in eqns[i].outvars:
                users = [c for c in consumers.get(v, ()) if c not in mine]
                at = outvars.get(v)
                if not users and at is None:
                    continue
                grp.outputs.append(v)
                outside = any(c not in group_of for c in users)
                elsewhere = any(c in group_of for c in users)
                leaves = at is not None and at in crossable
                stays = outside or (at is not None and not leaves)
                if v in per_shard:
                    if stays:
                        (_refusals.refuse_capacity_exit if per_shard_capacity
                         else _refusals.refuse_global_capacity)(eqns[i], v)
                elif v in sharded:
                    if v not in shard_ordered:
                        continue  # in (batch, seq, ...) order: it leaves sharded
                    if stays:
                        (_refusals.refuse_position_exit if v in counts
                         else _refusals.refuse_shard_ordered_exit)(eqns[i], v)
                    if leaves:
                        level.shard_ordered_out[at] = v in labels
                    continue
                elif stays:
                    _refusals.require_linear(v, eqns, producer, mine, tokens)
                    grp.summed.add(v)
                if elsewhere or leaves:
                    grp.stacked.add(v)
                if leaves:
                    level.stacked_out.add(at)

