"""The JSON schema page (docs/schemas.md), written from the records themselves.

Each document shardlint writes (an analysis, the report's data, a check verdict, a
baseline) is produced here by the tool's own serializer, run on example records built
from the records' type hints, so no compile is needed. The page then lists the document's
keys with the JSON type each one had, and every record (frozen dataclass) the document
holds with its fields, their types (read from the type hints) and the comment written
beside each field in the source. Nothing on the page is typed by hand, so it cannot
drift from the code; `tests/test_docs.py` compares the page with what this writes.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import os
import re
import sys
import tempfile
import types
import typing
from typing import Any


def _records() -> list[type]:
    """Every dataclass defined in a shardlint module that is loaded, in a stable order; not
    the command layer's (`shardlint.commands`: it writes none as JSON, and whether it is
    loaded depends on who runs this, the tests or docs/regenerate.py)."""
    found = {}
    for name, module in sorted(sys.modules.items()):
        if name == "shardlint.commands" or name.startswith("shardlint.commands."):
            continue
        if name == "shardlint" or name.startswith("shardlint."):
            for value in vars(module).values():
                if (dataclasses.is_dataclass(value) and isinstance(value, type)
                        and value.__module__.startswith("shardlint")):
                    found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[k] for k in sorted(found)]


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def example(hint):
    """A value of the type `hint`: records get one example of every field (never None)."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        hints = _hints(hint)
        return hint(**{f.name: example(hints[f.name]) for f in _fields(hint) if f.init})
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(hint):
        return example(next(a for a in args if a is not type(None)))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return (example(args[0]),)
        return tuple(example(a) for a in args)
    if origin is list:
        return [example(args[0])]
    if origin is dict:
        return {example(args[0]): example(args[1])}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return next(iter(hint))
    simple = {str: "x", int: 1, float: 1.0, bool: True}
    if hint in simple:
        return simple[hint]
    return {}


def json_type(hint) -> str:
    """How a field of type `hint` reads in JSON."""
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return f"[{hint.__name__}](#{hint.__name__.lower()})"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(hint):
        return " or ".join(json_type(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis or origin is list:
        return f"list of {json_type(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(json_type(a) for a in args) + "]"
    if origin is dict:
        return f"object ({json_type(args[0])} → {json_type(args[1])})"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "string: " + ", ".join(f"`{m.value}`" for m in hint)
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    return names.get(hint, "any")


def _value_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list of " + _value_type(value[0]) if value else "list"
    return "object"


def field_notes(cls: type) -> dict[str, str]:
    """The comments beside each field in the class's source: above it, after it, and the
    comment lines indented under it."""
    notes: dict[str, list[str]] = {}
    pending: list[str] = []
    last, last_indent = None, 0
    names = {f.name for f in _fields(cls)}
    for line in inspect.getsource(cls).splitlines():
        indent = len(line) - len(line.lstrip())
        field = re.match(r"\s+(\w+)\s*:[^#]*(?:#\s*(.*))?$", line)
        comment = re.match(r"\s+#\s*(.*)$", line)
        if field and field.group(1) in names:
            last, last_indent = field.group(1), indent
            notes[last] = pending + ([field.group(2)] if field.group(2) else [])
            pending = []
        elif comment and last and indent > last_indent + 4:
            notes[last].append(comment.group(1))
        elif comment:
            pending.append(comment.group(1))
        else:
            pending, last = [], last if not line.strip() else None
    return {k: " ".join(v).replace("|", "\\|") for k, v in notes.items()}


def _as_json(value):
    return json.loads(json.dumps(value, default=dataclasses.asdict))


def _fits(value, like) -> bool:
    """Whether a JSON value is shaped as `like` (null and an empty list fit their kind)."""
    if value is None or value == [] and isinstance(like, list):
        return True
    return _value_type(value) == _value_type(like)


def _match(value: dict, records: list[type]) -> tuple[type | None, list[str], list[str]]:
    """The record a JSON object holds: all of its fields (extra keys allowed), or all but one
    or two, each shared key's value shaped as the field's type. Returns it, the fields the
    object lacks and the keys the record does not have."""
    keys, best = list(value), None
    for cls in records:
        fields = [f.name for f in _fields(cls)]
        missing, extra = [f for f in fields if f not in keys], [k for k in keys if k not in fields]
        hints = _hints(cls)
        fits = all(_fits(value[f], _as_json(example(hints[f]))) for f in fields if f in value)
        if (fits and len(fields) > 1 and len(missing) <= min(2, len(fields) // 3)
                and len(extra) <= len(fields)):
            if best is None or len(extra) + len(missing) < len(best[1]) + len(best[2]):
                best = (cls, missing, extra)
    return best or (None, [], list(keys))


def outline(doc: dict, records: list[type], used: list[type]) -> list[tuple[str, str]]:
    """(path, type) rows of a document; an object that is a record is one row naming it."""
    rows: list[tuple[str, str]] = []

    def walk(value, path: str):
        if isinstance(value, list) and value and isinstance(value[0], dict):
            rows.append((path, "list of objects"))
            walk(value[0], path + "[]")
            return
        if isinstance(value, dict) and value and set(value) == {example(str)}:
            rows.append((path, f"object (string → {_value_type(value[example(str)])})"))
            return
        if not isinstance(value, dict):
            rows.append((path, f'`"{value}"`' if path.endswith("schema") else _value_type(value)))
            return
        if path and isinstance(value.get("schema"), str):
            rows.append((path, f"a `{value['schema']}` document"))
            return
        cls, missing, extra = _match(value, records)
        if cls is not None:
            if cls not in used:
                used.append(cls)
            lacks = f" without {', '.join(f'`{m}`' for m in missing)}" if missing else ""
            rows.append((path or "(this object)", f"the fields of {json_type(cls)}{lacks}"))
        elif path:
            rows.append((path, "object"))
        for key in extra:
            walk(value[key], f"{path}.{key}" if path else key)

    walk(doc, "")
    return rows


def _merge(runs: list[list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """One row per path over several example runs; a path's types joined with `or`."""
    merged: dict[str, list[str]] = {}
    for rows in runs:
        for path, kind in rows:
            kinds = merged.setdefault(path, [])
            if kind not in kinds:
                kinds.append(kind)
    return [(p, " or ".join(k)) for p, k in merged.items()]


def _documents() -> list[tuple[str, str, list[dict]]]:
    """(schema, what writes it, example documents) for every document shardlint writes."""
    import shardlint.analyzer as analyzer
    import shardlint.gate as gate
    import shardlint.reports as reports

    analysis = example(analyzer.Analysis)

    def report_data(after, sweep) -> dict:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "data.json")
            reports.write_report_data(path, analysis, after, sweep)
            with open(path, encoding="utf-8") as fh:
                return json.load(fh)

    points = [{"value": v, "before": analysis, "after": a} for v, a in ((1, analysis), (2, analysis))]
    bare = [{"value": 1, "before": analysis, "after": None},
            {"value": 2, "before": analysis, "after": None, "refused": "why the rewrite was refused"}]
    return [
        (analyzer.SCHEMA, "`analyze --json`, `Analysis.to_json()`", [_as_json(analysis.to_json())]),
        (reports.REPORT_DATA_SCHEMA, "`report --json`, `analyze --sweep --json`",
         [report_data(analysis, {"axis": "context", "points": points}),
          report_data(None, {"axis": "context", "points": bare}), report_data(None, None)]),
        (json.loads(gate.render(example(gate.CheckResult), "json"))["schema"],
         "`check --format json`", [json.loads(gate.render(example(gate.CheckResult), "json"))]),
        (gate.SCHEMA, "`check --update` (the baseline file)", [json.loads(gate.dumps(example(gate.Baseline)))]),
        (reports.PLAN_SCHEMA, "`plan --json`", [_as_json(plan.to_json()) for plan in (
            example(reports.Plan),
            dataclasses.replace(example(reports.Plan), longest_key=None, longest_range=None, best=None))]),
    ]


def _record_table(cls: type) -> list[str]:
    hints, notes = _hints(cls), field_notes(cls)
    doc = inspect.getdoc(cls) or ""
    generated = doc.startswith(f"{cls.__name__}(")   # dataclass's own signature line
    out = [f"### {cls.__name__}", ""]
    if doc and not generated:
        out += [" ".join(doc.split("\n\n")[0].split()), ""]
    out += ["| field | type | note |", "|---|---|---|"]
    out += [f"| `{f.name}` | {json_type(hints[f.name])} | {notes.get(f.name, '')} |" for f in _fields(cls)]
    return out + [""]


def _nested(cls: type) -> list[type]:
    """The records a record's fields hold, directly or inside tuples, unions and dicts."""
    found: list[type] = []

    def visit(hint):
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            if hint not in found:
                found.append(hint)
            return
        for arg in typing.get_args(hint):
            visit(arg)

    for hint in _hints(cls).values():
        visit(hint)
    return found


def schema_page() -> str:
    """The generated part of docs/schemas.md."""
    documents = _documents()      # imports the packages whose records are listed
    records = _records()
    used: list[type] = []
    out = []
    for schema, writer, docs in documents:
        out += [f"## `{schema}`", "", f"Written by {writer}.", "", "| key | type |", "|---|---|"]
        out += [f"| `{path}` | {kind} |" for path, kind in _merge([outline(d, records, used) for d in docs])]
        out.append("")
    out += ["## Records", ""]
    listed: list[type] = []
    queue = list(used)
    while queue:
        cls = queue.pop(0)
        if cls in listed:
            continue
        listed.append(cls)
        out += _record_table(cls)
        queue += [c for c in _nested(cls) if c not in listed]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(schema_page())
