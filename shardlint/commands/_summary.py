"""The few lines `demo` and `report` print on stdout when they are done: findings,
all-gathers and temp memory before -> after the rewrite, each sweep point's temp, the
findings the rewrite fixed, and the files written. Where there is no rewritten step (not
asked for, refused, nothing to rewrite) the figures are the step's alone and one line
says why."""

from __future__ import annotations

from typing import Any

from .._format import human_bytes
from ..analyzer import Analysis
from ._sweep import Pair


def summary(header: str, pair: Pair, sweep: dict[str, Any] | None,
            files: list[tuple[str, str]]) -> str:
    """`header` first; `files` are (label, what) lines last (`report: /abs/report.html`)."""
    before, after = pair.before, pair.after

    def figure(of) -> str:
        return of(before) if after is None else f"{of(before)} -> {of(after)}"

    lines = [header,
             f"  findings:        {figure(lambda a: len(a.findings))}",
             f"  all-gathers:     {figure(_gathers)}",
             f"  temp memory:     {figure(lambda a: human_bytes(a.memory.temp_bytes))} per device"]
    if pair.refused:
        lines.append(f"  rewrite refused: {pair.refused}")
    elif pair.unchanged:
        lines.append(f"  nothing to rewrite: {pair.unchanged}")
    if sweep is not None:
        rewritten = any(p["after"] is not None or p.get("refused") for p in sweep["points"])
        lines.append(f"  {sweep['axis']} sweep (temp memory per device"
                     f"{', before -> after' if rewritten else ''}):")
        for point in sweep["points"]:
            temp = human_bytes(point["before"].memory.temp_bytes)
            if point.get("refused"):
                temp += " -> rewrite refused"
            elif point["after"] is not None:
                temp += f" -> {human_bytes(point['after'].memory.temp_bytes)}"
            lines.append(f"    {sweep['axis']}={point['value']}: {temp}")
    if after is not None:
        lines += [f"  fixed: {line}" for line in _places(before, exclude=after)]
        lines += [f"  left: {line}" for line in _places(after)]
    lines += [f"  {label}: {what}" for label, what in files]
    return "\n".join(lines)


def _gathers(analysis: Analysis) -> str:
    ags = analysis.all_gathers()
    return f"{len(ags)} ({human_bytes(sum(c.bytes for c in ags))}/device)"


def _places(analysis: Analysis, exclude: Analysis | None = None) -> list[str]:
    """One line per place that loses sharding (each layer repeats it: `(x2)`), in the
    order found; places that `exclude` also has are left out."""
    kept = {_place(f) for f in exclude.findings} if exclude is not None else set()
    counts: dict[str, int] = {}
    for f in analysis.findings:
        key = _place(f)
        if key not in kept:
            counts[key] = counts.get(key, 0) + 1
    return [key + (f" (x{count})" if count > 1 else "") for key, count in counts.items()]


def _place(finding) -> str:
    where = str(finding.source) if finding.source else "?"   # already relative to the user
    lost = f" lost {', '.join(finding.axes)}" if finding.axes else ""   # none named: no "lost" with nothing after
    return f"{finding.op} at {where}{lost}"
