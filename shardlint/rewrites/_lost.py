"""What the analysis says to rewrite: where a routed layer loses the sequence sharding, read
from its findings into the tokens a rewrite shrinks per shard (their mesh axes and sizes)
and the source lines of the lossy ops.

A flatten of (batch, seq) before a grouped matmul says it first; where there is none, a
routing op (top_k, sort, cumsum, scatter, ...) whose operand has the sequence sharded does.
"""

from __future__ import annotations

import dataclasses

from .._errors import RewriteError
from .._token_axes import TokenAxes
from .._vocab import Cause
from ..internal import ROUTING_FINDING_OPS
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




def lost_in(step, args, progress, analysis=None, params_argnums=None) -> Lost:
    from ..analyzer import analyze

    if analysis is None:
        analysis = analyze(step, *args, params_argnums=params_argnums, progress=progress)
    lost = [f for f in analysis.findings if f.cause == Cause.LOST]
    lines = frozenset((s.file, s.line) for s in
                      [f.source for f in lost] + [c.source for c in analysis.collectives if c.cause == Cause.LOST]
                      if s is not None)
    # A flatten of (batch, seq) has the sequence sharded in its second dimension; a lost
    # reshape without that (attention's heads split off a score tensor) is no flatten.
    flattens = [t for f in lost if f.op == "reshape" and f.feeds_grouped_matmul and len(f.operand_spec) >= 2
                for t in [_tokens_of(f)] if t.axes.seq]
    routing = [t for f in lost if f.op in ROUTING_FINDING_OPS and len(f.operand_spec) >= 3
               for t in [_tokens_of(f)] if t.axes.seq]
    found = {t.axes: dataclasses.replace(t, roles=analysis.argument_roles)
             for t in reversed(flattens or routing)}   # the first finding's sizes
    if len(found) > 1:
        raise RewriteError(f"the lossy ops are sharded differently "
                           f"({sorted((a.batch, a.seq) for a in found)}); pass batch_axes= and "
                           "seq_axes= to choose")
    return Lost(next(iter(found.values())) if found else None, lines)


def _tokens_of(finding) -> Tokens:
    """The lost operand's batch and sequence: its first two dimensions' axes and sizes."""
    dims = finding.operand_dims
    return Tokens(TokenAxes(tuple(finding.operand_spec[0]), tuple(finding.operand_spec[1]), "analysis"),
                  dims[0] if len(dims) > 1 else None, dims[1] if len(dims) > 1 else None)
