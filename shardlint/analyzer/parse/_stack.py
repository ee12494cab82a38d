"""XLA's stack-frame tables: the Python stack of each instruction of a compiled module.

Compiled HLO names an instruction's Python stack through `metadata={stack_frame_id=N}` and
four tables at the top of the module (`FileNames`, `FunctionNames`, `FileLocations`,
`StackFrames`); a frame row points at its location and its caller's frame. Which of those
frames are the user's, and how their paths are shown, is `shardlint/_source.py`'s.
"""

from __future__ import annotations

import codecs

from ..._source import Source

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def parse_stack_frames(lines: list[str]) -> dict[int, tuple[Source, ...]]:
    """Maps each `stack_frame_id` of a module's tables to its stack, innermost frame first."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in lines:
        stripped = line.strip()
        if stripped in _TABLES:
            section = stripped
            tables[section] = {}
            continue
        if section is None:
            continue
        number, _, rest = stripped.partition(" ")
        if not number.isdigit():
            if stripped:
                section = None  # the first computation ends the tables
            continue
        tables[section][int(number)] = rest
    files = {k: _unquote(v) for k, v in tables.get("FileNames", {}).items()}
    functions = {k: _unquote(v) for k, v in tables.get("FunctionNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        row = _fields(v)
        locations[k] = Source(files.get(row.get("file_name_id", 0), ""), row.get("line", 0),
                              functions.get(row.get("function_name_id", 0), ""))
    rows = {k: _fields(v) for k, v in tables.get("StackFrames", {}).items()}
    # XLA prints `parent_frame_id` as the proto's value plus one (HloModule::Print in XLA of
    # JAX 0.10.2 and 0.12.0.1), so a root frame (parent 0) prints 1. A printer that wrote the
    # proto's value as it is would print 0 for the first frame, which is always a root.
    shift = 0 if any(r.get("parent_frame_id") == 0 for r in rows.values()) else 1
    stacks: dict[int, tuple[Source, ...]] = {}
    for k in rows:
        stack, seen, frame = [], set(), k
        while frame in rows and frame not in seen:
            seen.add(frame)
            location = locations.get(rows[frame].get("file_location_id", 0))
            if location is not None:
                stack.append(location)
            frame = rows[frame].get("parent_frame_id", 0) - shift
        stacks[k] = tuple(stack)
    return stacks


def _unquote(text: str) -> str:
    """A name as XLA prints it: in double quotes, C-escaped (absl::CEscape of UTF-8 bytes)."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        text = text[1:-1]
        if "\\" in text:
            text = codecs.escape_decode(text.encode())[0].decode("utf-8", "replace")
    return text


def _fields(text: str) -> dict[str, int]:
    """`{file_name_id=1 function_name_id=2 line=17}` as a dict of ints."""
    fields = {}
    for item in text.strip().strip("{}").split():
        key, _, value = item.partition("=")
        if value.lstrip("-").isdigit():
            fields[key] = int(value)
    return fields
