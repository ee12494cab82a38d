"""The gate's verdict as text, JSON or GitHub workflow commands (SARIF lives in _sarif,
the sentences both use in _wording).

Every format says the same things: each new or grown collective with file:line, bytes per
device and the finding that explains it, then the improvements, then how to accept the
current collectives. The text form is also the pytest assertion message.
"""

from __future__ import annotations

import dataclasses
import json

from ._compare import Change, CheckResult, mesh_text
from ._sarif import sarif_json
from ._wording import explanation, headline, where

CHECK_SCHEMA = "shardlint.check/1"
FORMATS = ("text", "json", "github", "sarif")


def render(result: CheckResult, fmt: str) -> str:
    if fmt == "text":
        return format_text(result)
    if fmt == "json":
        return json.dumps(check_json(result), indent=2, ensure_ascii=False)
    if fmt == "github":
        return format_github(result)
    if fmt == "sarif":
        return json.dumps(sarif_json(result), indent=2, ensure_ascii=False)
    raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")


def format_text(result: CheckResult) -> str:
    watched = ", ".join(result.kinds)
    tolerance = f"{result.tolerance * 100:g}%"
    verdict = "passed" if result.passed else "FAILED"
    lines = [f"shardlint check: {verdict} against {result.baseline_path or 'the baseline'} "
             f"(watching {watched}; byte tolerance {tolerance}; mesh {mesh_text(result.mesh)})"]
    lines += [f"  note: {n}" for n in result.notes()]
    if result.regressions:
        lines.append("")
        lines.append(f"{len(result.regressions)} regression(s):")
        for c in result.regressions:
            lines.append(f"  {c.status.upper():5} {where(c, result.root)}: {headline(c)}")
            lines.append(f"        key: {c.key}")
            lines += [f"        {line}" for line in explanation(c, result.root)]
    if result.improvements:
        lines.append("")
        lines.append(f"{len(result.improvements)} improvement(s) (these do not fail):")
        for c in result.improvements:
            lines.append(f"  {c.status.upper():5} {where(c, result.root)}: {headline(c)}")
            lines.append(f"        key: {c.key}")
    lines.append("")
    if not result.changes:
        lines.append(f"no change in {watched} collectives")
    if result.update_hint and result.changes:
        what = "accept these collectives" if result.regressions else "record the improvements"
        lines.append(f"to {what}: {result.update_hint}")
    return "\n".join(lines).rstrip("\n")


def check_json(result: CheckResult) -> dict:
    return {
        "schema": CHECK_SCHEMA,
        "passed": result.passed,
        "baseline": result.baseline_path,
        "kinds": list(result.kinds),
        "tolerance": result.tolerance,
        "mesh": result.mesh,
        "baseline_mesh": result.baseline_mesh,
        "jax": result.jax,
        "baseline_jax": result.baseline_jax,
        "notes": list(result.notes()),
        "update": result.update_hint,
        "changes": [_change_json(c, result.root) for c in result.changes],
    }


def _change_json(c: Change, root: str) -> dict:
    return {
        "status": c.status,
        "fails": c.is_regression,
        "key": c.key,
        "kind": c.kind,
        "axes": list(c.axes),
        "file": c.file,
        "function": c.function,
        "lines": [{"file": f, "line": n} for f, n in c.lines(root)],
        "count": c.count,
        "bytes": c.bytes,
        "baseline_count": c.baseline_count,
        "baseline_bytes": c.baseline_bytes,
        "message": headline(c),
        "collectives": [m.id for m in c.collectives],
        "findings": [{k: v for k, v in dataclasses.asdict(f).items() if k != "neighbourhood"}
                     for f in c.findings],
    }


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def format_github(result: CheckResult) -> str:
    """`::error file=F,line=L,title=T::message` per location; improvements as `::notice`."""
    out = []
    for c in result.changes:
        level = "error" if c.is_regression else "notice"
        title = f"shardlint: {c.status} {c.kind}"
        body = "\n".join([headline(c) + f" [{result.baseline_path or 'baseline'}]",
                          f"key: {c.key}", *explanation(c, result.root)]
                         + ([f"to accept: {result.update_hint}"]
                            if c.is_regression and result.update_hint else []))
        locations = [(f, str(n)) for f, n in c.lines(result.root)] or [(c.file, "")]
        for file, line in locations:
            props = [f"file={_escape_property(file)}"] if file else []
            props += [f"line={line}"] if line else []
            props.append(f"title={_escape_property(title)}")
            out.append(f"::{level} {','.join(props)}::{_escape_data(body)}")
    verdict = "passed" if result.passed else "failed"
    out.append(f"shardlint check {verdict}: {len(result.regressions)} regression(s), "
               f"{len(result.improvements)} improvement(s) in {', '.join(result.kinds)} "
               f"against {result.baseline_path or 'the baseline'}")
    out += [f"::warning title=shardlint::{_escape_data(n)}" for n in result.notes()]
    return "\n".join(out)

