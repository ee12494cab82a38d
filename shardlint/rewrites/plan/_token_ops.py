"""What one equation does to the tokens of a routed region: folds the sequence into them or
unfolds it (`merges_seq`, `splits_tokens`), sums them into capacity slots (`sums_tokens`),
counts over them (`count`, running totals for
per-shard capacity), addresses them (`is_address`), and which token-sized values can be
rebuilt per shard from nothing (`pull_in_constants`; a random draw never is).

The region's growth (`_grow.Grower`) asks these per equation.
"""

from __future__ import annotations

from ..._token_axes import TokenAxes, as_axes
from ..._reshape import reshape_groups
from . import _refusals
from ...jaxpr import is_literal, sub_of, variables
from ..shard import folds_several


# Comparisons turn a running total into a decision (kept or dropped): an ordinary value.
_COMPARISONS = {"lt", "le", "gt", "ge", "eq", "ne"}


def count(eqn, counts: set, scaled, specs) -> bool:
    """Marks `eqn`'s results that are running totals over a shard's tokens: those of a
    cumulative op over a token dimension, and those computed from one by anything but a
    comparison (a jitted helper, `jax.nn.one_hot` say, is looked into). True when
    something new was marked."""
    counted_in = [not is_literal(a) and a in counts for a in eqn.invars]
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
        inner |= {v for v, c in zip(e.outvars, _counts_out(e, [not is_literal(a) and a in inner
                                                                for a in e.invars], specs)) if c}
    return [not is_literal(v) and v in inner for v in sub.jaxpr.outvars]


def merges_seq(eqn, specs, axes: TokenAxes) -> bool:
    """A reshape folding a sequence-sharded dim (batch-sharded, where only the batch is)
    together with another into one dim (dims of size 1 fold nothing: attention's
    `[b, kv_heads, 1, seq, d]` to `[b, kv_heads, seq, d]` keeps every token in place)."""
    if eqn.primitive.name != "reshape" or not eqn.invars or eqn.invars[0] not in specs:
        return False
    src = specs[eqn.invars[0]]
    shape_in, shape_out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    for ins, outs in reshape_groups(shape_in, shape_out):
        if folds_several([shape_in[d] for d in ins]) and len(outs) == 1 and any(
                set(axes.minor) & set(as_axes(src[d])) for d in ins if d < len(src)):
            return True
    return False


def sums_tokens(eqn, specs, scaled, axes: TokenAxes) -> bool:
    """A `dot_general` that contracts a dimension of tokens sharded over the sequence's axes
    against another value that carries tokens (`scaled`): a capacity dispatch
    `BSM,BSEC -> EBCM`, or the combine's transpose in the backward."""
    if eqn.primitive.name != "dot_general":
        return False
    operands = variables(eqn.invars)
    if len(operands) != 2 or not all(v in scaled for v in operands):
        return False
    for var, dims in zip(eqn.invars, eqn.params["dimension_numbers"][0]):
        spec = tuple(specs.get(var, ()))
        if any(set(as_axes(spec[d])) & set(axes.seq) for d in dims if d < len(spec)):
            return True
    return False


def splits_tokens(eqn, specs, axes: TokenAxes) -> bool:
    """A reshape unfolding tokens back into separate (batch, seq) dims (back into a batch
    dim, where only the batch is sharded); not one that only adds dims of size 1."""
    if eqn.primitive.name != "reshape" or eqn.outvars[0] not in specs:
        return False
    out = specs[eqn.outvars[0]]
    shape_in, shape_out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    for ins, outs in reshape_groups(shape_in, shape_out):
        if len(ins) == 1 and folds_several([shape_out[d] for d in outs]) and any(
                set(axes.minor) & set(as_axes(out[d])) for d in outs if d < len(out)):
            return True
    return False


# Random draws: drawn again at one shard's size, a shard would get another stream than its
# slice of the global draw (a dropout mask over (batch, seq, ...)).
_DRAWS = {"random_bits", "random_seed", "random_split", "random_fold_in", "threefry2x32",
          "rng_bit_generator", "rng_uniform"}


def _draws(eqn) -> bool:
    """A random draw, or a call that makes one (`jax.random.bernoulli` is a jitted helper)."""
    sub = sub_of(eqn)
    return eqn.primitive.name in _DRAWS or (sub is not None and any(_draws(e) for e in sub.jaxpr.eqns))


def pull_in_constants(eqns, region, scaled, producer, leaves) -> set[int]:
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


def is_address(eqn, var) -> bool:
    """Whether `var` is the indices operand of a gather or scatter equation."""
    return (eqn.primitive.name.startswith(("gather", "scatter")) and len(eqn.invars) > 1
            and eqn.invars[1] is var)
