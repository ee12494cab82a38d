"""The gate's sentences about one change, shared by every output format (text, JSON,
GitHub annotations, SARIF): what changed and how big, where, and which finding explains it."""

from __future__ import annotations

from .._format import human_bytes, relative_source
from .._vocab import ChangeState
from ._compare import Change


def _copies(n: int) -> str:
    return f"{n} cop{'y' if n == 1 else 'ies'}"


def headline(change: Change) -> str:
    """One sentence: what changed, how big, over which axes; no location."""
    what = change.kind + (f" over {','.join(change.axes)}" if change.axes else "")
    shape = f", {change.collectives[0].shape}" if change.collectives else ""
    now = f"{human_bytes(change.bytes)} per device"
    then = f"{human_bytes(change.baseline_bytes)} per device"
    if change.status == ChangeState.NEW:
        more = f", {_copies(change.count)}" if change.count > 1 else ""
        return f"new {what} ({now}{shape}{more}) that the baseline lacks"
    if change.status == ChangeState.GROWN:
        return (f"{what} grew to {_copies(change.count)}, {now}{shape} "
                f"(baseline: {_copies(change.baseline_count)}, {then})")
    if change.status == ChangeState.SHRUNK:
        return (f"{what} shrank to {_copies(change.count)}, {now}{shape} "
                f"(baseline: {_copies(change.baseline_count)}, {then})")
    return f"{what} is gone (baseline: {_copies(change.baseline_count)}, {then})"


def where(change: Change, root: str) -> str:
    lines = change.lines(root)
    function = f" ({change.function})" if change.function else ""
    if lines:
        return ", ".join(f"{f}:{n}" for f, n in lines) + function
    return change.file + function if change.file else "(no source location)"


def explanation(change: Change, root: str) -> list[str]:
    """The findings that explain the change: where, message and way out."""
    out = []
    for f in change.findings:
        at = f" ({relative_source(f.source.file, root)}:{f.source.line})" if f.source else ""
        out.append(f"why{at}: {f.message}")
        out.append(f"way out: {f.way_out}")
    return out
