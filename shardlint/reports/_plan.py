"""A plan: a step compiled at every point of a grid (mesh degrees, target options), as written
and as fixed, and for each point whether it fits a device's memory, and with `--longest`
the longest value of one option (a sequence length) that fits, before and after.

    {"schema": "shardlint.plan/1", "target": ..., "topology": ..., "limit_bytes": ...,
     "grid": {"ici_context_parallelism": [1, 2, 4, 8]}, "longest": null | {"key": ...,
     "lo": 4096, "hi": 262144, "step": 1024},
     "rows": [{"grid": {...}, "point": <point> | null, "longest": null | {"before": 8192,
               "after": 32768, "tried": [<point>, ...]}}, ...],
     "best": {"row": 2, "rule": "..."} | null}

A point is `PlanPoint`: the values it ran at, each side (`before`, `after`: `PlanSide`, or
null where not compiled), the routed regions the rewrite runs per shard, and a note (the
rewrite refused, nothing to rewrite, an error). The records are the JSON's fields one for
one (`docs/schemas.md`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .._files import write_text

PLAN_SCHEMA = "shardlint.plan/1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSide:
    """One step at one point as compiled: its memory per device against the limit, and the
    bytes its collectives move per device per step, by kind and mesh axes."""

    fits: bool
    need_bytes: int              # arguments + outputs + temp (or the compiler's peak, if larger)
    limit_bytes: int             # --hbm-gib, or the chip's HBM
    argument_bytes: int
    temp_bytes: int
    peak_bytes: int | None
    refused: bool                # the compiler refused it for lack of memory
    collective_bytes: dict[str, int]   # "all-gather over context" -> bytes per device per step

    @property
    def moved_bytes(self) -> int:
        return sum(self.collective_bytes.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanPoint:
    """The step at one point: `values` are the grid's and the searched key's."""

    values: dict[str, Any]
    before: PlanSide | None = None
    after: PlanSide | None = None
    regions: int = 0             # routed regions (or swapped layers) the rewrite runs per shard
    note: str = ""               # the rewrite refused, nothing to rewrite
    error: str = ""              # the point could not be compiled, and why

    def fits(self, side: str) -> bool | None:
        """Whether `side` ("before", "after") fits; None where it was not compiled."""
        found = getattr(self, side)
        return None if found is None else found.fits


@dataclasses.dataclass(frozen=True, kw_only=True)
class Longest:
    """The longest value of the searched key that fits, before and after the fix (None:
    not even the search's first value), and every point the search compiled."""

    key: str
    before: int | None
    after: int | None
    tried: tuple[PlanPoint, ...] = ()

    def at_longest(self) -> PlanPoint | None:
        """The point compiled at the longest value that fits after the fix."""
        return next((t for t in self.tried if self.after is not None and t.values.get(self.key) == self.after
                     and t.after is not None and t.after.fits), None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRow:
    grid: dict[str, Any]
    point: PlanPoint | None = None       # without --longest: the step at the grid point
    longest: Longest | None = None       # with --longest


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    target: str
    topology: str | None
    limit_bytes: int
    grid: dict[str, tuple]
    rows: tuple[PlanRow, ...]
    longest_key: str | None = None
    longest_range: tuple[int, int, int] | None = None   # lo, hi, step
    best: int | None = None              # index of the best row
    rule: str = ""                       # how the best row was chosen

    def to_json(self) -> dict:
        doc = dataclasses.asdict(self)
        lo_hi = doc.pop("longest_range")
        key = doc.pop("longest_key")
        best, rule = doc.pop("best"), doc.pop("rule")
        doc["grid"] = {k: list(v) for k, v in self.grid.items()}
        doc["longest"] = None if key is None else {"key": key, "lo": lo_hi[0], "hi": lo_hi[1], "step": lo_hi[2]}
        doc["best"] = None if best is None else {"row": best, "rule": rule}
        return {"schema": PLAN_SCHEMA, **doc}


def write_plan_json(plan: Plan, path: str) -> None:
    write_text(path, json.dumps(plan.to_json(), indent=1) + "\n")


def render_plan_html(plan: Plan) -> str:
    """The plan as one self-contained page: a table a person can scan (the best row marked)
    and, with a search over a grid, the longest value that fits against the first grid key."""
    from ._html import asset, environment
    from ._svg import longest_chart_svg

    rows = [_row_view(plan, i, row) for i, row in enumerate(plan.rows)]
    chart = ""
    if plan.longest_key and plan.grid:
        axis = next(iter(plan.grid))
        chart = longest_chart_svg(plan.longest_key, axis, {
            side: [(r["grid"][axis], r[f"longest_{side}"]) for r in rows
                   if isinstance(r["grid"][axis], (int, float))] for side in ("before", "after")})
    where = f"compiled for {plan.topology}" if plan.topology else "compiled on simulated CPU devices"
    return environment().get_template("plan.html").render(
        plan=plan, rows=rows, best=plan.best, chart=chart, where=where, css=asset("report.css"))


def _row_view(plan: Plan, index: int, row: PlanRow) -> dict:
    view = {"grid": row.grid, "best": plan.best == index, "longest_before": None, "longest_after": None,
            "ratio": "-", "before": None, "after": None, "regions": 0, "note": ""}
    if row.longest is not None:
        at = {side: next((t for t in row.longest.tried if t.values.get(row.longest.key) == value), None)
              for side, value in (("before", row.longest.before or _first(row.longest)),
                                  ("after", row.longest.after or _first(row.longest)))}
        view.update(longest_before=row.longest.before, longest_after=row.longest.after,
                    before=at["before"].before if at["before"] else None,
                    after=at["after"].after if at["after"] else None,
                    regions=max((t.regions for t in row.longest.tried), default=0),
                    note=next((t.error or t.note for t in row.longest.tried if t.error or t.note), ""))
        if row.longest.before and row.longest.after:
            view["ratio"] = f"{row.longest.after / row.longest.before:.2f}"
    elif row.point is not None:
        view.update(before=row.point.before, after=row.point.after, regions=row.point.regions,
                    note=row.point.error or row.point.note)
    return view


def _first(longest: Longest) -> int | None:
    return min((t.values.get(longest.key) for t in longest.tried), default=None)


def write_plan_html(plan: Plan, path: str) -> str:
    from .._errors import UsageError

    try:
        write_text(path, render_plan_html(plan))
    except OSError as e:
        raise UsageError(f"cannot write the plan to {path}: {e.strerror or e}") from e
    return path
