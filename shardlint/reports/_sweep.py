"""The sweep structure a report draws: one mesh axis at several sizes, before and after.

The sweep handed to `write_html` is a plain, documented structure::

    {"axis": "context",
     "points": [{"value": 1, "before": Analysis, "after": Analysis | None,
                 "refused": ""}, ...]}

Points are drawn in order of value; "after" is None when the report has no rewrite, or
where the rewrite was refused at that point: then "refused" (optional) says why. The runs
that produce it live in `shardlint.commands` (`run_sweep`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..analyzer import Analysis


def check_sweep(sweep: dict[str, Any]) -> dict[str, Any]:
    """Validates a sweep structure (see the module docstring); returns it sorted by value."""
    if not isinstance(sweep, dict) or "axis" not in sweep or "points" not in sweep:
        raise ValueError('sweep must be {"axis": name, "points": [{"value", "before", "after"}, ...]}')
    points = []
    for p in sweep["points"]:
        if not isinstance(p.get("before"), Analysis) or not isinstance(p.get("value"), int):
            raise ValueError(f"sweep point {p.get('value')!r}: needs an int value and a "
                             f"'before' Analysis")
        after, refused = p.get("after"), p.get("refused") or ""
        if after is not None and not isinstance(after, Analysis):
            raise ValueError(f"sweep point {p['value']}: 'after' must be an Analysis or None")
        if refused and after is not None:
            raise ValueError(f"sweep point {p['value']}: a refused rewrite has no 'after'")
        points.append({"value": p["value"], "before": p["before"], "after": after, "refused": str(refused)})
    return {"axis": str(sweep["axis"]), "points": sorted(points, key=lambda p: p["value"])}


def sweep_summary(sweep: dict[str, Any]) -> dict[str, Any]:
    """The sweep as embedded JSON: per point, the mesh, memory and all-gather totals.

    Whole analyses per point would multiply the page size by the number of points; the
    full before/after analyses are embedded once, beside this summary.
    """
    def side(a: Analysis | None):
        if a is None:
            return None
        ags = a.all_gathers()
        return {"mesh": a.mesh, "memory": dataclasses.asdict(a.memory), "findings": len(a.findings),
                "all_gathers": len(ags), "all_gather_bytes": sum(c.bytes for c in ags)}

    return {"axis": sweep["axis"],
            "points": [{"value": p["value"], "before": side(p["before"]), "after": side(p["after"]),
                        "refused": p["refused"] or None} for p in sweep["points"]]}
