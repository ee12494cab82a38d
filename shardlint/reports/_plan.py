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
from .._format import human_bytes

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

    @property
    def verdict(self) -> str:
        return "fits" if self.fits else ("refused" if self.refused else "too big")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanPoint:
    """The step at one point: `values` are the grid's and the searched key's."""

    values: dict[str, Any]
    before: PlanSide | None = None
    after: PlanSide | None = None
    regions: int = 0             # routed regions (or swapped layers) the rewrite runs per shard
    note: str = ""               # the rewrite refused, nothing to rewrite
    error: str = ""              # the point could not be compiled, and why
    host_peak_bytes: int | None = None   # the compiling process's peak resident memory (None: not measured)

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

    def point_at(self, value: int | None) -> PlanPoint | None:
        """The point the search compiled at `value` of its key."""
        return next((t for t in self.tried if value is not None and t.values.get(self.key) == value), None)

    def at_longest(self) -> PlanPoint | None:
        """The point compiled at the longest value that fits after the fix."""
        at = self.point_at(self.after)
        return at if at is not None and at.after is not None and at.after.fits else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRow:
    grid: dict[str, Any]
    point: PlanPoint | None = None       # without --longest: the step at the grid point
    longest: Longest | None = None       # with --longest

    def _points(self) -> tuple[PlanPoint, ...]:
        return self.longest.tried if self.longest is not None else tuple(filter(None, [self.point]))

    def sides(self) -> tuple[PlanSide | None, PlanSide | None]:
        """The row's two sides as shown: the grid point's, or with a search each side at the
        longest value that fits it (at the search's first value where none does)."""
        if self.longest is None:
            return (self.point.before, self.point.after) if self.point else (None, None)
        first = min((t.values.get(self.longest.key) for t in self.longest.tried), default=None)
        before = self.longest.point_at(self.longest.before or first)
        after = self.longest.point_at(self.longest.after or first)
        return (before.before if before else None, after.after if after else None)

    @property
    def regions(self) -> int:
        return max((t.regions for t in self._points()), default=0)

    @property
    def note(self) -> str:
        """The first error or note of the row's points ("" where none)."""
        return next((t.error or t.note for t in self._points() if t.error or t.note), "")

    @property
    def ratio(self) -> str:
        """The longest value after the fix over the one before ("-" where either is unknown)."""
        found = self.longest
        return f"{found.after / found.before:.2f}" if found and found.before and found.after else "-"


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


def point_of(doc: dict) -> PlanPoint:
    """A point's record from its JSON (`dataclasses.asdict` of a PlanPoint)."""
    def side(d):
        return None if d is None else PlanSide(**d)

    return PlanPoint(**{**doc, "before": side(doc["before"]), "after": side(doc["after"])})


def read_plan_json(path: str) -> Plan:
    """A plan `write_plan_json` wrote (`shardlint.plan/1`), as its records again."""
    with open(path, encoding="utf-8") as fh:
        return plan_of(json.load(fh), path)


def plan_of(doc: dict, where: str = "the document") -> Plan:
    """The records of a plan's JSON document (`Plan.to_json`)."""
    from .._errors import UsageError

    if doc.get("schema") != PLAN_SCHEMA:
        raise UsageError(f"{where} is not a plan ({PLAN_SCHEMA}): its schema is {doc.get('schema')!r}")

    def point(d):
        return None if d is None else point_of(d)

    def longest(d):
        return None if d is None else Longest(**{**d, "tried": tuple(map(point, d["tried"]))})

    found, best = doc["longest"], doc["best"]
    return Plan(target=doc["target"], topology=doc["topology"], limit_bytes=doc["limit_bytes"],
                grid={k: tuple(v) for k, v in doc["grid"].items()},
                rows=tuple(PlanRow(grid=r["grid"], point=point(r["point"]), longest=longest(r["longest"]))
                           for r in doc["rows"]),
                longest_key=found and found["key"],
                longest_range=found and (found["lo"], found["hi"], found["step"]),
                best=best and best["row"], rule=best["rule"] if best else "")


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
    before, after = row.sides()
    return {"grid": row.grid, "best": plan.best == index, "ratio": row.ratio, "before": before,
            "after": after, "regions": row.regions, "note": row.note,
            "longest_before": row.longest.before if row.longest else None,
            "longest_after": row.longest.after if row.longest else None}


def format_plan(plan: Plan) -> str:
    """The plan as a table on stdout: one row per grid point, the best one marked."""
    keys = list(plan.grid)
    if plan.longest_key:
        head = keys + [f"longest {plan.longest_key} before", "after", "x", "regions", "note"]
    else:
        head = keys + ["before", "after", "collectives before", "after", "regions", "note"]
    lines = []
    for i, row in enumerate(plan.rows):
        cells = [str(row.grid[k]) for k in keys]
        if row.longest is not None:
            cells += [_or_dash(row.longest.before), _or_dash(row.longest.after), row.ratio]
        else:
            before, after = row.sides()
            cells += [_fit(before), _fit(after), _moved(before), _moved(after)]
        cells += [str(row.regions), row.note]
        cells[0] = ("* " if plan.best == i else "  ") + cells[0]
        lines.append(cells)
    head[0] = "  " + head[0]
    widths = [max(len(str(c)) for c in column) for column in zip(head, *[c[:-1] + [""] for c in lines])]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths)).rstrip()]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines]
    limit = human_bytes(plan.limit_bytes)
    where = f"{plan.topology} HBM per chip" if plan.topology and plan.limit_bytes else "--hbm-gib"
    out.append("")
    out.append(f"limit {limit} per device ({where}); * the best row: {plan.rule}" if plan.best is not None
               else f"limit {limit} per device ({where}); no row fits after the fix")
    return "\n".join(out)


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def _fit(side: PlanSide | None) -> str:
    return "-" if side is None else f"{side.verdict} {human_bytes(side.need_bytes)}"


def _moved(side: PlanSide | None) -> str:
    return "-" if side is None else human_bytes(side.moved_bytes)


def write_plan_html(plan: Plan, path: str) -> str:
    from .._errors import UsageError

    try:
        write_text(path, render_plan_html(plan))
    except OSError as e:
        raise UsageError(f"cannot write the plan to {path}: {e.strerror or e}") from e
    return path
