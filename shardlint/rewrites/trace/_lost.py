"""What the analysis says to rewrite: where a routed layer loses the sequence sharding, read
from its findings into the tokens a rewrite shrinks per shard (their mesh axes and sizes)
and the source lines of the lossy ops.

A flatten of (batch, seq) before a grouped matmul says it first; where there is none, a
routing op (top_k, sort, cumsum, scatter, ...) whose operand has tokens sharded does: over
batch and sequence, or over the batch alone. A dispatch that sums the tokens into capacity
slots (`contracted-tokens`) says it too, and where one finding sees only some of the axes
that another sees, the wider one is taken.
"""

from __future__ import annotations

import dataclasses

import jax

from ..._errors import RewriteError
from ..._token_axes import TokenAxes, as_axes
from ..._vocab import ArgumentRole, Cause, FindingKind
from ..._ops import ROUTING_FINDING_OPS
from ._trace import Tokens


@dataclasses.dataclass(frozen=True)
class Lost:
    """What the analysis says to rewrite: the tokens at the lossy ops (their axes and sizes;
    None: nothing lost in routed code) and the (file, line) of every op where sharding was
    lost."""

    tokens: Tokens | None
    lines: frozenset

    @property
    def axes(self) -> TokenAxes | None:
        return self.tokens.axes if self.tokens else None




def lost_in(step, args, progress, analysis=None, params_argnums=None, given: TokenAxes | None = None) -> Lost:
    """Where `step` loses the sharding in routed code; `given` are the token axes the
    caller named (`batch_axes=`/`seq_axes=`), which choose among lossy ops that see the
    tokens sharded in different ways."""
    from ...analyzer import analyze

    if analysis is None:
        analysis = analyze(step, *args, params_argnums=params_argnums, progress=progress)
    lost = [f for f in analysis.findings if f.cause == Cause.LOST]
    lines = frozenset((s.file, s.line) for s in
                      [f.source for f in lost] + [c.source for c in analysis.collectives if c.cause == Cause.LOST]
                      if s is not None)
    # A flatten of (batch, seq) before the experts, with its batch or sequence sharded (a
    # lost reshape of other dimensions, attention's heads split off a score tensor, feeds
    # no grouped matmul).
    flattens = [(t, f) for f in lost if f.op == "reshape" and f.feeds_grouped_matmul and len(f.operand_spec) >= 2
                for t in [_tokens_of(f)] if t.axes.all]
    # A routing op on (batch, seq, ...): its first two dimensions' axes, the batch's alone
    # where only the batch is sharded. On flattened tokens (a flatten that kept them sharded:
    # the batch alone, or one batch row per device), the token dimension's axes, split into
    # batch and sequence as the argument the tokens come from has them.
    routing = [(t, f) for f in lost if f.op in ROUTING_FINDING_OPS and _on_routed_path(f)
               for t in [_tokens_of(f) if len(f.operand_spec) >= 3
                         else _flat_tokens(f, args, analysis) if f.feeds_grouped_matmul else None]
               if t is not None and t.axes.all]
    # A dispatch that sums tokens into capacity slots (`contracted-tokens`): its tokens'
    # operand, (batch, seq, ...).
    contracted = [(t, f) for f in lost if f.kind == FindingKind.CONTRACTED for t in [_tokens_of(f)] if t.axes.all]
    found = {t.axes: (dataclasses.replace(t, roles=analysis.argument_roles), f)
             for t, f in reversed((flattens or routing) + contracted)}   # the first finding's
    # A finding that sees some of the token axes (a flatten of tokens whose sequence was
    # gathered before it: the batch's axes alone) says less than one that sees them all.
    found = {axes: t for axes, t in found.items()
             if not any(set(axes.all) < set(other.all) for other in found)}
    if len(found) > 1 and given is not None:
        found = {axes: t for axes, t in found.items() if (axes.batch, axes.seq) == (given.batch, given.seq)}
        if not found:
            raise RewriteError(f"no lossy op sees the tokens as --batch-axes/--seq-axes name them "
                               f"({_described(given)}); name them as one of the ways above does")
    if len(found) > 1:
        ways = "; ".join(f"{_described(axes)} ({f.op} at {f.source or 'no source line'})"
                         for axes, (_, f) in found.items())
        advice = " or ".join(_flags(a) for a in found)
        raise RewriteError(f"the routed layers' lossy ops see the tokens sharded {len(found)} ways: {ways}. "
                           f"Name the one to rewrite: {advice} (the API's batch_axes=/seq_axes=)")
    return Lost(next(iter(found.values()))[0] if found else None, lines)


def _flags(axes: TokenAxes) -> str:
    """`--batch-axes data --seq-axes context`: the command line that names `axes`."""
    return " ".join(f"--{flag} {','.join(names)}" for flag, names in
                    (("batch-axes", axes.batch), ("seq-axes", axes.seq)) if names)


def _described(axes: TokenAxes) -> str:
    """`batch over data, sequence over context` (`... unsharded` for no axes)."""
    def over(names):
        return f"over {', '.join(names)}" if names else "unsharded"

    return f"batch {over(axes.batch)}, sequence {over(axes.seq)}"


def _on_routed_path(finding) -> bool:
    """A routing op is; a matmul only where it feeds the experts (a capacity dispatch
    einsum, a router matmul XLA names for top_k's gather), not attention's."""
    return finding.op != "dot_general" or finding.feeds_grouped_matmul


def _tokens_of(finding) -> Tokens:
    """The lost operand's batch and sequence: its first two dimensions' axes and sizes."""
    dims = finding.operand_dims
    return Tokens(TokenAxes(tuple(finding.operand_spec[0]), tuple(finding.operand_spec[1]), "analysis"),
                  dims[0] if len(dims) > 1 else None, dims[1] if len(dims) > 1 else None)


def _flat_tokens(finding, args, analysis) -> Tokens | None:
    """Tokens flattened with their sharding kept: the axes of the lost operand's token
    dimension, as the step's inputs shard their batch (first) and sequence (second)
    dimensions, with those dimensions' sizes; None where no input is sharded so."""
    if len(finding.operand_spec) != 2:
        return None
    lost = set(finding.operand_spec[0])
    leaves = jax.tree_util.tree_leaves(args)
    roles = analysis.argument_roles if len(analysis.argument_roles) == len(leaves) else ("",) * len(leaves)
    for x, _ in sorted(zip(leaves, roles), key=lambda pair: pair[1] != ArgumentRole.INPUT):
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        shape = getattr(x, "shape", ())
        if spec is None or len(shape) < 2:
            continue
        entries = [as_axes(e) for e in tuple(spec) + (None,) * len(shape)]
        batch = tuple(a for a in entries[0] if a in lost)
        seq = tuple(a for a in entries[1] if a in lost)
        if set(batch) | set(seq) == lost:
            return Tokens(TokenAxes(batch, seq, "analysis"), shape[0], shape[1])
    return None
