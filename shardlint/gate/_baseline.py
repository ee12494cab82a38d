"""The baseline file: the collectives a step is allowed to have, one entry per stable key.

Entries aggregate every collective that shares a key (forward and backward often emit
the same one) into a count and a byte total, so a second copy shows up as growth. The
document is meant to be committed and reviewed: it is sorted by key, carries no line
numbers, instruction names or absolute paths, and is written the same way every time, so
recompiling the same step yields the same bytes. It is written atomically (a temporary
file in the same folder, then `os.replace`) so an interrupted `--update` leaves the old
file, never half of a new one. Mesh and JAX version are recorded for the reader; they do
not take part in the comparison.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable

from .._errors import ShardlintError
from .._files import write_text
from ..analyzer import Analysis, Collective
from ._keys import CollectiveKey

SCHEMA = "shardlint.baseline/2"
DEFAULT_BASELINE = "shardlint.baseline.json"   # where `shardlint check` reads and writes it


class BaselineError(ShardlintError):
    """The baseline file is missing, unreadable, or not a `shardlint.baseline/2` document."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """All collectives of one key: how many there are and the bytes they move per device."""

    key: str
    kind: str
    file: str      # source file relative to the project root, "" when XLA gave none
    count: int
    bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Baseline:
    entries: tuple[Entry, ...]   # sorted by key
    mesh: dict[str, int]
    jax: str
    target: str = ""

    def by_key(self) -> dict[str, Entry]:
        return {e.key: e for e in self.entries}


def group_by_key(collectives: Iterable[Collective], root: str) -> dict[str, list[Collective]]:
    """Collectives grouped by stable key; within a key the largest first, then by id."""
    groups: dict[str, list[Collective]] = {}
    for c in collectives:
        groups.setdefault(str(CollectiveKey.of(c, root)), []).append(c)
    for members in groups.values():
        members.sort(key=lambda c: (-c.bytes, c.id))
    return dict(sorted(groups.items()))


def entry_of(key: str, members: list[Collective], root: str) -> Entry:
    parts = CollectiveKey.of(members[0], root)
    return Entry(key=key, kind=parts.kind, file=parts.file, count=len(members),
                 bytes=sum(c.bytes for c in members))


def baseline_of(analysis: Analysis, root: str, target: str = "") -> Baseline:
    """The baseline that accepts exactly the collectives of `analysis`."""
    groups = group_by_key(analysis.collectives, root)
    return Baseline(entries=tuple(entry_of(k, v, root) for k, v in groups.items()),
                    mesh=dict(analysis.mesh), jax=analysis.versions.get("jax", ""), target=target)


def dumps(baseline: Baseline) -> str:
    doc = {
        "schema": SCHEMA,
        "target": baseline.target,
        "mesh": baseline.mesh,
        "jax": baseline.jax,
        "collectives": [
            {"key": e.key, "kind": e.kind, "file": e.file, "count": e.count, "bytes": e.bytes}
            for e in sorted(baseline.entries, key=lambda e: e.key)],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def write_baseline(baseline: Baseline, path: str) -> bool:
    """Writes atomically; returns False (and leaves the file alone) when nothing changed."""
    text = dumps(baseline)
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text:
                return False
    except (OSError, UnicodeDecodeError):
        pass
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_text(path, text)
    except OSError as e:
        raise BaselineError(f"cannot write baseline {path}: {e}") from e
    return True


# json's messages for the mistakes a hand edit makes, in words ("Invalid control character
# at" is json's text before it appends the position).
_JSON_PROBLEMS = {
    "Invalid control character at": "a control character (a raw tab or line break) inside a string",
    "Unterminated string starting at": "a string that is never closed",
    "Expecting value": "a value is missing",
    "Extra data": "text after the end of the document",
    "Invalid \\escape": "a backslash escape JSON does not know",
}


def _json_problem(message: str) -> str:
    known = _JSON_PROBLEMS.get(message)
    if known:
        return known
    message = message.removesuffix(" at")
    return message[:1].lower() + message[1:]


def read_baseline(path: str, how_to_create: str = "shardlint check TARGET --mesh ... --update") -> Baseline:
    """Reads and validates a baseline; every problem is a BaselineError naming the way out."""
    fix = f"create it with `{how_to_create}`"
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError as e:
        raise BaselineError(f"no baseline at {path}; {fix}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise BaselineError(f"cannot read baseline {path}: {e}; {fix}") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise BaselineError(f"baseline {path} is not valid JSON: {_json_problem(e.msg)} at line "
                            f"{e.lineno}, column {e.colno}; re-{fix}") from e
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if schema != SCHEMA:
        older = isinstance(schema, str) and schema.startswith("shardlint.baseline/")
        raise BaselineError(
            f"baseline {path} has schema {schema!r}, expected {SCHEMA!r}"
            + ("; it keys collectives the older way (on the op the analysis attributed them "
               "to), so it cannot be compared" if older else "") + f"; re-{fix}")
    try:
        entries = tuple(_entry(d) for d in doc["collectives"])
        mesh = {str(k): int(v) for k, v in dict(doc.get("mesh") or {}).items()}
        jax_version, target = str(doc.get("jax", "")), str(doc.get("target", ""))
    except (KeyError, TypeError, ValueError) as e:
        raise BaselineError(f"baseline {path} is damaged ({type(e).__name__}: {e}); re-{fix}") from e
    keys = [e.key for e in entries]
    if len(set(keys)) != len(keys):
        raise BaselineError(f"baseline {path} lists a key twice; re-{fix}")
    return Baseline(entries=tuple(sorted(entries, key=lambda e: e.key)), mesh=mesh,
                    jax=jax_version, target=target)


def _entry(d: dict) -> Entry:
    count, nbytes = d["count"], d["bytes"]
    if not (isinstance(count, int) and isinstance(nbytes, int) and count >= 0 and nbytes >= 0):
        raise ValueError(f"entry {d.get('key')!r}: count and bytes must be non-negative integers")
    if not isinstance(d["key"], str) or not isinstance(d["kind"], str):
        raise TypeError(f"entry {d.get('key')!r}: key and kind must be strings")
    return Entry(key=d["key"], kind=d["kind"], file=str(d.get("file", "")), count=count, bytes=nbytes)

