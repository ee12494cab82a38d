"""Grow a level's routed region from its seeds, and say which of its values hold tokens
in per-shard order.

A region starts at a reshape that merges a sequence-sharded dimension into tokens, at a
routing op on a line where the analysis found the sharding lost, or at a per-shard value
that arrives from another body; it grows forward through everything that reads tokens in
per-shard order (and the per-shard values derived from them that feed back into the
region, like group sizes), and ends where tokens are reshaped back to `(batch, seq, ...)`
or reduced away. Only the parts that route tokens to experts are kept.

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

from .. import _jax
from .._errors import RewriteError
from .._token_axes import TokenAxes, as_axes
from ..analyzer._detect import reshape_groups
from ..analyzer._patterns import is_expert_batched_eqn, is_grouped_matmul_eqn, reads_expert_weights
from ..analyzer._stack import display_path
from . import _refusals
from ._subjaxprs import sub_of

# Routing ops that XLA's partitioner may not split along batch or sequence (it gathers
# their inputs); where the analysis found that, they run per shard.
ROUTING_OPS = {"top_k", "sort", "scatter", "scatter-add", "scatter_add", "gather", "cumsum",
               "cumprod", "cummax", "cummin", "argmax", "argmin"}


# Comparisons whose answer does not change when labels are renamed one-to-one.
_RELABELING_INVARIANT = {"eq", "ne"}


@dataclasses.dataclass
class Grower:
    """What the traces say about tokens, the same for every level of the step."""

    axes: TokenAxes
    specs: dict                   # Var -> PartitionSpec of values that carry tokens
    doubly: set                   # values with a second dimension sized by the token count
    seed_lines: frozenset         # (file, line) where the analysis found sharding lost
    per_shard_capacity: bool
    # With per-shard capacity: values with a dimension that shrinks per shard but is no
    # token dimension (a capacity's slots), `doubly` included; else just `doubly`.
    capacity: frozenset = frozenset()

    @functools.cached_property
    def scaled(self) -> set:
        """Every value that carries tokens (computed once: it is asked per operand)."""
        return set(self.specs) | self.doubly

    def region(self, eqns, producer, consumers, scrambled_in: dict, stacked_in,
               leaves: dict | None = None) -> tuple[set[int], set, set, set]:
        """The region's equations, and the values in it that hold tokens in per-shard order
        (flattened, or built from per-shard constants): those may not leave it. `leaves`:
        token-sized values buildable per shard with no equation here (constants, and those
        an outer jaxpr builds, as a scan's hoisted iotas), and whether each holds positions.
        `scrambled_in`: the arriving values in per-shard order, each with whether it holds
        local positions only (a scatter's `(batch, seq)` indices the forward saved for the
        backward). Returns the region, its scrambled values and, of those, the label-only
        ones and the running totals over a shard's tokens."""
        leaves = leaves or {}
        merges = {i for i, e in enumerate(eqns) if _merges_seq(e, self.specs, self.axes)}
        routing = {i for i, e in enumerate(eqns) if self._routing_seed(e, eqns, producer)}
        arriving = set(scrambled_in) | set(stacked_in)
        seeds = merges | routing
        seeds |= {c for v in arriving for c in consumers.get(v, ()) if sub_of(eqns[c]) is None}
        if not seeds:
            return set(), set(), set(), set()
        exits = {i for i, e in enumerate(eqns) if _splits_tokens(e, self.specs, self.axes)}
        region: set[int] = set(seeds)
        scrambled: set = set(scrambled_in)
        # With per-shard capacity: running totals over a shard's tokens (filled in as the
        # region grows; a capacity's value is one shard's, see the module docstring).
        counts: set = set()
        # Constants rebuilt per shard that are built from an iota hold local positions
        # (indices into the shard's block, which is what the region's ops address): they
        # may not leave it, so what reads them joins in turn (scatter's JVP compares such
        # ids outside the scatter). Uniform ones (zeros, full) are only rebuilt smaller.
        constant: set[int] = set()
        # the scrambled values that are labels in block form
        positional: set = {v for v, labels_only in scrambled_in.items() if labels_only}
        while True:
            self._grow(eqns, producer, consumers, region, scrambled, positional, stacked_in,
                       merges=merges, exits=exits, counts=counts)
            grown = set(region)
            pulled = _pull_in_constants(eqns, region, self.scaled, producer, leaves)
            if not pulled:
                break
            # What was pulled in because it computes on region values follows its inputs;
            # a leaf that holds positions is a label from here on (it may not leave).
            for i in sorted(pulled):
                ins = variables(eqns[i].invars)
                labels = {v for v in ins if leaves.get(v)}
                scrambled |= labels
                positional |= labels
                if all(producer.get(v) in constant or v in leaves
                       or (v not in self.scaled and producer.get(v) not in grown) for v in ins):
                    constant.add(i)
                    if eqns[i].primitive.name == "iota" or any(v in positional or leaves.get(v)
                                                                for v in ins):
                        outs = {v for v in eqns[i].outvars if v in self.scaled}
                        scrambled |= outs
                        positional |= outs
                else:
                    self._propagate(eqns[i], scrambled, positional, reordered=False)
        region = self._routed_only(eqns, region, producer, consumers, routing)
        for v in arriving:
            outside = [c for c in consumers.get(v, ()) if c not in region and sub_of(eqns[c]) is None]
            if outside:
                raise RewriteError(
                    f"a per-shard value ({v.aval.str_short()}) that a routed layer saved for later "
                    f"is read outside a routed region{_refusals.user_line(eqns[outside[0]])}; "
                    "wrap the layer in jax.checkpoint so its backward recomputes it")
        # Running totals may not leave the region either: outside they would be compared
        # with the capacity of all tokens.
        return region, scrambled | counts, positional, counts

    def _grow(self, eqns, producer, consumers, region, scrambled, positional, stacked_in, *,
              merges, exits, counts) -> None:
        """Grows `region`, `scrambled`, `positional` and `counts` in place to a fixpoint: an
        equation joins when it reads tokens in per-shard order, or reads a per-shard value
        (group sizes, offsets) and feeds back into the region, or, with per-shard capacity,
        reads a running total over a shard's tokens or a value with a dimension sized by
        the shard's capacity that the region made.

        `positional` values are in (batch, seq, ...) form but hold per-shard labels (local
        positions, ids scattered and gathered back); comparing two for equality gives the
        same answer under any relabeling, so its result is an ordinary value (the JVP of
        `x.at[i].set(u)` finds the winning update that way)."""
        changed = True
        while changed:
            changed = False
            reaches = _reaches(eqns, consumers, region)
            for i, e in enumerate(eqns):
                ins = variables(e.invars)
                if i not in region:
                    per_shard = any(v not in self.scaled and (producer.get(v) in region or v in stacked_in)
                                    for v in ins)
                    slots = any(v in self.capacity and (producer.get(v) in region or v in stacked_in)
                                for v in ins) and self.per_shard_capacity
                    if not (any(v in scrambled or v in counts for v in ins) or slots
                            or (per_shard and i in reaches)):
                        continue
                    region.add(i)
                    changed = True
                if self.per_shard_capacity and _count(e, counts, self.scaled, self.specs):
                    changed = True
                if i in exits:
                    continue
                if self._propagate(e, scrambled, positional, reordered=i in merges):
                    changed = True

    def _propagate(self, eqn, scrambled, positional, *, reordered: bool) -> bool:
        """Marks `eqn`'s token-carrying results scrambled (and positional when they hold
        labels only); True when something new was marked. `reordered`: the equation
        itself puts tokens in per-shard order (a flatten, a running total).

        A gather's or scatter's indices are addresses: local positions there place values
        in the shard's own block and leave no label in the result; indices in per-shard
        order do reorder it."""
        carried = [v for v in variables(eqn.invars) if v in scrambled
                   and not (v in positional and _is_address(eqn, v))]
        if not (reordered or carried):
            return False
        labels_only = not reordered and all(v in positional for v in carried)
        if labels_only and eqn.primitive.name in _RELABELING_INVARIANT:
            return False
        new = {v for v in eqn.outvars if v in self.scaled} - scrambled
        scrambled |= new
        if labels_only:
            positional |= new
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

    def _at_seed_line(self, eqn) -> bool:
        frame = _jax.user_frame(eqn)
        return frame is not None and (display_path(frame[0]), frame[1]) in self.seed_lines

    def _routed_only(self, eqns, region, producer, consumers, routing) -> set[int]:
        """The connected parts of the region that route tokens to experts: they hold a
        grouped matmul or an expert-batched dot, or a routing op whose result reaches an
        expert weight's matmul (the rest of the step, a backward included) or, from before
        the experts, what their outputs flow into, or a routing op on the same line as such
        a one (its transpose in the backward)."""
        experts = {i for i, e in enumerate(eqns) if reads_expert_weights(e, eqns, producer, self.scaled)}
        after_experts = _downstream(eqns, consumers, experts)
        routed_lines = set()
        for i in routing:
            ahead = _downstream(eqns, consumers, {i})
            # Into the experts (a sort before a grouped matmul), or, from before them, into
            # what combines their outputs (the weights of a dense dispatch, in a scanned
            # layer's forward body where no expert matmul follows).
            if ahead & experts or (i not in after_experts and ahead & after_experts):
                routed_lines.add(_jax.user_frame(eqns[i]))
        keep = {i for i in routing if _jax.user_frame(eqns[i]) in routed_lines}
        return _connected_parts(eqns, region, producer,
                                lambda i: i in keep or is_grouped_matmul_eqn(eqns[i])
                                or is_expert_batched_eqn(eqns[i], producer))


# Comparisons turn a running total into a decision (kept or dropped): an ordinary value.
_COMPARISONS = {"lt", "le", "gt", "ge", "eq", "ne"}


def _count(eqn, counts: set, scaled, specs) -> bool:
    """Marks `eqn`'s results that are running totals over a shard's tokens: those of a
    cumulative op over a token dimension, and those computed from one by anything but a
    comparison (a jitted helper, `jax.nn.one_hot` say, is looked into). True when
    something new was marked."""
    counted_in = [not _jax.is_literal(a) and a in counts for a in eqn.invars]
    new = {v for v, is_count in zip(eqn.outvars, _counts_out(eqn, counted_in, specs))
           if is_count and v in scaled} - counts
    counts |= new
    return bool(new)


def _counts_out(eqn, counted_in: list[bool], specs) -> list[bool]:
    name = eqn.primitive.name
    if _refusals.couples_tokens(eqn, specs):
        return [True] * len(eqn.outvars)
    if name in _COMPARISONS or not any(counted_in):
        return [False] * len(eqn.outvars)
    sub = sub_of(eqn) if name in ("jit", "pjit") else None
    if sub is None:
        return [True] * len(eqn.outvars)
    inner: set = {v for v, c in zip(sub.jaxpr.invars, counted_in) if c}
    for e in sub.jaxpr.eqns:
        inner |= {v for v, c in zip(e.outvars, _counts_out(e, [not _jax.is_literal(a) and a in inner
                                                                for a in e.invars], specs)) if c}
    return [not _jax.is_literal(v) and v in inner for v in sub.jaxpr.outvars]


def _merges_seq(eqn, specs, axes: TokenAxes) -> bool:
    """A reshape folding a sequence-sharded dim together with another into one dim."""
    if eqn.primitive.name != "reshape" or not eqn.invars or eqn.invars[0] not in specs:
        return False
    src = specs[eqn.invars[0]]
    shape_in, shape_out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    for ins, outs in reshape_groups(shape_in, shape_out):
        if len(ins) > 1 and len(outs) == 1 and any(
                set(axes.seq) & set(as_axes(src[d])) for d in ins if d < len(src)):
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
                set(axes.seq) & set(as_axes(out[d])) for d in outs if d < len(out)):
            return True
    return False


def variables(atoms):
    return [a for a in atoms if not _jax.is_literal(a)]


def consumers_of(eqns) -> dict:
    users: dict = {}
    for i, e in enumerate(eqns):
        for v in variables(e.invars):
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


# Random draws: drawn again at one shard's size, a shard would get another stream than its
# slice of the global draw (a dropout mask over (batch, seq, ...)).
_DRAWS = {"random_bits", "random_seed", "random_split", "random_fold_in", "threefry2x32",
          "rng_bit_generator", "rng_uniform"}


def _draws(eqn) -> bool:
    """A random draw, or a call that makes one (`jax.random.bernoulli` is a jitted helper)."""
    sub = sub_of(eqn)
    return eqn.primitive.name in _DRAWS or (sub is not None and any(_draws(e) for e in sub.jaxpr.eqns))


def _pull_in_constants(eqns, region, scaled, producer, leaves) -> set[int]:
    """Token-sized values built from nothing (iota, zeros, `arange(T) // K`, `leaves`)
    join the region with everything they are built from, so they are rebuilt at local
    size. A random draw is never drawn again: what is built from it joins, and the draw
    comes in as an input, each shard its slice. Returns the equations pulled in."""
    memo: dict[int, bool] = {}
    pulled: set[int] = set()

    def buildable(p: int) -> bool:
        if p not in memo:
            memo[p] = False  # cycles cannot occur in a jaxpr; this guards the recursion
            memo[p] = _draws(eqns[p]) or all(
                u not in scaled or producer.get(u) in region or u in leaves
                or (producer.get(u) is not None and buildable(producer[u]))
                for u in variables(eqns[p].invars))
        return memo[p]

    def pull(p: int) -> None:
        if p in region or _draws(eqns[p]):
            return
        region.add(p)
        pulled.add(p)
        for u in variables(eqns[p].invars):
            if u in scaled and producer.get(u) is not None:
                pull(producer[u])

    for i in sorted(region):
        for v in variables(eqns[i].invars):
            p = producer.get(v)
            if p is not None and p not in region and v in scaled and buildable(p):
                pull(p)
    return pulled


def _is_address(eqn, var) -> bool:
    """Whether `var` is the indices operand of a gather or scatter equation."""
    return (eqn.primitive.name.startswith(("gather", "scatter")) and len(eqn.invars) > 1
            and eqn.invars[1] is var)


def _routed_operands(eqn) -> list:
    """The operands a routing op moves or ranks. A gather or scatter routes tokens only
    when the array it reads from or writes into carries them: an embedding lookup (a
    table gathered at token ids) and its backward (a scatter-add into the table) do not.
    A jitted jnp helper (`take_along_axis`, `argsort`) takes that array first."""
    if eqn.primitive.name.startswith(("gather", "scatter", "jit", "pjit")):
        return list(eqn.invars[:1])
    return list(eqn.invars)


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
        for v in variables(eqns[i].invars):
            p = producer.get(v)
            if p in region:
                parent[find(i)] = find(p)
    routed = {find(i) for i in region if holds(i)}
    return {i for i in region if find(i) in routed}


def _downstream(eqns, consumers, starts: set[int]) -> set[int]:
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
