"""Grow a level's routed region from its seeds, and say which of its values hold tokens
in per-shard order.

A region starts at a reshape that merges a sequence-sharded dimension into tokens, at a
routing op on a line where the analysis found the sharding lost, or at a per-shard value
that arrives from another body; it grows forward through everything that reads tokens in
per-shard order (and the per-shard values derived from them that feed back into the
region, like group sizes), and ends where tokens are reshaped back to `(batch, seq, ...)`
or reduced away. Only the parts that route tokens to experts are kept: those with a grouped
matmul or an expert-batched dot, a routing op where the analysis found the loss, or, with
per-shard capacity, a dispatch that sums tokens into slots where the analysis found that
(`contracted-tokens`; at MaxText's Mixtral-8x7B size XLA keeps every routing op sharded and
the experts' weights reach their einsums through a convert, so nothing else marks it).

With per-shard capacity (GShard groups), two more kinds of value keep the region going,
because outside it they would mean something else: running totals over a shard's tokens
(`counts`, a token's position in its expert), up to the comparison that turns them into
a keep-or-drop decision, and values with a dimension sized by the shard's capacity
(`Grower.capacity`: one-hot slots, the dispatched `[experts, batch, capacity, ...]`
activations and their expert matmuls), up to the combine that contracts that dimension
away. A reshape back to `(batch, seq, ...)` ends neither: MaxText's `generate_masks`
folds `(seq, top_k)` for its cumsum and unfolds the counts right after.
"""

from __future__ import annotations

import dataclasses
import functools

from ... import _jax
from ..._errors import RewriteError
from ..._ops import CUMULATIVE_PRIMITIVES, ROUTING_PRIMITIVES
from ..._token_axes import TokenAxes
from ..._source import display_path
from ...jaxpr import (connected_parts, downstream, is_expert_batched_eqn, is_grouped_matmul_eqn,
    is_literal, reaches, reads_expert_weights, sub_of, variables)
from . import _refusals
from ._token_ops import count, is_address, merges_seq, pull_in_constants, splits_tokens, sums_tokens


# Comparisons whose answer does not change when labels are renamed one-to-one.
_RELABELING_INVARIANT = {"eq", "ne"}
# Ops whose operands place tokens, besides routing ops (`_is_routing_op`), gathers and scatters.
_ARRANGING = CUMULATIVE_PRIMITIVES | {"dynamic_slice", "dynamic_update_slice", "argsort"}


@dataclasses.dataclass
class Growth:
    """One level's routed region as it grows, and what it grows through."""

    eqns: list
    producer: dict                # Var -> index of the equation that makes it
    consumers: dict               # Var -> indices of the equations that read it
    stacked_in: frozenset         # values that arrive per shard, stacked on a leading axis
    merges: set                   # flattens of (batch, seq) into tokens: they reorder them
    exits: set                    # reshapes of tokens back to (batch, seq, ...)
    statistics: set               # sums over all tokens, which leave the region summed
    region: set                   # the region's equations (indices)
    shard_ordered: set = dataclasses.field(default_factory=set)   # tokens in per-shard order
    positional: set = dataclasses.field(default_factory=set)      # of those, labels only
    # With per-shard capacity: running totals over a shard's tokens (filled in as the
    # region grows; a capacity's value is one shard's, see the module docstring).
    counts: set = dataclasses.field(default_factory=set)
    constant: set = dataclasses.field(default_factory=set)        # pulled in, built per shard

    @property
    def kept_inside(self) -> set:
        """The values that may not leave the region: tokens in per-shard order, and running
        totals (outside they would be compared with the capacity of all tokens)."""
        return self.shard_ordered | self.counts


@dataclasses.dataclass
class Grower:
    """What the traces say about tokens, the same for every level of the step."""

    axes: TokenAxes
    specs: dict                   # Var -> PartitionSpec of values that carry tokens
    two_token_dims: set                   # values with a second dimension sized by the token count
    seed_lines: frozenset         # (file, line) where the analysis found sharding lost
    per_shard_capacity: bool
    # With per-shard capacity: values with a dimension that shrinks per shard but is no
    # token dimension (a capacity's slots), `two_token_dims` included; else just `two_token_dims`.
    capacity: frozenset = frozenset()
    # id(eqn) -> why it does not bind at one shard's shapes (`trace/_shard_shapes.py`)
    unbound: dict = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def scaled(self) -> set:
        """Every value that carries tokens (computed once: it is asked per operand)."""
        return set(self.specs) | self.two_token_dims

    def region(self, eqns, producer, consumers, shard_ordered_in: dict, stacked_in,
               leaves: dict | None = None) -> Growth:
        """The region's equations, and the values in it that hold tokens in per-shard order
        (flattened, or built from per-shard constants): those may not leave it. `leaves`:
        token-sized values buildable per shard with no equation here (constants, and those
        an outer jaxpr builds, as a scan's hoisted iotas), and whether each holds positions.
        `shard_ordered_in`: the arriving values in per-shard order, each with whether it holds
        local positions only (a scatter's `(batch, seq)` indices the forward saved for the
        backward)."""
        leaves = leaves or {}
        merges = {i for i, e in enumerate(eqns) if merges_seq(e, self.specs, self.axes)}
        routing = {i for i, e in enumerate(eqns) if self._routing_seed(e, eqns, producer)}
        arriving = set(shard_ordered_in) | set(stacked_in)
        seeds = merges | routing
        seeds |= {c for v in arriving for c in consumers.get(v, ()) if sub_of(eqns[c]) is None}
        if not seeds:
            return Growth(eqns, producer, consumers, frozenset(stacked_in), set(), set(), set(), set())
        growth = Growth(
            eqns, producer, consumers, frozenset(stacked_in), merges,
            exits={i for i, e in enumerate(eqns) if splits_tokens(e, self.specs, self.axes)},
            statistics={v for i in self._statistics(eqns, consumers) for v in eqns[i].outvars},
            region=set(seeds), shard_ordered=set(shard_ordered_in),
            positional={v for v, labels_only in shard_ordered_in.items() if labels_only})
        while True:
            self._grow(growth)
            if not self._pull_in_constants(growth, leaves):
                break
        self._refuse_unbound(eqns, growth.region, producer, consumers)
        growth.region = self._routed_only(eqns, growth.region, producer, consumers,
                                          routing | self._dispatches(eqns))
        for v in arriving:
            outside = [c for c in consumers.get(v, ()) if c not in growth.region and sub_of(eqns[c]) is None]
            if outside:
                raise RewriteError(
                    f"a per-shard value ({v.aval.str_short()}) that a routed layer saved for later "
                    f"is read outside a routed region{_refusals.user_line(eqns[outside[0]])}; "
                    "wrap the layer in jax.checkpoint so its backward recomputes it")
        return growth

    def _pull_in_constants(self, g: Growth, leaves: dict) -> bool:
        """Pulls into the region the token-sized values it reads that a shard can build from
        nothing (`pull_in_constants`), and marks what they hold; True when any joined.

        Constants rebuilt per shard that are built from an iota hold local positions
        (indices into the shard's block, which is what the region's ops address): they may
        not leave it, so what reads them joins in turn (scatter's JVP compares such ids
        outside the scatter). Uniform ones (zeros, full) are only rebuilt smaller."""
        grown = set(g.region)
        pulled = pull_in_constants(g.eqns, g.region, self.scaled, g.producer, leaves)
        # What was pulled in because it computes on region values follows its inputs;
        # a leaf that holds positions is a label from here on (it may not leave).
        for i in sorted(pulled):
            ins = variables(g.eqns[i].invars)
            labels = {v for v in ins if leaves.get(v)}
            g.shard_ordered |= labels
            g.positional |= labels
            if all(g.producer.get(v) in g.constant or v in leaves
                   or (v not in self.scaled and g.producer.get(v) not in grown) for v in ins):
                g.constant.add(i)
                if g.eqns[i].primitive.name == "iota" or any(v in g.positional or leaves.get(v)
                                                              for v in ins):
                    outs = {v for v in g.eqns[i].outvars if v in self.scaled}
                    g.shard_ordered |= outs
                    g.positional |= outs
            else:
                self._propagate(g.eqns[i], g, reordered=False)
        return bool(pulled)

    def _grow(self, g: Growth) -> None:
        """Grows the region and what it marks to a fixpoint: an equation joins when it reads
        tokens in per-shard order, or reads a per-shard value (group sizes, offsets) and feeds
        back into the region, or, with per-shard capacity, reads a running total over a
        shard's tokens or a value with a dimension sized by the shard's capacity that the
        region made.

        `positional` values are in (batch, seq, ...) form but hold per-shard labels (local
        positions, ids scattered and gathered back); comparing two for equality gives the
        same answer under any relabeling, so its result is an ordinary value (the JVP of
        `x.at[i].set(u)` finds the winning update that way).

        A statistic over the tokens (`_statistics`) leaves the region as a sum across shards:
        what reads it reads the global value, so it does not join for that."""
        changed = True
        while changed:
            changed = False
            into_region = reaches(g.eqns, g.consumers, g.region)
            for i, e in enumerate(g.eqns):
                ins = variables(e.invars)
                if i not in g.region:
                    made_here = [v for v in ins if g.producer.get(v) in g.region or v in g.stacked_in]
                    per_shard = any(v not in self.scaled and v not in g.statistics for v in made_here)
                    slots = self.per_shard_capacity and any(v in self.capacity for v in made_here)
                    if not (any(v in g.shard_ordered or v in g.counts for v in ins) or slots
                            or (per_shard and i in into_region)):
                        continue
                    g.region.add(i)
                    changed = True
                if self.per_shard_capacity and count(e, g.counts, self.scaled, self.specs):
                    changed = True
                if i in g.exits:
                    continue
                if self._propagate(e, g, reordered=i in g.merges):
                    changed = True

    def _statistics(self, eqns, consumers) -> set[int]:
        """Sums over every token of a value (a load-balancing loss's fraction of tokens per
        expert, a masked token count) that arrange no tokens: before any value that carries
        tokens again, they reach no grouped matmul, routing op, running total, gather or
        scatter (group sizes and offsets do, and stay per shard). Per shard such a sum is a
        shard's part of the whole one: it leaves the region summed across shards, and what
        is computed from it (a maximum, a ratio of two) runs on the global value, as written."""
        found = set()
        for i, e in enumerate(eqns):
            if (e.primitive.name == "reduce_sum" and not is_literal(e.invars[0]) and e.invars[0] in self.scaled
                    and not any(v in self.scaled for v in e.outvars)
                    and not self._arranges(eqns, consumers, i)):
                found.add(i)
        return found

    def _arranges(self, eqns, consumers, start: int) -> bool:
        """Whether `start`'s results reach an op that places tokens, through values that
        carry no tokens."""
        seen, stack = {start}, [start]
        while stack:
            for v in eqns[stack.pop()].outvars:
                for c in consumers.get(v, ()):
                    e = eqns[c]
                    if (is_grouped_matmul_eqn(e) or _is_routing_op(e) or e.primitive.name in _ARRANGING
                            or e.primitive.name.startswith(("gather", "scatter"))):
                        return True
                    if c not in seen and not any(o in self.scaled for o in e.outvars):
                        seen.add(c)
                        stack.append(c)
        return False

    def _propagate(self, eqn, g: Growth, *, reordered: bool) -> bool:
        """Marks `eqn`'s token-carrying results as in per-shard order (and positional when
        they hold labels only); True when something new was marked. `reordered`: the
        equation itself puts tokens in per-shard order (a flatten, a running total).

        A gather's or scatter's indices are addresses: local positions there place values
        in the shard's own block and leave no label in the result; indices in per-shard
        order do reorder it."""
        carried = [v for v in variables(eqn.invars) if v in g.shard_ordered
                   and not (v in g.positional and is_address(eqn, v))]
        if not (reordered or carried):
            return False
        labels_only = not reordered and all(v in g.positional for v in carried)
        if labels_only and eqn.primitive.name in _RELABELING_INVARIANT:
            return False
        new = {v for v in eqn.outvars if v in self.scaled} - g.shard_ordered
        g.shard_ordered |= new
        if labels_only:
            g.positional |= new
        return bool(new)

    def _routing_seed(self, eqn, eqns, producer) -> bool:
        """A routing op where the analysis found the sharding lost (jnp's `cumsum`,
        `argsort` and `take_along_axis` are jitted helpers: their jit equation counts), or
        one whose operand an equation there made: JAX 0.12 often names the matmul that
        feeds top_k (the router's logits) instead of top_k itself."""
        if not self.seed_lines or not _is_routing_op(eqn):
            return False
        operands = [v for v in variables(_routed_operands(eqn)) if v in self.scaled]
        if not operands:
            return False
        makers = [eqns[producer[v]] for v in operands if v in producer]
        return any(self._at_seed_line(e) for e in (eqn, *makers))

    def _dispatches(self, eqns) -> set[int]:
        """Dispatches that sum tokens away, on a line where the analysis found it
        (`contracted-tokens`): a `dot_general` that contracts a dimension of tokens sharded
        over the sequence's axes against another value that carries tokens (the capacity
        dispatch `BSM,BSEC -> EBCM`, and the combine's transpose in the backward). Like a
        routing op, one marks the part of a region it sits in as routed where its result
        reaches the experts (`_routed_only`); it starts none: the fold or the routing op
        before it does, with the masks it reads. Only with per-shard capacity: the slots it
        fills are one shard's then."""
        if not self.per_shard_capacity:
            return set()
        return {i for i, e in enumerate(eqns)
                if sums_tokens(e, self.specs, self.scaled, self.axes) and self._at_seed_line(e)}

    def _at_seed_line(self, eqn) -> bool:
        frame = _jax.user_frame(eqn)
        return frame is not None and (display_path(frame[0]), frame[1]) in self.seed_lines

    def _experts(self, eqns, producer) -> set[int]:
        return {i for i, e in enumerate(eqns) if reads_expert_weights(e, eqns, producer, self.scaled)}

    def _refuse_unbound(self, eqns, region, producer, consumers) -> None:
        """An op that reads the region's tokens on their way to the experts and does not
        bind at one shard's shapes: the region cannot run per shard, and the refusal names it."""
        experts = self._experts(eqns, producer) | {i for i, e in enumerate(eqns) if is_grouped_matmul_eqn(e)}
        for i in sorted(region):
            why = self.unbound.get(id(eqns[i]))
            if why is not None and downstream(eqns, consumers, {i}) & experts:
                _refusals.refuse_unbound(eqns[i], why)

    def _routed_only(self, eqns, region, producer, consumers, routing) -> set[int]:
        """The connected parts of the region that route tokens to experts: they hold a
        grouped matmul or an expert-batched dot, or a routing op (or a dispatch that sums
        tokens away, `_dispatches`) whose result reaches an expert weight's matmul (the rest
        of the step, a backward included) or, from before the experts, what their outputs
        flow into, or a routing op on the same line as such a one (its transpose in the
        backward)."""
        experts = self._experts(eqns, producer)
        after_experts = downstream(eqns, consumers, experts)
        routed_lines = set()
        for i in routing:
            ahead = downstream(eqns, consumers, {i})
            # Into the experts (a sort before a grouped matmul), or, from before them, into
            # what combines their outputs (the weights of a dense dispatch, in a scanned
            # layer's forward body where no expert matmul follows).
            if ahead & experts or (i not in after_experts and ahead & after_experts):
                routed_lines.add(_jax.user_frame(eqns[i]))
        keep = {i for i in routing if _jax.user_frame(eqns[i]) in routed_lines}
        return connected_parts(eqns, region, producer,
                               lambda i: i in keep or is_grouped_matmul_eqn(eqns[i])
                               or is_expert_batched_eqn(eqns[i], producer))


def _routed_operands(eqn) -> list:
    """The operands a routing op moves or ranks. A gather or scatter routes tokens only
    when the array it reads from or writes into carries them: an embedding lookup (a
    table gathered at token ids) and its backward (a scatter-add into the table) do not.
    A jitted jnp helper (`take_along_axis`, `argsort`) takes that array first."""
    if eqn.primitive.name.startswith(("gather", "scatter", "jit", "pjit")):
        return list(eqn.invars[:1])
    return list(eqn.invars)


def _is_routing_op(eqn) -> bool:
    if eqn.primitive.name in ROUTING_PRIMITIVES:  # XLA may gather their inputs: per shard
        return True
    sub = sub_of(eqn) if eqn.primitive.name in ("jit", "pjit") else None
    return sub is not None and any(_is_routing_op(e) for e in sub.jaxpr.eqns)
