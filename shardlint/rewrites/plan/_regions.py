"""Plan the routed-expert regions of a traced step, in every jaxpr a layer can live in.

The stages: the step's jaxpr bound at one shard's shapes says which values carry tokens
(`_trace`);
each level's region grows from its seeds (`_grow`), is checked for what per shard would
give other numbers (`_refusals`) and split into groups that each run as one shard_map
(`_groups`). Regions are planned in the step's own jaxpr and, recursively, inside the jit,
scan and checkpoint bodies it holds (`shardlint.jaxpr.sub_of`): a scan over stacked layers is
rewritten once, in its body, and keeps its layer count; the rematerialized backward is a
body of its own.

Values cross body boundaries in three ways besides their global form: tokens in per-shard
order (a scan without remat saves the flattened tokens of each layer for its backward;
labels among them, as a scatter's `(batch, seq)` indices, stay labels in the body they
reach, where a gather or scatter reads them as addresses into the shard's block),
per-shard values stacked along a leading shard axis (group sizes saved the same way),
and token-sized constants (iotas JAX hoisted out of a loop), which a shard rebuilds at
its own size instead of receiving the global one. Each may only
reach a body that consumes it inside a region; anything else is refused.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import PartitionSpec as P

from ... import _jax
from ..._errors import RewriteError
from ..._token_axes import TokenAxes, as_axes
from . import _refusals
from ._constants import Builders
from ._groups import Group, boundaries, convex_groups
from ...jaxpr import carries, consumers_of, is_literal, sub_of, variables
from ._grow import Grower
from ..shard import ShardBinder
from ..trace import Traces


@dataclasses.dataclass
class Level:
    """One jaxpr (the step's, or a body inside it) and what runs per shard in it."""

    jaxpr: object                 # open Jaxpr at global shapes
    consts: tuple                 # its constants
    groups: list[Group]
    subs: dict                    # eqn index -> Level of its rewritten body
    stacked_in: set               # invars that arrive per shard, stacked on a leading axis
    built: dict                   # Var -> builder: token-sized constants rebuilt per shard
    stacked_out: set = dataclasses.field(default_factory=set)    # outvar positions
    # outvar position -> whether the value holds only labels (positions within a shard)
    shard_ordered_out: dict = dataclasses.field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.groups or self.subs)

    def count(self) -> int:
        return len(self.groups) + sum(s.count() for s in self.subs.values())


@dataclasses.dataclass
class Plan:
    top: Level
    axes: TokenAxes
    specs: dict                   # Var -> PartitionSpec of token-carrying values
    traces: Traces
    binder: ShardBinder           # binds the step's equations at one shard's shapes


def plan_regions(traces: Traces, axes: TokenAxes, *, seed_lines: frozenset = frozenset(),
                 per_shard_capacity: bool = False) -> Plan:
    """`seed_lines` are the (file, line) pairs where the analysis found sharding lost: a
    routing op there (top_k, a scatter into `[batch, seq, experts]`, a sort, a cumsum)
    starts a region even without a flatten. `per_shard_capacity` lets a capacity computed
    from the tokens run per shard (each shard drops by its own capacity)."""
    g = traces.global_jaxpr
    by_seq = traces.by_seq.shapes
    specs: dict = {}
    two_token_dims: set = set()   # two dims grow with the token count (e.g. a capacity)
    for var, shape in traces.local.shapes.items():
        spec = _spec(var.aval.shape, shape, by_seq.get(var, var.aval.shape), axes)
        if spec is None:
            continue
        names = [a for entry in spec for a in as_axes(entry)]
        if len(names) != len(set(names)):
            two_token_dims.add(var)
            continue
        specs[var] = spec
    capacity = frozenset(two_token_dims)
    if per_shard_capacity:
        sizes = _token_sizes(g.jaxpr, specs)
        capacity |= {v for v, spec in specs.items() if not _token_shaped(v, spec, sizes)}
    planner = _Planner(axes, specs, two_token_dims, capacity, seed_lines, per_shard_capacity, traces)
    top = planner.level(g.jaxpr, tuple(g.consts))
    return Plan(top, axes, specs, traces, planner.binder)


class _Planner:
    def __init__(self, axes, specs, two_token_dims, capacity, seed_lines, per_shard_capacity, traces):
        self.grower = Grower(axes, specs, two_token_dims, seed_lines, per_shard_capacity, capacity, traces.unbound)
        self.stand_ins, self.guessed = traces.stand_ins, traces.guessed
        self.binder = ShardBinder(traces.local.sizes, traces.local.literals, traces.local.folds)

    def level(self, jaxpr, consts, *, shard_ordered_in=None,
              stacked_in=frozenset(), built_in=None, positional_in=frozenset(),
              crossable=frozenset()) -> Level:
        """`shard_ordered_in`: the inputs that hold tokens in per-shard order, each with whether
        it holds only labels (positions within a shard, as a scatter's `(batch, seq)`
        indices: addresses where a gather or scatter reads them)."""
        shard_ordered_in = shard_ordered_in or {}
        eqns = jaxpr.eqns
        producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
        consumers = consumers_of(eqns)
        g = self.grower
        builders = Builders(jaxpr, consts, producer, g.scaled, built_in or {}, self.binder,
                            positional_in, self.stand_ins | self.guessed)
        growth = self.grower.region(eqns, producer, consumers, shard_ordered_in, stacked_in,
                                    leaves=builders.leaves())
        region = growth.region
        if region and not g.per_shard_capacity:
            for i in sorted(region):   # the capacity itself first, then what couples tokens
                for v in eqns[i].outvars:
                    if v in g.two_token_dims:
                        _refusals.refuse_global_capacity(eqns[i], v)
        if region and not g.per_shard_capacity:
            _refusals.refuse_token_coupling(eqns, region, g.specs)
        _refusals.refuse_unsure(eqns, region, self.stand_ins, self.guessed, g.specs, g.axes, g.unbound)
        groups = convex_groups(eqns, region)
        level = Level(jaxpr, consts, groups, {}, set(stacked_in), {})
        outvars = {v: k for k, v in enumerate(jaxpr.outvars) if not is_literal(v)}
        boundaries(level, eqns, producer, consumers, outvars, crossable,
                   sharded=set(g.specs), shard_ordered=growth.kept_inside, labels=growth.positional,
                   per_shard=g.capacity, per_shard_capacity=g.per_shard_capacity, counts=growth.counts)
        for grp in groups:
            for v in grp.inputs:
                if v in g.scaled and v not in shard_ordered_in and builders.can_build(v):
                    level.built[v] = builders.builder(v)
        self._enter_bodies(level, eqns, region, consumers, builders, shard_ordered_in, stacked_in)
        return level

    def _enter_bodies(self, level, eqns, region, consumers, builders, shard_ordered_in, stacked_in):
        # vars at this level holding tokens in per-shard order -> whether labels only
        shard_ordered = dict(shard_ordered_in)
        stacked = {v: False for v in stacked_in}   # var -> whether it came stacked from scan ys
        top_outvars = set(variables(level.jaxpr.outvars))
        for i, eqn in enumerate(eqns):
            sub = sub_of(eqn)
            if sub is None or i in region or eqn.primitive.name == "shard_map":
                continue
            first_carry, end_carry = carries(eqn)
            sub_shard_ordered, sub_stacked, sub_built, sub_positional = {}, set(), {}, set()
            for k, (a, inner) in enumerate(zip(eqn.invars, sub.jaxpr.invars)):
                if is_literal(a):
                    continue
                sliced = sub.stacks and k >= sub.sliced_from
                if first_carry <= k < end_carry and (a in shard_ordered or a in stacked):
                    self._refuse_carry(eqn, a)
                if a in shard_ordered:
                    sub_shard_ordered[inner] = shard_ordered[a]
                elif a in stacked:
                    if stacked[a] != sliced:
                        raise RewriteError(f"a per-shard value ({a.aval.str_short()}) saved by a "
                                           f"routed layer is passed on{_jax.eqn_line(eqn)} in a "
                                           "form the rewrite does not follow; wrap the layer in "
                                           "jax.checkpoint")
                    sub_stacked.add(inner)
                elif a in self.grower.scaled and not sliced and builders.can_build(a):
                    sub_built[inner] = builders.builder(a)
                    if builders.holds_positions(a):
                        sub_positional.add(inner)
            # Results that only bodies read may leave per shard (a scan's carries may not).
            crossable = {k for k, v in enumerate(eqn.outvars)
                         if k >= end_carry - first_carry and consumers.get(v) and v not in top_outvars
                         and all(sub_of(eqns[c]) is not None for c in consumers[v])}
            inner = self.level(sub.jaxpr, sub.consts, shard_ordered_in=sub_shard_ordered, stacked_in=frozenset(sub_stacked),
                               built_in=sub_built, positional_in=frozenset(sub_positional),
                               crossable=frozenset(crossable))
            if not inner.changed:
                if sub_shard_ordered or sub_stacked:
                    raise RewriteError(f"a per-shard value saved by a routed layer reaches "
                                       f"{eqn.primitive.name}{_jax.eqn_line(eqn)}, which computes "
                                       "no routed region with it; wrap the layer in jax.checkpoint")
                continue
            level.subs[i] = inner
            for k, labels_only in inner.shard_ordered_out.items():
                shard_ordered[eqn.outvars[k]] = labels_only
            for k in inner.stacked_out:
                stacked[eqn.outvars[k]] = sub.stacks

    @staticmethod
    def _refuse_carry(eqn, var):
        raise RewriteError(f"a per-shard value ({var.aval.str_short()}) is carried from one layer "
                           f"to the next{_jax.eqn_line(eqn)}; the rewrite keeps carries "
                           "global. Return it per (batch, seq) from the layer")


def _token_sizes(jaxpr, specs) -> dict:
    """The global sizes a token dimension has, per the mesh axes that shard it: those of
    the step's token-carrying inputs (batch, sequence) and of any run of their adjacent
    dimensions merged into one (flattened tokens). The inputs are followed into the calls
    that wrap the step and through the slices it takes of them: MaxText loads a batch of
    one sequence per device and trains on its first rows where per_device_batch_size < 1."""
    sizes: dict = {}
    for v in _inputs(jaxpr):
        spec = specs.get(v)
        if spec is None:
            continue
        shape = v.aval.shape
        entries = [as_axes(e) for e in tuple(spec) + (None,) * (len(shape) - len(spec))]
        for first in range(len(shape)):   # a run ends at a sharded dimension (the minor one)
            for end in (e + 1 for e in range(first, len(shape)) if entries[e]):
                names = tuple(a for e in entries[first:end] for a in e)
                sizes.setdefault(names, set()).add(math.prod(shape[first:end]))
    return sizes


def _inputs(jaxpr, given=None) -> list:
    """The step's inputs (or the `given` ones of a body), the inputs of the call bodies they
    are passed to, and the slices taken of them; not what is computed from them (slicing
    tokens down to a capacity makes a capacity)."""
    found = list(jaxpr.invars if given is None else given)
    seen = set(found)
    for eqn in jaxpr.eqns:
        inner = sub_of(eqn)
        if eqn.primitive.name == "slice" and eqn.invars[0] in seen:
            made = [eqn.outvars[0]]
        elif inner is not None and not inner.stacks:
            made = _inputs(inner.jaxpr, [w for v, w in zip(eqn.invars, inner.jaxpr.invars)
                                         if not is_literal(v) and v in seen])
        else:
            continue
        found += [v for v in made if v not in seen]
        seen.update(made)
    return found


def _token_shaped(var, spec, sizes: dict) -> bool:
    """Whether every dimension of `var` that shrinks per shard has a token dimension's size
    (else one is sized by something computed from the token count: a capacity)."""
    return all(entry is None or var.aval.shape[d] in sizes.get(as_axes(entry), ())
               for d, entry in enumerate(spec))


def _spec(g_shape, l_shape, s_shape, axes: TokenAxes) -> P | None:
    """Which mesh axes shard each dimension of a value, from its shapes at global size, on
    one shard, and with only the sequence divided."""
    if g_shape == l_shape or len(g_shape) != len(l_shape):
        return None
    entries = []
    for g, l, s in zip(g_shape, l_shape, s_shape):
        if g == l:
            entries.append(None)
            continue
        by_seq = g != s
        by_batch = s != l
        names = (axes.batch if by_batch else ()) + (axes.seq if by_seq else ())
        entries.append(names if len(names) > 1 else names[0] if names else None)
    return P(*entries)


