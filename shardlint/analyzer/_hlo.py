"""The one parser for XLA's HLO text.

Compiled HLO has no Python walker, so this module owns its text format: computations,
instructions (tuple-shaped results included), operands, attributes, and each
instruction's source stack (the stack-frame tables are read by `_stack.py`). It reads every
module XLA dumps for us: the HLO right after sharding propagation (Shardy's export or
GSPMD's pass) and the partitioned, optimised module.

Attributes stay raw text in `Instruction.attrs`, and the ones detectors need have typed
views (`dimensions`, `window_sizes`, `known_trip_count`, gather/scatter/dot dimension
numbers, ...), so that no detector reads attribute text. What a `sharding=` or
`replica_groups=` value means on a mesh is decoded in `_devices.py`. Text differences
between XLA versions are handled here and named where they occur.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from ._stack import SourceLocation, _unquote, parse_stack_frames

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
_OPERAND_RE = re.compile(r"%([^\s,(){}]+)")


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


def _ints(key: str) -> property:
    """A `key={0,1}` attribute as a tuple of ints; () when the instruction has none."""
    return property(lambda self: _int_tuple(self.attrs.get(key, "")),
                    doc=f"`{key}={{...}}` as a tuple of ints.")


def _int(key: str) -> property:
    """A `key=N` attribute as an int; None when the instruction has none."""
    return property(lambda self: _int_or_none(self.attrs.get(key, "")),
                    doc=f"`{key}=N` as an int, or None.")


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
    source: SourceLocation | None = None       # the innermost frame of `stack`
    stack: tuple[SourceLocation, ...] = ()     # innermost frame first, to the root
    operand_text: str = ""                     # inside the parentheses: `0` of `parameter(0)`
    # Newer XLA (JAX 0.12's propagated dump) names a tuple element inline, `%while.1#1`,
    # instead of a get-tuple-element: the element index per operand, None where absent.
    operand_indices: tuple[int | None, ...] = ()

    @property
    def op_name(self) -> str:
        return _metadata_fields(self.attrs.get("metadata", "")).get("op_name", "")

    # Typed views of the attributes detectors read.
    dimensions = _ints("dimensions")                  # sort, reduce, broadcast, all-gather, ...
    lhs_batch_dims = _ints("lhs_batch_dims")          # dot
    rhs_batch_dims = _ints("rhs_batch_dims")
    lhs_contracting_dims = _ints("lhs_contracting_dims")
    rhs_contracting_dims = _ints("rhs_contracting_dims")
    offset_dims = _ints("offset_dims")                # gather
    collapsed_slice_dims = _ints("collapsed_slice_dims")
    start_index_map = _ints("start_index_map")
    operand_batching_dims = _ints("operand_batching_dims")
    start_indices_batching_dims = _ints("start_indices_batching_dims")
    slice_sizes = _ints("slice_sizes")
    update_window_dims = _ints("update_window_dims")  # scatter
    inserted_window_dims = _ints("inserted_window_dims")
    scatter_dims_to_operand_dims = _ints("scatter_dims_to_operand_dims")
    input_batching_dims = _ints("input_batching_dims")
    scatter_indices_batching_dims = _ints("scatter_indices_batching_dims")
    index_vector_dim = _int("index_vector_dim")       # gather and scatter
    dynamic_slice_sizes = _ints("dynamic_slice_sizes")
    tuple_index = _int("index")                       # get-tuple-element
    k = _int("k")                                     # topk

    @property
    def window_sizes(self) -> tuple[int, ...]:
        """`window={size=1x64x1 ...}` (reduce-window, convolution) as (1, 64, 1)."""
        sizes = _window(self.attrs.get("window", "")).get("size", "")
        return tuple(int(d) for d in sizes.split("x") if d)

    @property
    def window_strides(self) -> tuple[int, ...]:
        """Window strides, 1 per window dimension when the window prints none."""
        strides = _window(self.attrs.get("window", "")).get("stride", "")
        return tuple(int(d) for d in strides.split("x") if d) or (1,) * len(self.window_sizes)

    @property
    def window_padding(self) -> tuple[tuple[int, int], ...]:
        """`pad=7_0x0_0` as ((7, 0), (0, 0)): (low, high) per window dimension."""
        pads = _window(self.attrs.get("window", "")).get("pad", "")
        if not pads:
            return ((0, 0),) * len(self.window_sizes)
        pairs = (p.partition("_") for p in pads.split("x"))
        return tuple((int(lo), int(hi)) for lo, _, hi in pairs)

    @property
    def custom_call_target(self) -> str:
        return _unquote(self.attrs.get("custom_call_target", ""))

    @property
    def backend_config(self) -> dict:
        """The JSON `backend_config` as a dict; {} when absent or not JSON."""
        text = self.attrs.get("backend_config", "")
        if not text.startswith("{"):
            text = _unquote(text)  # some XLA versions print it as a quoted string
        try:
            config = json.loads(text) if text else {}
        except ValueError:
            return {}
        return config if isinstance(config, dict) else {}

    @property
    def known_trip_count(self) -> int | None:
        """A while loop's trip count as XLA's `WhileLoopTripCountAnnotator` recorded it
        (`backend_config={"known_trip_count":{"n":"4"}}`, optimised modules only; for the
        propagated module see `HloModule.trip_count`)."""
        count = self.backend_config.get("known_trip_count", {})
        return _int_or_none(str(count.get("n", ""))) if isinstance(count, dict) else None

    @property
    def parameter_number(self) -> int | None:
        """N of `parameter(N)`; None for every other opcode."""
        return _int_or_none(self.operand_text) if self.opcode == "parameter" else None

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
    def sharding(self) -> str | None:
        return self.attrs.get("sharding")

    @property
    def replica_groups(self) -> str:
        """`replica_groups=` as XLA printed it, for `_devices.parse_replica_groups`. The mesh
        form runs past a top-level comma (`mesh[...], device_ids=([2,4]T(1,0)) {'axis_1'}`),
        which splits it into two attributes here; they are joined again."""
        text = self.attrs.get("replica_groups", "{}")
        if text.startswith("mesh[") and "device_ids" in self.attrs:
            text += ", device_ids=" + self.attrs["device_ids"]
        return text

    @property
    def source_target_pairs(self) -> str:
        """`source_target_pairs=` of a collective-permute, for `_devices.axes_of_pairs`."""
        return self.attrs.get("source_target_pairs", "")

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

    def trip_count(self, loop: Instruction) -> int | None:
        """How often a while loop runs: XLA's annotation where the module carries one (the
        optimised module), else read from the loop's computations (the propagated module)."""
        if loop.known_trip_count is not None:
            return loop.known_trip_count
        return _counted_loop(self, loop)


def _counted_loop(module: HloModule, loop: Instruction) -> int | None:
    """`for i in range(start, limit)` as JAX lowers `scan` and `fori_loop`: the condition is
    `element < constant`, the body adds 1 to that element, the initial tuple holds a constant."""
    cond, body, caller = (module.computations.get(name or "") for name in (
        loop.loop_condition, loop.loop_body,
        loop.computation))
    if cond is None or body is None or caller is None or not loop.operands:
        return None
    compare, result, init = cond.root, body.root, caller.get(loop.operands[0])
    if (compare is None or compare.opcode != "compare" or compare.attrs.get("direction") != "LT"
            or result is None or init is None or init.opcode != "tuple"):
        return None
    index = _element_of_parameter(cond, compare, 0)
    if index is None or index >= min(len(init.operands), len(result.operands)):
        return None
    start, limit = caller.get(init.operands[index]), cond.get(compare.operands[1])
    add = body.get(result.operands[index])
    if start is None or limit is None or add is None or add.opcode != "add":
        return None
    # The body adds a constant 1 to the counter, on either side of the add.
    steps = [body.get(add.operands[1 - k]) for k in (0, 1)
             if _element_of_parameter(body, add, k) == index]
    step = steps[0].constant_value if steps and steps[0] is not None else None
    first, last = start.constant_value, limit.constant_value
    if step != 1 or not isinstance(first, int) or not isinstance(last, int):
        return None
    return max(last - first, 0)


def parse_hlo(text: str) -> HloModule:
    """Parses one HLO module printed by XLA (`HloModule.to_string()`)."""
    lines = text.splitlines()
    name = ""
    if lines and lines[0].startswith("HloModule "):
        name = lines[0].split()[1].rstrip(",")
    frames = parse_stack_frames(lines)
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
    named = [ref.partition("#") for ref in _OPERAND_RE.findall(operand_text)]
    operands = tuple(ref for ref, _, _ in named)
    indices = tuple(int(i) if i.isdigit() else None for _, _, i in named)
    attrs = _parse_attrs(rest[close + 1:])
    result = tuple(ArrayType(dt, _dims(d)) for dt, d in _ARRAY_RE.findall(type_text))
    stack = _stack_of(attrs.get("metadata", ""), frames)
    return Instruction(name, opcode, result, type_text.startswith("("), operands, attrs,
                       computation, is_root, stack[0] if stack else None, stack,
                       operand_text.strip(), indices)


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


_BRACKETS = {"(": ")", "{": "}", "[": "]"}
_SPECIAL_RE = re.compile(r'[(){}\[\]"\\]')


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at `start`, skipping quoted strings.

    Jumps from one bracket, quote or backslash to the next (`re`), not char by char:
    metadata and backend configs make long lines."""
    stack: list[str] = []
    in_quote = False
    skip = -1
    for m in _SPECIAL_RE.finditer(text, start):
        i, ch = m.start(), m.group()
        if i <= skip:
            continue
        if in_quote:
            if ch == "\\":
                skip = i + 1
            elif ch == '"':
                in_quote = False
        elif ch == '"':
            in_quote = True
        elif ch in _BRACKETS:
            stack.append(_BRACKETS[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i
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


_QUOTE_END_RE = re.compile(r'(?:[^"\\]|\\.)*"', re.DOTALL)


def _end_quote(text: str, start: int) -> int:
    """Index of the quote closing the one at `start` (backslash escapes skipped)."""
    m = _QUOTE_END_RE.match(text, start + 1)
    return m.end() - 1 if m else len(text) - 1


def _dims(text: str) -> tuple[int, ...]:
    # Bounded dynamic dimensions print as `<=8`; keep the bound.
    return tuple(int(d.lstrip("<=?")) for d in text.split(",") if d.strip().lstrip("<=?"))


def _metadata_fields(metadata: str) -> dict[str, str]:
    """`{op_name="a b" source_line=3 stack_frame_id=7}` as a dict of unquoted values."""
    fields: dict[str, str] = {}
    text = metadata.strip()
    text = text[1:-1] if text.startswith("{") and text.endswith("}") else text
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] == " ":
            i += 1
        eq = text.find("=", i)
        if eq < 0:
            break
        key = text[i:eq].strip()
        if eq + 1 < n and text[eq + 1] == '"':
            end = _end_quote(text, eq + 1)
            fields[key] = _unquote(text[eq + 1:end + 1])
        else:
            end = text.find(" ", eq + 1)
            end = n if end < 0 else end
            fields[key] = text[eq + 1:end]
        i = end + 1
    return fields


def _stack_of(metadata: str, frames) -> tuple[SourceLocation, ...]:
    # Older XLA prints source_file/source_line inline (one frame); newer XLA names a frame.
    fields = _metadata_fields(metadata)
    frame = _int_or_none(fields.get("stack_frame_id", ""))
    if frame is not None and frames.get(frame):
        return frames[frame]
    line = _int_or_none(fields.get("source_line", ""))
    if fields.get("source_file") and line is not None:
        return (SourceLocation(fields["source_file"], line),)
    return ()


def _int_tuple(text: str) -> tuple[int, ...]:
    """`{0,1}` (or `0,1`) as (0, 1)."""
    return tuple(int(d) for d in text.strip().strip("{}").split(",") if d.strip())


def _int_or_none(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else None


def _window(text: str) -> dict[str, str]:
    """`{size=1x64x1 pad=0_0x63_0x0_0 stride=...}` as {"size": "1x64x1", ...}."""
    return dict(item.partition("=")[::2] for item in text.strip().strip("{}").split())


def _called_name(text: str) -> str | None:
    names = _OPERAND_RE.findall(text)
    return names[0] if names else (text.strip() or None)


def _element_of_parameter(comp: Computation, instr: Instruction, operand: int) -> int | None:
    """Which element of the computation's tuple parameter an operand is: a get-tuple-element
    of the parameter, or the parameter with an inline `#N` index (JAX 0.12's propagated dump)."""
    ref = comp.get(instr.operands[operand]) if operand < len(instr.operands) else None
    if ref is None:
        return None
    if ref.opcode == "parameter":
        return instr.operand_indices[operand] if operand < len(instr.operand_indices) else None
    if ref.opcode == "get-tuple-element" and ref.operands:
        source = comp.get(ref.operands[0])
        return ref.tuple_index if source is not None and source.opcode == "parameter" else None
    return None
