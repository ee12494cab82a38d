"""The one parser for XLA's HLO text.

Compiled HLO has no Python walker, so this module owns its text format: computations,
instructions (tuple-shaped results included), operands, attributes, and each
instruction's source stack (the stack-frame tables are read by `_stack.py`). It reads every
module XLA dumps for us: the HLO right after sharding propagation (Shardy's export or
GSPMD's pass) and the partitioned, optimised module.

Attributes stay raw text in `Instruction.attrs`, and the ones detectors need have typed
views (`dimensions`, `window_sizes`, `known_trip_count`, gather/scatter/dot dimension
numbers, ...), so that no detector reads attribute text. An element type whose size is
not known is refused by name rather than guessed. How often a loop runs is `_trips.py`'s. What a `sharding=` or
`replica_groups=` value means on a mesh is decoded in `_devices.py`. Text differences
between XLA versions are handled here and named where they occur. The lexical helpers
(brackets, quotes, attribute and integer lists) live in `_hlo_text.py`.

Dumps also come from other XLA builds (`--xla-dump`), cut short or edited, so text the
parser cannot read raises `HloParseError` naming the line, never a stray `ValueError`.
A module looks as every module XLA printed for the example and test steps does (JAX
0.10.2 and 0.12.0.1, Shardy and GSPMD: the partitioned and propagated modules, and for
some steps the dump after every pass): `HloModule NAME` on the first line; then blank
lines, the stack-frame tables and computations; a computation is a header ending in `{`,
instructions and `}`, with exactly one ROOT, each name defined once, and operands naming
instructions of the same computation; exactly one computation is the ENTRY. A line that is
none of these is text of an XLA version this parser does not know: refused, not skipped.
Attribute values are read lazily by the typed views, which name the instruction's line
the same way; sharding and device-group texts carry their line into `_devices.py`
(`AttrText`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

from ..._errors import HloParseError
from ..._op_paths import is_backward, primitive_of, transform_of
from ..._source import Source
from ._hlo_text import (
    _OPERAND_RE,
    _unclosed,
    _INT_RE,
    _Unreadable,
    _called_name,
    _dims,
    _int_or_none,
    _int_tuple,
    _matching,
    _metadata_fields,
    _metadata_int,
    _parse_attrs,
    _take_type,
    _unquoted,
    _window,
    _x_ints,
)
from ._stack import _TABLES, _unquote, parse_stack_frames

# Bytes per element of every element type XLA prints (xla_data.proto's PrimitiveType, as
# in JAX 0.10.2 and 0.12: sub-byte types take a byte each unpacked); `opaque` is a pointer.
_DTYPE_BYTES = {
    "pred": 1, "s1": 1, "u1": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "f4e2m1fn": 1, "f6e2m3fn": 1, "f6e3m2fn": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "token": 0, "opaque": 8,
}

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
# One array type with its optional layout: `f32[8,<=16]{1,0:T(8,128)}`, `token[]`.
_ARRAY_TYPE_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\[\]]*)\](?:\{[^{}]*\})?")
_INDEX_COMMENT_RE = re.compile(r"/\*index=\d+\*/")  # XLA marks every fifth tuple element
_HEADER_RE = re.compile(r"HloModule ([^\s,]+)")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"([\w\-.]+)\(")
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")
# A computation ends with `}`; XLA:TPU prints its attributes after the brace:
# `}, execution_thread="sparsecore"` (libtpu 0.0.42.1 and 0.0.50.1, v5p:2x2x2 and larger).
_CLOSE_RE = re.compile(r'^\}(?:\s*,\s*[\w.\-]+=(?:"(?:[^"\\]|\\.)*"|[^\s,]+))*\s*$')

_INSTRUCTION = "an instruction `[ROOT] %name = TYPE OPCODE(OPERANDS), ATTRIBUTES`"
_OUTSIDE = ("a computation `[ENTRY] %name (PARAMETERS) -> TYPE {`, a stack-frame table "
            "or a blank line")


class AttrText(str):
    """An attribute's raw text that knows its key and its instruction's line, so that the
    decoders in `_devices.py` name the line of text they cannot read."""

    def __new__(cls, text: str, key: str | None = None, line: int | None = None):
        self = super().__new__(cls, text)
        self.key, self.line = key, line
        return self


@dataclasses.dataclass(frozen=True)
class ArrayType:
    """One array of an instruction's result: element type and dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.dims) * _DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def _view(read) -> property:
    """A typed view of the attributes: text it cannot read raises HloParseError naming the
    instruction's line."""

    @functools.wraps(read)
    def get(self):
        try:
            return read(self)
        except _Unreadable as e:
            raise HloParseError(e.expected, e.found, self.line) from e

    return property(get)


def _ints(key: str) -> property:
    """A `key={0,1}` attribute as a tuple of ints; () when the instruction has none."""

    def read(self) -> tuple[int, ...]:
        text = self.attrs.get(key)
        return () if text is None else _int_tuple(text, key)

    read.__doc__ = f"`{key}={{...}}` as a tuple of ints."
    return _view(read)


def _int(key: str) -> property:
    """A `key=N` attribute as an int; None when the instruction has none."""

    def read(self) -> int | None:
        text = self.attrs.get(key)
        if text is None:
            return None
        if not _INT_RE.fullmatch(text):
            raise _Unreadable(f"`{key}=N`, an integer", f"{key}={text}")
        return int(text)

    read.__doc__ = f"`{key}=N` as an int, or None."
    return _view(read)


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    result: tuple[ArrayType, ...]
    is_tuple: bool
    operands: tuple[str, ...]        # instruction names, without a `#N` tuple index
    attrs: dict[str, str]            # raw attribute text; read it through the typed views
    computation: str
    is_root: bool = False
    source: Source | None = None               # the innermost frame of `stack`
    stack: tuple[Source, ...] = ()             # innermost frame first, to the root
    operand_text: str = ""                     # inside the parentheses: `0` of `parameter(0)`
    # Newer XLA (JAX 0.12's propagated dump) names a tuple element inline, `%while.1#1`,
    # instead of a get-tuple-element: the element index per operand, None where absent.
    operand_indices: tuple[int | None, ...] = ()
    line: int | None = None                    # 1-based line of the module text

    @_view
    def op_name(self) -> str:
        return _metadata_fields(self.attrs.get("metadata", "")).get("op_name", "")

    @_view
    def primitive(self) -> str:
        """The JAX primitive its op path names (`primitive_of`), "" where none."""
        return primitive_of(self.op_name)

    @_view
    def backward(self) -> bool:
        """It belongs to the backward pass (`is_backward` of its op path)."""
        return is_backward(self.op_name)

    @_view
    def transform(self) -> str:
        """The transformations its op path runs under (`transform_of`)."""
        return transform_of(self.op_name)

    @property
    def spmd_generated(self) -> bool:
        """XLA's partitioner inserted it (`frontend_attributes={is_spmd_generated="true"}`;
        newer XLA, as JAX 0.12 ships, marks the copies and reshards it adds so)."""
        return 'is_spmd_generated="true"' in self.attrs.get("frontend_attributes", "")

    # Typed views of the attributes detectors read.
    dimensions = _ints("dimensions")                  # sort, reduce, broadcast, all-gather, ...
    lhs_batch_dims = _ints("lhs_batch_dims")          # dot
    rhs_batch_dims = _ints("rhs_batch_dims")
    lhs_contracting_dims = _ints("lhs_contracting_dims")
    rhs_contracting_dims = _ints("rhs_contracting_dims")
    offset_dims = _ints("offset_dims")                # gather
    collapsed_slice_dims = _ints("collapsed_slice_dims")
    start_index_map = _ints("start_index_map")
    slice_sizes = _ints("slice_sizes")
    update_window_dims = _ints("update_window_dims")  # scatter
    inserted_window_dims = _ints("inserted_window_dims")
    scatter_dims_to_operand_dims = _ints("scatter_dims_to_operand_dims")
    index_vector_dim = _int("index_vector_dim")       # gather and scatter
    tuple_index = _int("index")                       # get-tuple-element

    @_view
    def window_sizes(self) -> tuple[int, ...]:
        """`window={size=1x64x1 ...}` (reduce-window, convolution) as (1, 64, 1)."""
        return _x_ints(self.attrs.get("window", ""), "size")

    @_view
    def window_strides(self) -> tuple[int, ...]:
        """Window strides, 1 per window dimension when the window prints none."""
        return _x_ints(self.attrs.get("window", ""), "stride") or (1,) * len(self.window_sizes)

    @_view
    def window_padding(self) -> tuple[tuple[int, int], ...]:
        """`pad=7_0x0_0` as ((7, 0), (0, 0)): (low, high) per window dimension."""
        text = self.attrs.get("window", "")
        pads = _window(text).get("pad", "")
        if not pads:
            return ((0, 0),) * len(self.window_sizes)
        pairs = [p.split("_") for p in pads.split("x")]
        if any(len(p) != 2 or not all(map(_INT_RE.fullmatch, p)) for p in pairs):
            raise _Unreadable("a window `pad=LOW_HIGHxLOW_HIGH...`", f"window={text}")
        return tuple((int(lo), int(hi)) for lo, hi in pairs)

    @_view
    def custom_call_target(self) -> str:
        return _unquoted(self.attrs.get("custom_call_target", ""))

    @_view
    def backend_config(self) -> dict:
        """The JSON `backend_config` as a dict; {} when absent or not JSON."""
        text = self.attrs.get("backend_config", "")
        if not text.startswith("{"):
            text = _unquoted(text)  # some XLA versions print it as a quoted string
        try:
            config = json.loads(text) if text else {}
        except ValueError:
            return {}
        return config if isinstance(config, dict) else {}

    @property
    def known_trip_count(self) -> int | None:
        """A while loop's trip count as XLA's `WhileLoopTripCountAnnotator` recorded it
        (`backend_config={"known_trip_count":{"n":"4"}}`, optimised modules only; for the
        propagated module see `_trips.trip_count`)."""
        count = self.backend_config.get("known_trip_count", {})
        return _int_or_none(str(count.get("n", ""))) if isinstance(count, dict) else None

    @_view
    def parameter_number(self) -> int | None:
        """N of `parameter(N)`; None for every other opcode."""
        if self.opcode != "parameter":
            return None
        if not self.operand_text.isdecimal():
            raise _Unreadable("`parameter(N)`, a parameter number", f"parameter({self.operand_text})")
        return int(self.operand_text)

    @property
    def constant_value(self) -> int | float | None:
        """The value of a scalar `constant(4)`; None for arrays and other opcodes."""
        if self.opcode != "constant" or self.result and self.result[0].dims:
            return None
        text = self.operand_text.strip()
        if text in ("true", "false"):
            return int(text == "true")
        try:
            return int(text)
        except ValueError:
            try:
                return float(text)
            except ValueError:
                return None

    @property
    def sharding(self) -> AttrText | None:
        text = self.attrs.get("sharding")
        return None if text is None else AttrText(text, "sharding", self.line)

    @property
    def replica_groups(self) -> AttrText:
        """`replica_groups=` as XLA printed it, for `_devices.parse_replica_groups`. The mesh
        form runs past a top-level comma (`mesh[...], device_ids=([2,4]T(1,0)) {'axis_1'}`),
        which splits it into two attributes here; they are joined again."""
        text = self.attrs.get("replica_groups", "{}")
        if text.startswith("mesh[") and "device_ids" in self.attrs:
            text += ", device_ids=" + self.attrs["device_ids"]
        return AttrText(text, "replica_groups", self.line)

    @property
    def source_target_pairs(self) -> AttrText:
        """`source_target_pairs=` of a collective-permute, for `_devices.axes_of_pairs`."""
        return AttrText(self.attrs.get("source_target_pairs", ""), "source_target_pairs", self.line)

    @property
    def loop_body(self) -> str | None:
        """The body computation of a `while`."""
        return _called_name(self.attrs.get("body", ""))

    @property
    def loop_condition(self) -> str | None:
        """The condition computation of a `while`."""
        return _called_name(self.attrs.get("condition", ""))

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

    def get(self, name: str) -> Instruction | None:
        """The instruction of this computation with that name, or None."""
        index = self.__dict__.get("_by_name")
        if index is None or len(index) != len(self.instructions):
            index = self.__dict__["_by_name"] = {i.name: i for i in self.instructions}
        return index.get(name)

    @property
    def root(self) -> Instruction | None:
        return next((i for i in self.instructions if i.is_root), None)


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
    """Parses one HLO module printed by XLA (`HloModule.to_string()`).

    Raises HloParseError, naming the line, where the text is not such a module (see the
    module docstring for what one looks like)."""
    lines = text.splitlines()
    header = _HEADER_RE.match(lines[0]) if lines else None
    if header is None:
        raise HloParseError("`HloModule NAME` on the first line (HLO text as XLA prints it)",
                            lines[0] if lines else None, 1)
    try:
        frames = parse_stack_frames(lines)
    except ValueError as e:  # a table's quoted name that is not C-escaped text
        raise _table_error(lines) from e
    return HloModule(header.group(1), _ModuleReader(lines, frames).computations())


class _ModuleReader:
    """Reads a module's computations line by line, after its header: between computations
    the stack-frame tables and a computation's header (`_open`); inside one, its
    instructions (`_add`), each on one line or over several, up to its closing `}`
    (`_close`)."""

    def __init__(self, lines: list[str], frames):
        self.lines, self.frames = lines, frames
        self.index = 1                                   # the next line to read
        self.found: dict[str, Computation] = {}
        self.opened: dict[str, int] = {}                 # computation -> line of its header
        self.entry: Computation | None = None
        self.in_tables = False
        self.names: dict[str, Instruction] = {}          # the open computation's instructions
        self.root: Instruction | None = None

    def computations(self) -> dict[str, Computation]:
        current: Computation | None = None
        while self.index < len(self.lines):
            number, line = self.index + 1, self.lines[self.index]
            self.index += 1
            stripped = line.strip()
            if current is None:
                current = self._open(stripped, line, number)
            elif _CLOSE_RE.match(stripped):
                self._close(current, number)
                current = None
            elif stripped:
                self._add(current, self._whole_instruction(stripped), line, number)
        if current is not None:
            raise HloParseError(f"`}}` closing computation %{current.name} (line "
                                f"{self.opened[current.name]})", None, len(self.lines))
        if self.entry is None:
            raise HloParseError("an ENTRY computation", None, len(self.lines))
        return self.found

    def _open(self, stripped: str, line: str, number: int) -> Computation | None:
        """A computation's header (None for a blank line or a stack-frame table's)."""
        if not stripped:
            return None
        if self.in_tables and stripped.partition(" ")[0].isdecimal():
            return None  # a row of a stack-frame table (read by `parse_stack_frames`)
        if stripped in _TABLES:
            self.in_tables = True
            return None
        m = _COMP_RE.match(stripped)
        if m is None:
            raise HloParseError(_OUTSIDE, line, number)
        current, self.in_tables = Computation(m.group(2), bool(m.group(1)), []), False
        if current.name in self.found:
            raise HloParseError(f"a computation name not used before (%{current.name} is "
                                f"at line {self.opened[current.name]})", line, number)
        if current.is_entry and self.entry is not None:
            raise HloParseError(f"one ENTRY computation (%{self.entry.name} at line "
                                f"{self.opened[self.entry.name]} is one)", line, number)
        self.entry = current if current.is_entry else self.entry
        self.opened[current.name], self.names, self.root = number, {}, None
        return current

    def _whole_instruction(self, stripped: str) -> str:
        """An instruction's text, joined over lines: an attribute value may run over several
        (libtpu 0.0.50.1 prints `frontend_attributes={kernel_metadata={` and the metadata
        below it), and the instruction goes on until its brackets and quotes close. Lines
        ending in a closing bracket (nearly all) are not scanned."""
        while self.index < len(self.lines) and stripped[-1] not in ")}]" and _unclosed(stripped):
            stripped += " " + self.lines[self.index].strip()
            self.index += 1
        return stripped

    def _add(self, current: Computation, stripped: str, line: str, number: int) -> None:
        try:
            instr = _parse_instruction(stripped, current.name, self.frames, number)
        except _Unreadable as e:
            if _COMP_RE.match(stripped) and e.expected == _INSTRUCTION:
                e.expected = (f"`}}` closing computation %{current.name} (line "
                              f"{self.opened[current.name]}) before the next one")
            raise HloParseError(e.expected, line if e.found is None else e.found, number) from e
        if instr.name in self.names:
            raise HloParseError(f"a name not used before in %{current.name} (%{instr.name} is "
                                f"defined at line {self.names[instr.name].line})", line, number)
        if instr.is_root:
            if self.root is not None:
                raise HloParseError(f"one ROOT in %{current.name} (the first is at line "
                                    f"{self.root.line})", line, number)
            self.root = instr
        self.names[instr.name] = instr
        current.instructions.append(instr)

    def _close(self, comp: Computation, number: int) -> None:
        """Checks a computation at its closing `}`: one ROOT, every operand defined in it."""
        if self.root is None:
            raise HloParseError(f"a ROOT instruction in computation %{comp.name} (lines "
                                f"{self.opened[comp.name]}-{number})", "}", number)
        for instr in comp.instructions:
            for operand in instr.operands:
                if operand not in self.names:
                    raise HloParseError(f"operand %{operand} to be an instruction of computation "
                                        f"%{comp.name}", self.lines[instr.line - 1], instr.line)
        comp.__dict__["_by_name"] = self.names  # the index `Computation.get` builds
        self.found[comp.name] = comp


def _table_error(lines: list[str]) -> HloParseError:
    """The first stack-frame table row whose quoted name `parse_stack_frames` cannot read."""
    for number, line in enumerate(lines, 1):
        rest = line.strip().partition(" ")[2]
        try:
            _unquote(rest)
        except ValueError:
            return HloParseError("a C-escaped quoted name in a stack-frame table", line, number)
    return HloParseError("stack-frame tables XLA prints", None, None)


def _parse_instruction(line: str, computation: str, frames, number: int) -> Instruction:
    m = _INSTR_RE.match(line)
    if not m:
        raise _Unreadable(_INSTRUCTION)
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    type_text, rest = _take_type(rest)
    result = _result_type(type_text)
    unknown = [a.dtype for a in result if a.dtype not in _DTYPE_BYTES]
    if unknown:
        raise _Unreadable(f"an element type whose size is known for %{name}, not {unknown[0]!r} "
                          f"(known: {', '.join(_DTYPE_BYTES)})", type_text)
    m_op = _OPCODE_RE.match(rest)
    if not m_op:
        raise _Unreadable(_INSTRUCTION)
    opcode = m_op.group(1)
    close = _matching(rest, m_op.end() - 1)
    if close < 0:
        raise _Unreadable(f"the operands of %{name} closed by `)`")
    operand_text = rest[m_op.end():close]
    named = [ref.partition("#") for ref in _OPERAND_RE.findall(operand_text)]
    operands = tuple(ref for ref, _, _ in named)
    if any(i and not i.isdecimal() for _, _, i in named):
        raise _Unreadable(f"operands of %{name} named `%name` or `%name#N`")
    indices = tuple(int(i) if i else None for _, _, i in named)
    attrs = _parse_attrs(rest[close + 1:])
    stack = _stack_of(attrs.get("metadata", ""), frames)
    return Instruction(name=name, opcode=opcode, result=result, is_tuple=type_text.startswith("("),
                       operands=operands, attrs=attrs, computation=computation, is_root=is_root,
                       source=stack[0] if stack else None, stack=stack,
                       operand_text=operand_text.strip(), operand_indices=indices, line=number)


def _result_type(text: str) -> tuple[ArrayType, ...]:
    """The arrays of an instruction's type: `f32[8]{0}`, or a tuple of such (nested)."""
    if not text.startswith("("):
        m = _ARRAY_TYPE_RE.fullmatch(text)
        if m is None:
            raise _Unreadable("an array type such as `f32[8,16]{1,0}`", text)
        return (ArrayType(m.group(1), _dims(m.group(2))),)
    # Only parentheses, commas and index comments may lie between a tuple's arrays.
    if _ARRAY_TYPE_RE.sub("", _INDEX_COMMENT_RE.sub("", text)).strip("(), "):
        raise _Unreadable("a tuple type such as `(f32[8]{0}, s32[])`", text)
    return tuple(ArrayType(dt, _dims(d)) for dt, d in _ARRAY_RE.findall(text))


def _stack_of(metadata: str, frames) -> tuple[Source, ...]:
    # Older XLA prints source_file/source_line inline (one frame); newer XLA names a frame.
    fields = _metadata_fields(metadata)
    frame = _metadata_int(fields, "stack_frame_id")
    if frame is not None and frames.get(frame):
        return frames[frame]
    line = _metadata_int(fields, "source_line")
    if fields.get("source_file") and line is not None:
        return (Source(fields["source_file"], line),)
    return ()
