"""The report's data as one JSON document (`report --json`, `analyze --sweep --json`).

    {"schema": "shardlint.report-data/1",
     "before": <shardlint.analysis/3>, "after": <shardlint.analysis/3> | null,
     "sweep": null | {
        "key": "ici_context_parallelism", "values": [1, 2, 4, 8],
        "points": [{"value": 1, "before": <memory>, "after": <memory> | null,
                    "refused": null | "<why the rewrite was refused at this point>"}, ...],
        "before": <scaling>, "after": <scaling> | null}}

A point's memory is `Analysis.memory` (`temp_bytes`, `peak_buffers`, ...). A scaling is
`analyzer._scaling.MemoryScaling` of that side: `temp` and `ideal` per point, `lines` (each
line's `source` (or XLA's `name` for it where it has none), `op`, `role`, `bytes` per point,
`scaling` and `excess` at the last point, largest excess first), `listed` (how many of them
the headline names), their share of the last point's temp above its ideal
(`above_ideal_explained`) and the `headline`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .._files import write_text
from ..analyzer import Analysis, MemoryScaling, memory_scaling
from ._sweep import check_sweep

REPORT_DATA_SCHEMA = "shardlint.report-data/1"


def sweep_scalings(sweep: dict[str, Any]) -> tuple[MemoryScaling, MemoryScaling | None]:
    """The memory scaling of the step before the rewrite, and after it where every point
    has a rewritten step."""
    values = tuple(p["value"] for p in sweep["points"])
    before = memory_scaling(sweep["axis"], values, [p["before"] for p in sweep["points"]])
    afters = [p["after"] for p in sweep["points"]]
    after = memory_scaling(sweep["axis"], values, afters) if all(a is not None for a in afters) else None
    return before, after


def report_data(before: Analysis, after: Analysis | None, sweep: dict[str, Any] | None = None) -> dict:
    doc: dict[str, Any] = {"schema": REPORT_DATA_SCHEMA, "before": before.to_json(),
                           "after": after.to_json() if after is not None else None, "sweep": None}
    if sweep is not None:
        sweep = check_sweep(sweep)
        scaling_before, scaling_after = sweep_scalings(sweep)
        doc["sweep"] = {
            "key": sweep["axis"], "values": [p["value"] for p in sweep["points"]],
            "points": [{"value": p["value"], "before": dataclasses.asdict(p["before"].memory),
                        "after": dataclasses.asdict(p["after"].memory) if p["after"] is not None else None,
                        "refused": p["refused"] or None}
                       for p in sweep["points"]],
            "before": _scaling(scaling_before), "after": _scaling(scaling_after)}
    return doc


def _scaling(scaling: MemoryScaling | None) -> dict | None:
    if scaling is None:
        return None
    return {**dataclasses.asdict(scaling), "headline": scaling.headline()}


def write_report_data(path: str, before: Analysis, after: Analysis | None,
                      sweep: dict[str, Any] | None = None) -> None:
    write_text(path, json.dumps(report_data(before, after, sweep), indent=1) + "\n")
