"""Which frames of an analysis are helpers: shared lines the user's code goes through.

MaxText wraps every sharding constraint in helpers, so the innermost frame of each is the
same helper line (`maxtext/utils/sharding.py:128`). A frame is a helper when, across the
analysis, it is reached from more than one caller. The helpers are the innermost run of
frames that are reached from several callers or that only lead into such a frame (a private
function of the shared helper); `shardlint/_source.py`'s `shown_frames` shows the user's
line past them.
"""

from __future__ import annotations

from .._model import Analysis


def helper_frames(analysis: Analysis) -> frozenset[tuple[str, int]]:
    callers: dict[tuple[str, int], set[tuple[str, int]]] = {}
    stacks = [c.stack for c in analysis.collectives] + [f.stack for f in analysis.findings] \
        + [r.stack for r in analysis.requested] + [b.stack for b in analysis.memory.peak_buffers]
    for stack in stacks:
        for inner, outer in zip(stack, stack[1:]):
            callers.setdefault((inner.file, inner.line), set()).add((outer.file, outer.line))
    return frozenset(frame for frame, seen in callers.items() if len(seen) > 1)
