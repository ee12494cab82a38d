"""The self-contained HTML report: headline, findings, collectives and their diff, sweep.

One file that opens from `file://` with no network: the CSS and JavaScript next to the
template are inlined, drawings are inline SVG (`_svg`), and a Content-Security-Policy
meta forbids anything from elsewhere. The Jinja environment autoescapes, and the few
trusted pieces (our own CSS/JS, SVG built with `markupsafe.escape`, the embedded JSON
with `<` escaped) are the only `Markup` that reaches the page.

The collective table groups collectives by `shardlint.gate.collective_key` — the key the
CI gate uses — so a step that repeats a layer a thousand times shows one row per distinct
collective with its count, and the before/after diff (new, gone, changed) is a join on
that key. Every figure the page shows carries a `data-*` attribute equal to the number it
was formatted from, so tests (and scrapers) read exact values.
"""

from __future__ import annotations

import functools
import hashlib
import json
import linecache
import os
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from .._errors import UsageError
from .._files import write_text
from .._format import human_bytes, source_text
from ..analyzer import Analysis, Collective, Finding, Source, helper_frames, peak_lines, scope_tree
from .._op_paths import normalize_op_path
from .._source import located, shown_frames
from ..gate import CollectiveKey, collective_key
from ._svg import memory_chart_svg, neighbourhood_svg
from ._text import verb_phrase
from ._data import sweep_scalings
from ._sweep import check_sweep, sweep_summary

REPORT_SCHEMA = "shardlint.report/1"
_TEMPLATES = Path(__file__).with_name("templates")
_SNIPPET_RADIUS = 3
_STATUS_ORDER = {"new": 0, "changed": 1, "gone": 2, "same": 3, "": 4}


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["bytes"] = human_bytes
    return env


def asset(name: str) -> Markup:
    """Our own CSS/JS, inlined verbatim (trusted: it ships in the package)."""
    return Markup((_TEMPLATES / name).read_text(encoding="utf-8"))


def script_json(doc: Any) -> Markup:
    """JSON safe inside <script>: `<`, `>` and `&` become \\u escapes, still valid JSON."""
    text = json.dumps(doc, separators=(",", ":"), sort_keys=False)
    return Markup(text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e"))


def anchor(key: str) -> str:
    return "c-" + hashlib.sha1(key.encode()).hexdigest()[:12]


# ------------------------------------------------------------------ headline figures

def _delta(before: float | None, after: float | None) -> tuple[str, str]:
    """(text, css class) for the change from before to after; lower is better here."""
    if before is None or after is None:
        return "", ""
    if after == before:
        return "no change", "same"
    cls = "better" if after < before else "worse"
    if before:
        pct = (after - before) / before * 100
        return (f"{pct:+.1f}%" if abs(pct) < 1 else f"{pct:+.0f}%"), cls
    return "new", cls


def _figure(name: str, label: str, before: float | None, after: float | None,
            as_bytes: bool, has_after: bool) -> dict[str, Any]:
    fmt = human_bytes if as_bytes else (lambda v: "-" if v is None else f"{v:,}")
    text, cls = _delta(before, after) if has_after else ("", "")
    return {"name": name, "label": label, "before": before, "after": after,
            "before_text": fmt(before), "after_text": fmt(after) if has_after else "",
            "delta": text, "delta_class": cls}


def headline(before: Analysis, after: Analysis | None) -> list[dict[str, Any]]:
    def stats(a: Analysis | None):
        if a is None:
            return dict.fromkeys(("ag", "ag_bytes", "temp", "peak", "findings", "coll", "coll_bytes"))
        ags = a.all_gathers()
        return {"ag": len(ags), "ag_bytes": sum(c.bytes for c in ags), "temp": a.memory.temp_bytes,
                "peak": a.memory.peak_bytes, "findings": len(a.findings),
                "coll": len(a.collectives), "coll_bytes": sum(c.bytes for c in a.collectives)}

    b, a, has = stats(before), stats(after), after is not None
    figures = [
        _figure("all-gathers", "all-gathers", b["ag"], a["ag"], False, has),
        _figure("all-gather-bytes", "all-gathered per device", b["ag_bytes"], a["ag_bytes"], True, has),
        _figure("temp-bytes", "temp memory per device", b["temp"], a["temp"], True, has),
        _figure("findings", "findings", b["findings"], a["findings"], False, has),
        _figure("collectives", "collectives (all kinds)", b["coll"], a["coll"], False, has),
    ]
    if b["peak"] is not None or a["peak"] is not None:   # the platform computes a peak (TPU)
        figures.insert(2, _figure("peak-bytes", "peak memory per device", b["peak"], a["peak"], True, has))
    return figures


def verdict(before: Analysis, after: Analysis | None) -> str:
    """One sentence a reviewer reads first."""
    ags = before.all_gathers()
    if after is None:
        if not before.findings:
            return (f"No sharding is lost. {len(ags)} all-gather(s), "
                    f"{human_bytes(sum(c.bytes for c in ags))} per device.")
        return (f"{len(before.findings)} op(s) lose sharding; {len(ags)} all-gather(s) move "
                f"{human_bytes(sum(c.bytes for c in ags))} per device.")
    ags_after = after.all_gathers()
    gone = len(ags) - len(ags_after)
    temp_b, temp_a = before.memory.temp_bytes, after.memory.temp_bytes
    parts = [f"The rewrite {'removes' if gone >= 0 else 'adds'} {abs(gone)} all-gather(s) "
             f"({human_bytes(sum(c.bytes for c in ags))} → "
             f"{human_bytes(sum(c.bytes for c in ags_after))} per device)",
             f"findings {len(before.findings)} → {len(after.findings)}",
             f"temp memory {human_bytes(temp_b)} → {human_bytes(temp_a)}"
             + (f" ({(temp_a - temp_b) / temp_b * 100:+.0f}%)" if temp_b else "")]
    return "; ".join(parts) + "."


def memory_rows(before: Analysis, after: Analysis | None) -> list[dict[str, Any]]:
    rows = []
    for field in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "peak_bytes", "flops"):
        b = getattr(before.memory, field)
        a = getattr(after.memory, field) if after else None
        as_bytes = field != "flops"
        fmt = human_bytes if as_bytes else (lambda v: "-" if v is None else f"{v:.3g}")
        text, cls = _delta(b, a) if after else ("", "")
        rows.append({"name": field, "label": field.replace("_bytes", "").replace("flops", "FLOPs"),
                     "before": b, "after": a, "before_text": fmt(b), "after_text": fmt(a) if after else "",
                     "delta": text, "delta_class": cls, "note": _MEMORY_NOTES.get(field, "")})
    return rows


# What each memory figure is, as XLA's memory and cost analyses give it.
_MEMORY_NOTES = {
    "argument_bytes": "inputs held by one device",
    "output_bytes": "outputs held by one device",
    "temp_bytes": "buffers XLA allocates for one step on one device",
    "alias_bytes": "outputs that reuse a donated input's buffer",
    "peak_bytes": "XLA's peak per device where the platform computes one (TPU); XLA:CPU does "
                  "not (its figure is below temp): there arguments + outputs + temp is the budget",
    "flops": "XLA's cost analysis per device: a gathered activation is computed whole on every "
             "device, so keeping it sharded cuts FLOPs too; XLA:CPU counts ragged_dot as a dense "
             "dot over every expert",
}


# ------------------------------------------------------------ collectives and their diff

def _frames(record, helpers, root: str) -> str:
    shown = shown_frames(record.stack, helpers, record.source)
    return " via ".join(source_text(f, root) for f in shown)


def collective_rows(before: Analysis, after: Analysis | None, root: str) -> list[dict[str, Any]]:
    """One row per collective key: counts and bytes (per step) before and after, and its status."""
    groups: dict[str, dict[str, Any]] = {}
    for side, analysis in (("b", before), ("a", after)):
        helpers = helper_frames(analysis) if analysis else frozenset()
        for c in analysis.collectives if analysis else ():
            parts = CollectiveKey.of(c, root)
            key = str(parts)
            row = groups.get(key)
            if row is None:
                row = groups[key] = {
                    "key": key, "anchor": anchor(key), "kind": parts.kind, "axes": ",".join(parts.axes) or "-",
                    "shape": parts.shape, "shape_text": shape_text(parts.shape), "op_path": c.op_path, "path": normalize_op_path(c.op_path) or c.op_path,
                    "where": _frames(c, helpers, root), "cause": c.cause or "-",
                    "function": c.source.function if c.source else "", "async": False, "loop": False,
                    "b_count": 0, "b_bytes": 0, "a_count": 0, "a_bytes": 0, "ids": []}
            row[f"{side}_count"] += 1
            row[f"{side}_bytes"] += c.step_bytes
            row["async"] |= c.is_async
            row["loop"] |= c.in_loop
            if len(row["ids"]) < 4:
                row["ids"].append(c.id)
    for row in groups.values():
        if after is None:
            row["status"] = ""
        elif not row["a_count"]:
            row["status"] = "gone"
        elif not row["b_count"]:
            row["status"] = "new"
        elif (row["a_count"], row["a_bytes"]) != (row["b_count"], row["b_bytes"]):
            row["status"] = "changed"
        else:
            row["status"] = "same"
        row["count_v"] = max(row["b_count"], row["a_count"])
        row["bytes_v"] = max(row["b_bytes"], row["a_bytes"])
    return sorted(groups.values(), key=lambda r: (_STATUS_ORDER[r["status"]], -r["bytes_v"], r["key"]))


def shape_text(shape: str, keep: int = 2) -> str:
    """A merged collective's tuple shape, short: its first arrays and how many there are
    (the whole shape stays in the cell's title)."""
    parts = shape.split(", ")
    if len(parts) <= keep + 1:
        return shape
    return f"{', '.join(parts[:keep])}, … ({len(parts)} arrays)"


def diff_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out = {s: {"rows": 0, "bytes": 0} for s in ("new", "gone", "changed", "same")}
    for r in rows:
        if r["status"]:
            out[r["status"]]["rows"] += 1
            out[r["status"]]["bytes"] += r["a_bytes"] - r["b_bytes"]
    return out


# -------------------------------------------------------------------------- findings

def snippet(source: Source | None, radius: int = _SNIPPET_RADIUS) -> list[dict[str, Any]] | None:
    """The lines around file:line, read from disk (the user's file, or an installed
    library's, `located`); None when the file is not here."""
    path = located(source.file) if source is not None and source.file else None
    if path is None:
        return None
    linecache.checkcache(path)
    lines = linecache.getlines(path)
    if not 1 <= source.line <= len(lines):
        return None
    lo, hi = max(1, source.line - radius), min(len(lines), source.line + radius)
    return [{"n": n, "text": lines[n - 1].rstrip("\n"), "focus": n == source.line} for n in range(lo, hi + 1)]


def finding_view(f: Finding, index: int, analysis: Analysis, root: str) -> dict[str, Any]:
    by_id: dict[str, Collective] = {c.id: c for c in analysis.collectives if c.id in f.collectives}
    causes = []
    for cid in f.collectives:
        c = by_id.get(cid)
        causes.append({"id": cid, "anchor": anchor(collective_key(c, root)) if c else "",
                       "kind": c.kind if c else "", "axes": ",".join(c.axes) if c else "",
                       "shape": c.shape if c else "", "bytes": c.bytes if c else None})
    return {"index": index, "f": f, "verb": verb_phrase(f, analysis),
            "where": _frames(f, helper_frames(analysis), root),
            "file": f.source.file if f.source else "", "snippet": snippet(f.source),
            "causes": causes, "graph": neighbourhood_svg(f.neighbourhood, f.axes)}


# ---------------------------------------------------------------------------- sweep

def sweep_view(sweep: dict[str, Any]) -> dict[str, Any]:
    """The sweep section: each point's temp against its ideal (the first point's scaled as
    the activations per device, `analyzer._scaling`), and the lines that hold the rest."""
    points = sweep["points"]
    scaling_before, scaling_after = sweep_scalings(sweep)
    series = {"before": [(p["value"], p["before"].memory.temp_bytes) for p in points]}
    ideals = {"before": list(zip(scaling_before.values, scaling_before.ideal))}
    if any(p["after"] is not None or p["refused"] for p in points):
        series["after"] = [(p["value"], p["after"].memory.temp_bytes if p["after"] else None)
                           for p in points]
        if scaling_after is not None:
            ideals["after"] = list(zip(scaling_after.values, scaling_after.ideal))
    ideal = {name: dict(pts) for name, pts in ideals.items()}
    rows = [{"value": p["value"], "mesh": p["before"].mesh, "before": p["before"], "after": p["after"],
             "refused": p["refused"], "ideal_before": ideal["before"].get(p["value"]),
             "ideal_after": ideal.get("after", {}).get(p["value"])} for p in points]
    has_peak = any(a is not None and a.memory.peak_bytes is not None
                   for p in points for a in (p["before"], p["after"]))
    return {"axis": sweep["axis"], "chart": memory_chart_svg(sweep["axis"], series, ideals=ideals),
            "rows": rows, "has_after": "after" in series, "has_peak": has_peak,
            "scalings": [(label, s, s.lines[:max(s.listed, 3)]) for label, s in
                         (("before the rewrite", scaling_before), ("after the rewrite", scaling_after))
                         if s is not None]}


def peak_view(analysis: Analysis | None, most: int = 12) -> list[Any]:
    """The temp at the peak by the lines that made it, largest first."""
    if analysis is None:
        return []
    return list(peak_lines(analysis.memory.peak_buffers, helpers=helper_frames(analysis))[:most])


# ------------------------------------------------------------------------------ page

def render_html(before: Analysis, after: Analysis | None = None, *, sweep: dict[str, Any] | None = None,
                title: str = "", root: str | None = None, rewrite_note: str = "") -> str:
    """The report as one HTML string. `root` makes source paths relative (default: cwd)."""
    root = root or os.getcwd()
    sweep = check_sweep(sweep) if sweep is not None else None
    rows = collective_rows(before, after, root)
    doc = {"schema": REPORT_SCHEMA, "title": title, "before": before.to_json(),
           "after": after.to_json() if after else None,
           "sweep": sweep_summary(sweep) if sweep else None}
    figures = headline(before, after)
    return environment().get_template("report.html").render(
        title=title, before=before, after=after, headline=figures, rewrite_note=rewrite_note,
        figures={h["name"]: h for h in figures},
        scopes=scope_tree(before), after_scopes=scope_tree(after) if after else None,
        verdict=verdict(before, after), memory=memory_rows(before, after),
        peaks=[(label, a, peak_view(a)) for label, a in (("before", before), ("after", after)) if a is not None],
        refusals=[(label, a.does_not_fit) for label, a in (("before", before), ("after", after))
                  if a is not None and a.does_not_fit is not None],
        findings=[finding_view(f, i, before, root) for i, f in enumerate(before.findings, 1)],
        after_findings=[finding_view(f, i, after, root) for i, f in enumerate(after.findings, 1)]
        if after else [],
        requested=before.requested,
        rows=rows, kinds=sorted({r["kind"] for r in rows}), diff=diff_summary(rows),
        sweep=sweep_view(sweep) if sweep and sweep["points"] else None,
        where=lambda s: source_text(s, root) if s else "", data=script_json(doc),
        css=asset("report.css"), js=asset("report.js"))


def write_html(before: Analysis, after: Analysis | None = None, path: str = "shardlint-report.html",
               sweep: dict[str, Any] | None = None, *, title: str = "", root: str | None = None,
               rewrite_note: str = "") -> str:
    """Writes the report to `path` and returns the path.

    `after` is the analysis of the rewritten step (None: a single-analysis report);
    `sweep` is {"axis": name, "points": [{"value": int, "before": Analysis,
    "after": Analysis | None}, ...]} (see `shardlint.reports._sweep`); `rewrite_note`
    says why there is no after side (the rewrite was refused, or changed nothing).
    """
    text = render_html(before, after, sweep=sweep, title=title, root=root, rewrite_note=rewrite_note)
    try:
        write_text(path, text)
    except OSError as e:
        raise UsageError(f"cannot write the report to {path}: {e.strerror or e}") from e
    return path
