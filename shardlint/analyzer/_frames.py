"""Which of a stack's frames to show: the user's line, and the helper it went through.

MaxText wraps every sharding constraint in helpers, so the innermost frame of each is the
same helper line (`maxtext/utils/sharding.py:128`); the line that matters is the first
frame that is not such a helper. A frame is a helper when, across the analysis, it is
reached from more than one caller. Shown as `maxtext/layers/moe.py:3969 via
maxtext/utils/sharding.py:128`; one frame when the innermost is already the user's line.
The helpers are the innermost run of frames that are reached from several callers or
that only lead into such a frame (a private function of the shared helper).
"""

from __future__ import annotations

from ._model import Analysis, Source


def helper_frames(analysis: Analysis) -> frozenset[tuple[str, int]]:
    callers: dict[tuple[str, int], set[tuple[str, int]]] = {}
    stacks = [c.stack for c in analysis.collectives] + [f.stack for f in analysis.findings] \
        + [r.stack for r in analysis.requested] + [b.stack for b in analysis.memory.peak_buffers]
    for stack in stacks:
        for inner, outer in zip(stack, stack[1:]):
            callers.setdefault((inner.file, inner.line), set()).add((outer.file, outer.line))
    return frozenset(frame for frame, seen in callers.items() if len(seen) > 1)


def shown_frames(stack: tuple[Source, ...], helpers: frozenset, fallback: Source | None = None
                 ) -> tuple[Source, ...]:
    """(the user's line,) or (the user's line, the innermost helper frame)."""
    if not stack:
        return (fallback,) if fallback is not None else ()
    shared = [(f.file, f.line) in helpers for f in stack]
    last = -1
    for i in range(len(stack)):
        if shared[i]:
            last = i
        elif not (i + 1 < len(stack) and shared[i + 1]):
            break
    innermost = stack[0]
    mine = stack[last + 1] if last + 1 < len(stack) else innermost
    return (mine,) if mine == innermost else (mine, innermost)


def frames_text(stack: tuple[Source, ...], helpers: frozenset, fallback: Source | None = None) -> str:
    shown = shown_frames(stack, helpers, fallback)
    return " via ".join(f"{f.file}:{f.line}" for f in shown) if shown else "-"
