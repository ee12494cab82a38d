"""The memory peak, buffer by buffer: XLA's buffer assignment and live ranges, explained.

XLA schedules the step, simulates its heap and packs the temp buffers into one allocation:
buffers alive at different times share bytes. At the peak (the step of the schedule where
the buffers alive weigh most) each buffer alive accounts for its size. The temp allocation
is larger than what is alive at the peak by the bytes its packing leaves free there: those
bytes are kept for buffers alive at other times, and each free byte is counted once, for
the largest buffer that occupies it at another time (`alive` False). So the temp buffers
account for every byte of the temp allocation that any buffer uses, each once. Two entries
name the rest: `padding`, bytes of the allocation no buffer uses (buffers start at aligned
offsets, so small tuple buffers leave gaps; worded per platform), and `runtime`, temp the
executable counts beyond its buffer assignment (a TPU executable's 1 MiB HBM logging buffer).

Each buffer is named by the instruction that made it (its user's line and stack, its op
path, forward or backward), and, where it holds a collective's result or a value computed
from one within a few ops, by that collective and its cause: a gathered activation is then
seen holding memory at the peak.
"""

from __future__ import annotations

import bisect
import dataclasses

from ..parse import Allocation, HloModule, Instruction, LiveRanges, Slot
from ..._vocab import COLLECTIVE_KINDS, BufferRole, CollectiveKind
from ..._op_paths import is_backward, primitive_of
from .._model import Collective, PeakBuffer
from ..._source import Source, shown_frames, user_sources

_ROLES = (BufferRole.TEMP, BufferRole.ARGUMENT, BufferRole.OUTPUT, BufferRole.CONSTANT)
# The ops of temp no buffer holds: what the executable counts beyond its buffer assignment,
# and bytes of the temp allocation no buffer uses.
RUNTIME, PADDING = "runtime", "padding"
UNLISTED = (RUNTIME, PADDING)
# Ops a collective's value passes through unchanged on its way to a consumer.
_THROUGH = {"get-tuple-element", "bitcast", "copy", "reshape", "transpose", "convert",
            "all-gather-done", "all-to-all-done", "collective-permute-done", "async-done",
            "copy-start", "copy-done", "dynamic-slice", "slice"}
_HOPS = 2
# Why the temp allocation has bytes no buffer uses, per platform (`Analysis.platform`). Seen
# in the buffer assignments: XLA:CPU starts each buffer at a multiple of 64 bytes (16-byte
# tuple buffers 64 apart); the TPU compiler aligns small tuple buffers the same way.
_PADDING_WHY = {"cpu": "XLA:CPU places each buffer at a 64-byte-aligned offset",
                "tpu": "the TPU compiler places small buffers at aligned offsets"}
_MOVING = {CollectiveKind.ALL_GATHER, CollectiveKind.ALL_TO_ALL, CollectiveKind.RAGGED_ALL_TO_ALL,
           CollectiveKind.COLLECTIVE_PERMUTE, CollectiveKind.COLLECTIVE_BROADCAST}


def peak_buffers(allocations: tuple[Allocation, ...], live: LiveRanges, module: HloModule,
                 collectives: tuple[Collective, ...], temp_bytes: int | None = None,
                 platform: str = "") -> tuple[PeakBuffer, ...]:
    """The buffers at the peak, largest first (see the module docstring). `temp_bytes`:
    the executable's temp (`memory_analysis()`); where it exceeds the buffer assignment's
    (a TPU executable's 1 MiB HBM logging buffer and scratch), the rest is one entry.
    `platform` words the padding entry ("cpu", "tpu", ...)."""
    by_name = {i.name: i for i in module.instructions()}
    by_id = {c.id: c for c in collectives}
    found: list[PeakBuffer] = []
    assigned = sum(a.size for a in allocations if a.role == BufferRole.TEMP)
    if temp_bytes is not None and temp_bytes > assigned:
        found.append(_unlisted(RUNTIME, temp_bytes - assigned, "buffers the runtime keeps outside the "
                               "buffer assignment (a TPU executable's HBM logging buffer, scratch)"))
    for allocation in allocations:
        if allocation.role not in _ROLES:
            continue
        if allocation.role == BufferRole.TEMP:
            held = _painted(allocation, live)
            unused = allocation.size - sum(held.values())
            if unused > 0:
                why = _PADDING_WHY.get(platform, "XLA places buffers at aligned offsets")
                found.append(_unlisted(PADDING, unused, f"bytes of the temp allocation no buffer uses "
                                       f"(alignment: {why})"))
        else:
            held = {slot: slot.size for slot in allocation.slots if live.alive_at_peak(slot.value)}
        for slot, nbytes in held.items():
            if nbytes > 0:
                found.append(_buffer(slot, nbytes, allocation.role, live, by_name, by_id))
    return tuple(sorted(found, key=lambda b: (-b.bytes, b.value)))


def _unlisted(op: str, nbytes: int, what: str) -> PeakBuffer:
    """Temp that no buffer of the buffer assignment holds, as one entry that says why."""
    return PeakBuffer(value="", role=BufferRole.TEMP, bytes=nbytes, size=nbytes, alive=True, shape="", op=op,
                      op_path=what, source=None)


def _painted(allocation: Allocation, live: LiveRanges) -> dict[Slot, int]:
    """Bytes of the allocation per slot: those alive at the peak first, then the free
    bytes, each for the largest slot that covers it."""
    order = sorted(allocation.slots, key=lambda s: (not live.alive_at_peak(s.value), -s.size, s.offset))
    painted: list[tuple[int, int]] = []     # disjoint [start, end), sorted
    held: dict[Slot, int] = {}
    for slot in order:
        held[slot] = _paint(painted, slot.offset, slot.offset + slot.size)
    return held


def _paint(painted: list[tuple[int, int]], start: int, end: int) -> int:
    """Marks [start, end) painted; returns how many of its bytes were not painted yet."""
    fresh = 0
    i = bisect.bisect_left(painted, (start, start))
    if i > 0 and painted[i - 1][1] > start:
        i -= 1
    cursor, merged_start, merged_end, j = start, start, end, i
    while j < len(painted) and painted[j][0] < end:
        a, b = painted[j]
        fresh += max(0, a - cursor)
        cursor = max(cursor, b)
        merged_start, merged_end = min(merged_start, a), max(merged_end, b)
        j += 1
    fresh += max(0, end - cursor)
    painted[i:j] = [(merged_start, merged_end)]
    return fresh


def _buffer(slot: Slot, nbytes: int, role: BufferRole, live: LiveRanges, by_name, by_id) -> PeakBuffer:
    instr = by_name.get(slot.value.split("{", 1)[0])
    op_path = instr.op_name if instr is not None else ""
    stack = user_sources(instr.stack) if instr is not None else ()
    collective = _collective_behind(instr, by_name, by_id) if instr is not None else None
    op = ("parameter" if instr is not None and instr.opcode == "parameter"
          else primitive_of(op_path) or (instr.opcode if instr is not None else ""))
    return PeakBuffer(
        value=slot.value, role=role, bytes=nbytes, size=slot.size,
        alive=live.alive_at_peak(slot.value), shape=_shape_of(slot.shape), op=op, op_path=op_path,
        source=stack[0] if stack else None, stack=stack,
        backward=is_backward(op_path),
        collective=collective.id if collective else "", cause=collective.cause if collective else "")


def _collective_behind(instr: Instruction, by_name, by_id) -> Collective | None:
    """The collective whose result the value holds (through moves), or the gather or
    all-to-all it is computed from within `_HOPS` ops (the nearest). Partial sums that an
    all-reduce completes are everywhere downstream of it and name nothing."""
    frontier, seen = [(instr, 0)], {instr.name}
    while frontier:
        node, hops = frontier.pop(0)
        base = node.opcode.removesuffix("-start").removesuffix("-done")
        if base in COLLECTIVE_KINDS and (hops == 0 or base in _MOVING):
            start = node if not node.opcode.endswith("-done") else by_name.get(node.operands[0])
            found = by_id.get(start.name if start is not None else node.name)
            if found is not None:
                return found
        step = 0 if node.opcode in _THROUGH else 1
        if hops + step > _HOPS:
            continue
        for name in node.operands:
            operand = by_name.get(name)
            if operand is not None and operand.name not in seen and operand.opcode != "parameter":
                seen.add(operand.name)
                frontier.append((operand, hops + step))
    return None


def _shape_of(text: str) -> str:
    """`f32[512,64]{1,0}` -> `f32[512,64]` (the layout is XLA's business)."""
    out, depth = [], 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeakLine:
    """The buffers one line of the user's made, at the peak: what a sweep follows from point
    to point (by line and role: XLA may fuse the line's ops otherwise at another point)."""

    where: tuple                 # (the user's line, role)
    source: Source | None        # the user's line (past helpers shared by several callers)
    via: Source | None           # the innermost frame, where a helper stands between
    op: str                      # the op of its largest buffer
    role: BufferRole
    bytes: int
    free: int                    # of `bytes`, slots free at the peak (kept for these buffers)
    buffers: int
    shape: str                   # the largest buffer's
    backward: bool               # the largest buffer's
    collective: str = ""         # the first collective behind any of them, and its cause
    cause: str = ""

    @property
    def name(self) -> str:
        """XLA's op name for the values where no source line made them (JAX names a copy of an
        argument after it: `x_BSD`): such lines are grouped by it."""
        return "" if self.source else self.where[0]


def unsourced(line) -> str:
    """How a line that no source line made is shown: by XLA's name for its values (JAX names
    a copy of an argument after the argument: `x_BSD`), or, for padding and the runtime's
    own, by what those are."""
    return f"{line.name or line.role} (no source line)"


def peak_lines(buffers: tuple[PeakBuffer, ...], role: BufferRole | None = BufferRole.TEMP,
               helpers: frozenset = frozenset()) -> tuple[PeakLine, ...]:
    """`buffers` grouped by the user's line (past `helpers`, `_frames.helper_frames`) and
    role (only `role`'s, unless None), largest first."""
    groups: dict[tuple, list[PeakBuffer]] = {}
    users: dict[tuple, Source | None] = {}
    for b in buffers:
        if role is None or b.role == role:
            user = shown_frames(b.stack, helpers, b.source)[0] if (b.stack or b.source) else None
            key = (str(user) if user else b.op_path, b.role)
            groups.setdefault(key, []).append(b)
            users[key] = user
    lines = []
    for where, members in groups.items():
        top = max(members, key=lambda b: b.bytes)
        behind = next((b for b in members if b.collective), None)
        user = users[where]
        lines.append(PeakLine(where=where, source=user, via=top.source if top.source != user else None,
                              op=top.op, role=top.role, bytes=sum(b.bytes for b in members),
                              free=sum(b.bytes for b in members if not b.alive), buffers=len(members),
                              shape=top.shape, backward=top.backward,
                              collective=behind.collective if behind else "",
                              cause=behind.cause if behind else ""))
    return tuple(sorted(lines, key=lambda line: (-line.bytes, str(line.where))))
