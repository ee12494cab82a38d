"""Find the routed-expert regions of a traced step, in every jaxpr a layer can live in.

A region starts at a reshape that merges a sequence-sharded dimension into tokens, grows
forward through everything that carries those tokens (and the per-shard values derived
from them that feed back into tokens, like group sizes), and ends where tokens are
reshaped back to `(batch, seq, ...)` or reduced away. Regions are planned in the step's
own jaxpr and, recursively, inside the jit, scan and checkpoint bodies it holds
(`_subjaxprs`): a scan over stacked layers is rewritten once, in its body, and keeps its
layer count; the rematerialized backward is a body of its own.

Values cross body boundaries in three ways besides their global form: tokens in per-shard
order (a scan without remat saves the flattened tokens of each layer for its backward),
per-shard values stacked along a leading shard axis (group sizes saved the same way),
and token-sized constants (iotas JAX hoisted out of a loop), which a shard rebuilds at
its own size from the per-shard trace instead of receiving the global one. Each may only
reach a body that consumes it inside a region; anything else is refused.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from .. import _jax
from .._errors import RewriteError
from ..analyzer._detect import reshape_groups
from ..analyzer._patterns import is_grouped_matmul_eqn
from ..analyzer._stack import display_path
from . import _refusals
from ._groups import Group, boundaries, convex_groups
from ._replay import bind_eqn, read
from ._subjaxprs import carries, sub_of
from ._trace import TokenAxes, Traces, entry_axes, pair_vars


# Routing ops that XLA's partitioner may not split along batch or sequence (it gathers
# their inputs); where the analysis found that, they run per shard.
ROUTING_OPS = {"top_k", "sort", "scatter", "scatter-add", "scatter_add", "gather", "cumsum",
               "cumprod", "cummax", "cummin", "argmax", "argmin"}


@dataclasses.dataclass
class Level:
    """One jaxpr (the step's, or a body inside it) and what runs per shard in it."""

    jaxpr: object                 # open Jaxpr at global shapes
    consts: tuple                 # its constants
    local: object                 # the same jaxpr at one shard's shapes
    local_consts: tuple
    groups: list[Group]
    subs: dict                    # eqn index -> Level of its rewritten body
    stacked_in: set               # invars that arrive per shard, stacked on a leading axis
    built: dict                   # Var -> builder: token-sized constants rebuilt per shard
    stacked_out: set = dataclasses.field(default_factory=set)    # outvar positions
    scrambled_out: set = dataclasses.field(default_factory=set)  # outvar positions

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
    local_of: dict                # global Var -> local Var
    traces: Traces


def plan_regions(traces: Traces, axes: TokenAxes, *, seed_lines: frozenset = frozenset(),
                 per_shard_capacity: bool = False) -> Plan:
    """`seed_lines` are the (file, line) pairs where the analysis found sharding lost: a
    routing op there (top_k, a scatter into `[batch, seq, experts]`, a sort, a cumsum)
    starts a region even without a flatten. `per_shard_capacity` lets a capacity computed
    from the tokens run per shard (each shard drops by its own capacity)."""
    g, l = traces.global_jaxpr, traces.local_jaxpr
    local_of = pair_vars(g.jaxpr, l.jaxpr)
    seq_of = pair_vars(g.jaxpr, traces.seq_jaxpr.jaxpr)
    specs: dict = {}
    doubly: set = set()   # two dims grow with the token count (e.g. a capacity)
    for var, lvar in local_of.items():
        spec = _spec(var, lvar, seq_of.get(var), axes)
        if spec is None:
            continue
        names = [a for entry in spec for a in entry_axes(entry)]
        if len(names) != len(set(names)):
            doubly.add(var)
            continue
        specs[var] = spec
    planner = _Planner(axes, specs, doubly, local_of, seed_lines, per_shard_capacity)
    top = planner.level(g.jaxpr, tuple(g.consts), l.jaxpr, tuple(l.consts))
    return Plan(top, axes, specs, local_of, traces)


class _Planner:
    def __init__(self, axes, specs, doubly, local_of, seed_lines, per_shard_capacity):
        self.axes, self.specs, self.doubly = axes, specs, doubly
        self.scaled = set(specs) | doubly      # values that carry tokens
        self.local_of = local_of
        self.seed_lines, self.per_shard_capacity = seed_lines, per_shard_capacity

    def level(self, jaxpr, consts, local, local_consts, *, scrambled_in=frozenset(),
              stacked_in=frozenset(), built_in=None, crossable=frozenset()) -> Level:
        eqns = jaxpr.eqns
        producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
        consumers = _consumers(eqns)
        builders = _Builders(jaxpr, local, local_consts, producer, self.scaled, built_in or {})
        region, scrambled = self._region(eqns, producer, consumers, scrambled_in, stacked_in)
        if region and not self.per_shard_capacity:
            _refusals.refuse_token_coupling(eqns, region, self.specs)
            for i in sorted(region):
                for v in eqns[i].outvars:
                    if v in self.doubly:
                        _refusals.refuse_global_capacity(eqns[i], v)
        groups = convex_groups(eqns, region)
        level = Level(jaxpr, consts, local, local_consts, groups, {}, set(stacked_in), {})
        outvars = {v: k for k, v in enumerate(jaxpr.outvars) if not _jax.is_literal(v)}
        boundaries(level, eqns, local.eqns, producer, consumers, outvars, crossable,
                   sharded=set(self.specs), scrambled=scrambled, per_shard=self.doubly)
        for grp in groups:
            for v in grp.inputs:
                if v in self.scaled and v not in scrambled_in and builders.can_build(v):
                    level.built[v] = builders.builder(v)
        self._enter_bodies(level, eqns, region, consumers, builders, scrambled_in, stacked_in)
        return level

    def _region(self, eqns, producer, consumers, scrambled_in, stacked_in) -> tuple[set[int], set]:
        """The region's equations, and the values in it that hold tokens in per-shard order
        (flattened, or built from per-shard constants): those may not leave it."""
        merges = {i for i, e in enumerate(eqns) if _merges_seq(e, self.specs, self.axes)}
        routing = {i for i, e in enumerate(eqns) if self._routing_seed(e)}
        arriving = set(scrambled_in) | set(stacked_in)
        seeds = merges | routing
        seeds |= {c for v in arriving for c in consumers.get(v, ()) if sub_of(eqns[c]) is None}
        if not seeds:
            return set(), set()
        exits = {i for i, e in enumerate(eqns) if _splits_tokens(e, self.specs, self.axes)}
        # Grow to a fixpoint: an equation joins when it reads tokens in per-shard order, or
        # reads a per-shard value (group sizes, offsets) and feeds back into the region.
        region: set[int] = set(seeds)
        scrambled: set = set(scrambled_in)
        # With per-shard capacity, a running total over tokens means "per shard": what it
        # feeds stays in the region until tokens are back in block form (the combine).
        coupling = {i for i in routing if self.per_shard_capacity
                    and _refusals.couples_tokens(eqns[i], self.specs)}
        changed = True
        while changed:
            changed = False
            reaches = _reaches(eqns, consumers, region)
            for i, e in enumerate(eqns):
                ins = _vars(e.invars)
                if i not in region:
                    per_shard = any(v not in self.scaled and (producer.get(v) in region or v in stacked_in)
                                    for v in ins)
                    if not (any(v in scrambled for v in ins) or (per_shard and i in reaches)):
                        continue
                    region.add(i)
                    changed = True
                if i in exits or (coupling and self._back_in_block_form(e)):
                    continue
                if i in merges or i in coupling or any(v in scrambled for v in ins):
                    new = {v for v in e.outvars if v in self.scaled} - scrambled
                    if new:
                        scrambled |= new
                        changed = True
        grown = set(region)
        pulled = _pull_in_constants(eqns, region, self.scaled, producer)
        # Constants rebuilt per shard hold local positions (indices into the shard's
        # block, which is what the region's ops address): they may not leave it. What
        # was pulled in because it computes on region values follows its inputs.
        constant: set[int] = set()
        for i in sorted(pulled):
            ins = _vars(eqns[i].invars)
            if all(producer.get(v) in constant or (v not in self.scaled and producer.get(v) not in grown)
                   for v in ins):
                constant.add(i)
                scrambled |= {v for v in eqns[i].outvars if v in self.scaled}
            elif any(v in scrambled for v in ins):
                scrambled |= {v for v in eqns[i].outvars if v in self.scaled}
        region = self._routed_only(eqns, region, producer, consumers, routing)
        for v in arriving:
            outside = [c for c in consumers.get(v, ()) if c not in region and sub_of(eqns[c]) is None]
            if outside:
                raise RewriteError(
                    f"a per-shard value ({v.aval.str_short()}) that a routed layer saved for later "
                    f"is read outside a routed region{_refusals.user_line(eqns[outside[0]])}; "
                    "wrap the layer in jax.checkpoint so its backward recomputes it")
        return region, scrambled

    def _back_in_block_form(self, eqn) -> bool:
        """Tokens sharded as the input's, computed from a per-shard-capacity value (one
        with a dimension sized by the capacity): the combine of a capacity dispatch."""
        return (all(v in self.specs for v in eqn.outvars)
                and any(v in self.doubly for v in _vars(eqn.invars)))

    def _routing_seed(self, eqn) -> bool:
        """A routing op where the analysis found the sharding lost (jnp's `cumsum`,
        `argsort` and `take_along_axis` are jitted helpers: their jit equation counts)."""
        if not self.seed_lines or not _is_routing_op(eqn):
            return False
        if not any(v in self.scaled for v in _vars(eqn.invars)):
            return False
        frame = _jax.user_frame(eqn)
        return frame is not None and (display_path(frame[0]), frame[1]) in self.seed_lines

    def _routed_only(self, eqns, region, producer, consumers, routing) -> set[int]:
        """The connected parts of the region that route tokens to experts: they hold a
        grouped matmul or an expert-batched dot, or a routing op whose result reaches an
        expert weight's matmul (the rest of the step, a backward included), or a routing
        op on the same line as such a one (its transpose in the backward)."""
        experts = {i for i, e in enumerate(eqns) if _reads_expert_weights(e, eqns, producer)}
        routed_lines = set()
        for i in routing:
            if _reaches_any(i, eqns, consumers, experts):
                routed_lines.add(_jax.user_frame(eqns[i]))
        keep = {i for i in routing if _jax.user_frame(eqns[i]) in routed_lines}
        return _connected_parts(eqns, region, producer,
                                lambda i: i in keep or is_grouped_matmul_eqn(eqns[i])
                                or _expert_batched(eqns[i], producer))

    def _enter_bodies(self, level, eqns, region, consumers, builders, scrambled_in, stacked_in):
        scrambled = set(scrambled_in)   # vars at this level holding tokens in per-shard order
        stacked = {v: False for v in stacked_in}   # var -> whether it came stacked from scan ys
        top_outvars = set(_vars(level.jaxpr.outvars))
        for i, eqn in enumerate(eqns):
            sub = sub_of(eqn)
            if sub is None or i in region or eqn.primitive.name == "shard_map":
                continue
            lsub = sub_of(level.local.eqns[i])
            first_carry, end_carry = carries(eqn)
            sub_scrambled, sub_stacked, sub_built = set(), set(), {}
            for k, (a, inner) in enumerate(zip(eqn.invars, sub.jaxpr.invars)):
                if _jax.is_literal(a):
                    continue
                sliced = sub.stacks and k >= sub.sliced_from
                if first_carry <= k < end_carry and (a in scrambled or a in stacked):
                    self._refuse_carry(eqn, a)
                if a in scrambled:
                    sub_scrambled.add(inner)
                elif a in stacked:
                    if stacked[a] != sliced:
                        raise RewriteError(f"a per-shard value ({a.aval.str_short()}) saved by a "
                                           f"routed layer is passed on{_refusals.user_line(eqn)} in a "
                                           "form the rewrite does not follow; wrap the layer in "
                                           "jax.checkpoint")
                    sub_stacked.add(inner)
                elif a in self.scaled and not sliced and builders.can_build(a):
                    sub_built[inner] = builders.builder(a)
            # Results that only bodies read may leave per shard (a scan's carries may not).
            crossable = {k for k, v in enumerate(eqn.outvars)
                         if k >= end_carry - first_carry and consumers.get(v) and v not in top_outvars
                         and all(sub_of(eqns[c]) is not None for c in consumers[v])}
            inner = self.level(sub.jaxpr, sub.consts, lsub.jaxpr, lsub.consts,
                               scrambled_in=frozenset(sub_scrambled), stacked_in=frozenset(sub_stacked),
                               built_in=sub_built, crossable=frozenset(crossable))
            if not inner.changed:
                if sub_scrambled or sub_stacked:
                    raise RewriteError(f"a per-shard value saved by a routed layer reaches "
                                       f"{eqn.primitive.name}{_refusals.user_line(eqn)}, which computes "
                                       "no routed region with it; wrap the layer in jax.checkpoint")
                continue
            level.subs[i] = inner
            for k in inner.scrambled_out:
                scrambled.add(eqn.outvars[k])
            for k in inner.stacked_out:
                stacked[eqn.outvars[k]] = sub.stacks

    @staticmethod
    def _refuse_carry(eqn, var):
        raise RewriteError(f"a per-shard value ({var.aval.str_short()}) is carried from one layer "
                           f"to the next{_refusals.user_line(eqn)}; the rewrite keeps carries "
                           "global. Return it per (batch, seq) from the layer")


class _Builders:
    """Token-sized values built from constants alone (iota, zeros, `arange(T) // K`): a
    shard rebuilds them at its own size by replaying the per-shard trace's equations."""

    def __init__(self, jaxpr, local, local_consts, producer, scaled, built_in):
        self.eqns, self.l_eqns = jaxpr.eqns, local.eqns
        self.producer, self.scaled, self.built_in = producer, scaled, built_in
        self.local_consts = dict(zip(local.constvars, local_consts))
        self.constvars = set(jaxpr.constvars)
        self.local_constvar = dict(zip(jaxpr.constvars, local.constvars))
        self._memo: dict = {}

    def can_build(self, v) -> bool:
        if v in self._memo:
            return self._memo[v]
        self._memo[v] = False
        p = self.producer.get(v)
        ok = v in self.built_in or v in self.constvars or (
            p is not None and all(self.can_build(u) for u in _vars(self.eqns[p].invars)))
        self._memo[v] = ok
        return ok

    def builder(self, v):
        """A function of a per-body memo that returns `v` at one shard's size."""
        if v in self.built_in:
            return self.built_in[v]
        if v in self.constvars:
            value = self.local_consts[self.local_constvar[v]]
            return lambda memo: value
        p = self.producer[v]
        g_eqn, l_eqn = self.eqns[p], self.l_eqns[p]
        inputs = [None if _jax.is_literal(a) else self.builder(a) for a in g_eqn.invars]
        position = g_eqn.outvars.index(v)
        key = (id(self), p)

        def build(memo):
            if key not in memo:
                invals = [read({}, la) if b is None else b(memo) for la, b in zip(l_eqn.invars, inputs)]
                memo[key] = bind_eqn(l_eqn, invals, manual=True)
            return memo[key][position]

        return build


def _spec(var, lvar, svar, axes: TokenAxes) -> P | None:
    g_shape = getattr(var.aval, "shape", ())
    l_shape = getattr(lvar.aval, "shape", ())
    if g_shape == l_shape or len(g_shape) != len(l_shape):
        return None
    s_shape = getattr(svar.aval, "shape", g_shape) if svar is not None else g_shape
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


def _merges_seq(eqn, specs, axes: TokenAxes) -> bool:
    """A reshape folding a sequence-sharded dim together with another into one dim."""
    if eqn.primitive.name != "reshape" or not eqn.invars or eqn.invars[0] not in specs:
        return False
    src = specs[eqn.invars[0]]
    shape_in, shape_out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    for ins, outs in reshape_groups(shape_in, shape_out):
        if len(ins) > 1 and len(outs) == 1 and any(
                set(axes.seq) & set(entry_axes(src[d])) for d in ins if d < len(src)):
            return True
    return False


def _splits_tokens(eqn, specs, axes: TokenAxes) -> bool:
    """A reshape unfolding tokens back into separate (batch, seq) dims."""
    if eqn.primitive.name != "reshape" or eqn.outvars[0] not in specs:
        return False
    out = specs[eqn.outvars[0]]
    shape_in, shape_out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    for ins, outs in reshape_groups(shape_in, shape_out):
        if len(ins) == 1 and len(outs) > 1 and any(
                set(axes.seq) & set(entry_axes(out[d])) for d in outs if d < len(out)):
            return True
    return False


def _vars(atoms):
    return [a for a in atoms if not _jax.is_literal(a)]


def _consumers(eqns) -> dict:
    users: dict = {}
    for i, e in enumerate(eqns):
        for v in _vars(e.invars):
            users.setdefault(v, []).append(i)
    return users


def _reaches(eqns, consumers, targets: set[int]) -> set[int]:
    """Equations with a dataflow path into `targets` (computed backwards)."""
    reaches: set[int] = set()
    for i in range(len(eqns) - 1, -1, -1):
        for v in eqns[i].outvars:
            if any(c in targets or c in reaches for c in consumers.get(v, ())):
                reaches.add(i)
                break
    return reaches


def _pull_in_constants(eqns, region, scaled, producer) -> set[int]:
    """Token-sized values built from nothing (iota, zeros, `arange(T) // K`) join the
    region with everything they are built from, so they are rebuilt at local size.
    Returns the equations pulled in."""
    memo: dict[int, bool] = {}
    pulled: set[int] = set()

    def buildable(p: int) -> bool:
        if p not in memo:
            memo[p] = False  # cycles cannot occur in a jaxpr; this guards the recursion
            memo[p] = all(u not in scaled or producer.get(u) in region
                          or (producer.get(u) is not None and buildable(producer[u]))
                          for u in _vars(eqns[p].invars))
        return memo[p]

    def pull(p: int) -> None:
        if p in region:
            return
        region.add(p)
        pulled.add(p)
        for u in _vars(eqns[p].invars):
            if u in scaled and producer.get(u) is not None:
                pull(producer[u])

    for i in sorted(region):
        for v in _vars(eqns[i].invars):
            p = producer.get(v)
            if p is not None and p not in region and v in scaled and buildable(p):
                pull(p)
    return pulled


def _is_routing_op(eqn) -> bool:
    if eqn.primitive.name in ROUTING_OPS:
        return True
    sub = sub_of(eqn) if eqn.primitive.name in ("jit", "pjit") else None
    return sub is not None and any(_is_routing_op(e) for e in sub.jaxpr.eqns)


def _connected_parts(eqns, region: set[int], producer, holds) -> set[int]:
    """The region's equations in connected parts that have an equation `holds` accepts;
    other token flattens (a cross-entropy over flattened tokens) stay as they are."""
    parent = {i: i for i in region}

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in region:
        for v in _vars(eqns[i].invars):
            p = producer.get(v)
            if p in region:
                parent[find(i)] = find(p)
    routed = {find(i) for i in region if holds(i)}
    return {i for i in region if find(i) in routed}


def _reads_expert_weights(eqn, eqns, producer) -> bool:
    """A matmul with a stacked expert weight: an input of the jaxpr of rank 3 or more,
    maybe through a layout op or a sharding annotation."""
    if eqn.primitive.name not in ("dot_general", "ragged_dot_general"):
        return False
    for operand in _vars(eqn.invars):
        for _ in range(4):
            p = producer.get(operand)
            if p is None:
                if len(getattr(operand.aval, "shape", ())) >= 3:
                    return True
                break
            if eqns[p].primitive.name not in _LAYOUT_PRIMITIVES:
                break
            operand = next(iter(_vars(eqns[p].invars)), None)
            if operand is None:
                break
    return False


_LAYOUT_PRIMITIVES = {"convert_element_type", "transpose", "reshape", "copy", "copy_p",
                      "sharding_constraint", "reshard", "mesh_cast", "squeeze", "expand_dims"}


def _reaches_any(start: int, eqns, consumers, targets: set[int]) -> bool:
    seen, stack = {start}, [start]
    while stack:
        i = stack.pop()
        if i in targets:
            return True
        for v in eqns[i].outvars:
            for c in consumers.get(v, ()):
                if c not in seen:
                    seen.add(c)
                    stack.append(c)
    return False


def _expert_batched(eqn, producer) -> bool:
    """A dispatch einsum: dot_general batched over the leading (expert) dim of a rank-3
    weight that is an input of the jaxpr."""
    if eqn.primitive.name != "dot_general":
        return False
    (_, _), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    for operand, batch in zip(eqn.invars, (lhs_batch, rhs_batch)):
        if (not _jax.is_literal(operand) and producer.get(operand) is None
                and len(getattr(operand.aval, "shape", ())) == 3 and 0 in tuple(batch)):
            return True
    return False
