"""The one parser for XLA's HLO text.

Compiled HLO has no Python walker, so this module owns its text format: computations,
instructions (tuple-shaped results included), operands, attributes, and the
`FileNames`/`FunctionNames`/`FileLocations`/`StackFrames` tables that map an
instruction's `stack_frame_id` to a file and line. It reads every module XLA dumps for us:
the HLO right after sharding propagation (Shardy's export or GSPMD's pass) and the
partitioned, optimised module.

It parses structure only; what a `sharding=` or `replica_groups=` value means on a mesh
is decoded in `_devices.py`. Text differences between XLA versions are handled here and
named where they occur.
"""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "token": 0,
}

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")
_TABLE_ROW_RE = re.compile(r"^(\d+)\s+(.*)$")
_OPERAND_RE = re.compile(r"%([^\s,()]+)")


@dataclasses.dataclass(frozen=True)
class ArrayType:
    """One array of an instruction's result: element type and dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.dims) * _DTYPE_BYTES.get(self.dtype, 4)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class SourceLocation:
    file: str
    line: int
    function: str = ""


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    result: tuple[ArrayType, ...]
    is_tuple: bool
    operands: tuple[str, ...]
    attrs: dict[str, str]
    computation: str
    is_root: bool = False
    source: SourceLocation | None = None

    @property
    def op_name(self) -> str:
        return _metadata_field(self.attrs.get("metadata", ""), "op_name") or ""

    @property
    def sharding(self) -> str | None:
        return self.attrs.get("sharding")

    @property
    def called(self) -> tuple[str, ...]:
        """Computations this instruction calls (fusions, async wrappers, loops)."""
        names: list[str] = []
        for key in ("calls", "to_apply", "body", "condition", "called_computations",
                    "branch_computations"):
            if key in self.attrs:
                names += _OPERAND_RE.findall(self.attrs[key])
        return tuple(names)


@dataclasses.dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: list[Instruction]


@dataclasses.dataclass
class HloModule:
    name: str
    computations: dict[str, Computation]

    @property
    def entry(self) -> Computation:
        return next(c for c in self.computations.values() if c.is_entry)

    def instructions(self):
        for comp in self.computations.values():
            yield from comp.instructions


def parse_hlo(text: str) -> HloModule:
    """Parses one HLO module printed by XLA (`HloModule.to_string()`)."""
    lines = text.splitlines()
    name = ""
    if lines and lines[0].startswith("HloModule "):
        name = lines[0].split()[1].rstrip(",")
    frames = _parse_stack_frames(lines)
    computations: dict[str, Computation] = {}
    current: Computation | None = None
    for line in lines:
        stripped = line.strip()
        if current is None:
            m = _COMP_RE.match(stripped)
            if m and not stripped.startswith("HloModule"):
                current = Computation(m.group(2), bool(m.group(1)), [])
            continue
        if stripped == "}":
            computations[current.name] = current
            current = None
            continue
        instr = _parse_instruction(stripped, current.name, frames)
        if instr is not None:
            current.instructions.append(instr)
    return HloModule(name, computations)


def _parse_instruction(line: str, computation: str, frames) -> Instruction | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    type_text, rest = _take_type(rest)
    m_op = re.match(r"([\w\-.]+)\(", rest)
    if not m_op:
        return None
    opcode = m_op.group(1)
    close = _matching(rest, m_op.end() - 1)
    operand_text = rest[m_op.end():close]
    operands = tuple(_OPERAND_RE.findall(operand_text))
    attrs = _parse_attrs(rest[close + 1:])
    result = tuple(ArrayType(dt, _dims(d)) for dt, d in _ARRAY_RE.findall(type_text))
    source = _source_of(attrs.get("metadata", ""), frames)
    return Instruction(name, opcode, result, type_text.startswith("("), operands, attrs,
                       computation, is_root, source)


def _take_type(text: str) -> tuple[str, str]:
    text = text.lstrip()
    if text.startswith("("):
        end = _matching(text, 0)
        return text[: end + 1], text[end + 1:].lstrip()
    # A plain array type ends at the first space outside its layout braces.
    depth = 0
    for i, ch in enumerate(text):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == " " and depth == 0:
            return text[:i], text[i + 1:].lstrip()
    return text, ""


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at `start`, skipping quoted strings."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack: list[str] = []
    in_quote = False
    i = start
    while i < len(text):
        ch = text[i]
        if in_quote:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_quote = False
        elif ch == '"':
            in_quote = True
        elif ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i
        i += 1
    return len(text) - 1


def _parse_attrs(text: str) -> dict[str, str]:
    """Splits `, key=value, key={...}` at top level into a dict of raw values."""
    attrs: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in ", ":
            i += 1
        m = re.match(r"([\w.\-]+)=", text[i:])
        if not m:
            break
        key = m.group(1)
        j = i + m.end()
        start = j
        while j < n:
            ch = text[j]
            if ch in "({[" or ch == '"':
                j = _matching(text, j) + 1 if ch != '"' else _end_quote(text, j) + 1
                continue
            if ch == ",":
                break
            j += 1
        attrs[key] = text[start:j].strip()
        i = j
    return attrs


def _end_quote(text: str, start: int) -> int:
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i
        i += 1
    return len(text) - 1


def _dims(text: str) -> tuple[int, ...]:
    # Bounded dynamic dimensions print as `<=8`; keep the bound.
    return tuple(int(d.lstrip("<=?")) for d in text.split(",") if d.strip().lstrip("<=?"))


def _metadata_field(metadata: str, field: str) -> str | None:
    m = re.search(field + r'=("(?:[^"\\]|\\.)*"|[^\s}]+)', metadata)
    if not m:
        return None
    value = m.group(1)
    return value[1:-1].replace('\\"', '"') if value.startswith('"') else value


def _source_of(metadata: str, frames) -> SourceLocation | None:
    # Older XLA prints source_file/source_line inline; newer XLA names a stack frame.
    frame = _metadata_field(metadata, "stack_frame_id")
    if frame is not None and int(frame) in frames:
        return frames[int(frame)]
    file = _metadata_field(metadata, "source_file")
    line = _metadata_field(metadata, "source_line")
    if file and line:
        return SourceLocation(file, int(line))
    return None


def _parse_stack_frames(lines: list[str]) -> dict[int, SourceLocation]:
    """Reads the stack-frame tables; a frame id maps to its innermost (own) location."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in lines:
        stripped = line.strip()
        if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = stripped
            tables[section] = {}
            continue
        if section is None:
            continue
        m = _TABLE_ROW_RE.match(stripped)
        if not m:
            if stripped:
                section = None
            continue
        tables[section][int(m.group(1))] = m.group(2)
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locations: dict[int, SourceLocation] = {}
    for k, v in tables.get("FileLocations", {}).items():
        fields = dict(re.findall(r"(\w+)=(\d+)", v))
        locations[k] = SourceLocation(
            files.get(int(fields.get("file_name_id", 0)), ""),
            int(fields.get("line", 0)),
            functions.get(int(fields.get("function_name_id", 0)), ""),
        )
    frames: dict[int, SourceLocation] = {}
    for k, v in tables.get("StackFrames", {}).items():
        fields = dict(re.findall(r"(\w+)=(\d+)", v))
        loc = locations.get(int(fields.get("file_location_id", 0)))
        if loc is not None:
            frames[k] = loc
    return frames
