"""XLA's buffer assignment, as `--xla_dump_to` writes it: the one parser of that text.

`*after_optimizations-buffer-assignment.txt` holds one block per allocation:

    allocation 78: size 1010328, preallocated-temp:
     value: <542 copy_bitcast_fusion.5 @0> (size=131072,offset=0): f32[512,64]{1,0}
     value: <578 all-reduce.5{} @0> (size=24,offset=1010304): (f32[], f32[4,16]{1,0})

with flags such as `parameter 1`, `maybe-live-out`, `preallocated-temp`, `thread-local`,
`constant` and `color N` (a memory space other than the default one: TPU VMEM, SMEM, ...).
Each value is an instruction's result (or one element of a tuple result, `name{1}`) placed
at an offset; values whose lives do not overlap share bytes, so an allocation is smaller
than the sum of what it holds.

`Memory` sums follow `memory_analysis()`: arguments are the entry parameters'
allocations, outputs the live-out ones, aliases the parameters that are also live out
(donated buffers, counted in both), temp the preallocated temp of the default memory space.
On XLA:CPU they equal `memory_analysis()` to the byte (tests/analyzer/test_dump.py); a TPU
executable also counts scratch that the buffer assignment does not list, so its temp reads
higher live.
"""

from __future__ import annotations

import dataclasses
import re

from ..._errors import AnalysisError
from ..._vocab import BufferRole
from .._model import Memory

_ALLOCATION_RE = re.compile(r"allocation (\d+): size (\d+)(?:, (.*))?:\s*$")
# `<1105 wide.param.2{3} (phi) @0>`: a loop's phi values carry a marker after the name.
_VALUE_RE = re.compile(r"\s*value: <\d+ (\S+)[^@>]*@\d+> \(size=(\d+),offset=(\d+)\): (.*)$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slot:
    """One value placed in an allocation: `value` is the instruction's name, with the
    tuple element (`custom-call{1}`) where the result is a tuple's element."""

    value: str
    size: int
    offset: int
    shape: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Allocation:
    number: int
    size: int
    flags: frozenset[str]
    slots: tuple[Slot, ...]

    @property
    def role(self) -> BufferRole:
        """argument, output, temp, constant or other (thread-local scratch, another memory
        space)."""
        if "color" in self.flags:
            return "other"
        if "parameter" in self.flags:
            return BufferRole.ARGUMENT
        if "maybe-live-out" in self.flags:
            return BufferRole.OUTPUT
        if "preallocated-temp" in self.flags:
            return BufferRole.TEMP
        return BufferRole.CONSTANT if "constant" in self.flags else BufferRole.OTHER


def parse_buffer_assignment(text: str, where: str = "the buffer assignment") -> tuple[Allocation, ...]:
    """Every allocation with the values placed in it."""
    allocations: list[Allocation] = []
    head: tuple[int, int, frozenset[str]] | None = None
    slots: list[Slot] = []

    def close() -> None:
        if head is not None:
            number, size, flags = head
            allocations.append(Allocation(number=number, size=size, flags=flags, slots=tuple(slots)))

    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("allocation "):
            m = _ALLOCATION_RE.match(line)
            if m is None:
                raise AnalysisError(f"{where}, line {number}: not an allocation line XLA writes: "
                                    f"{line[:120]!r}")
            close()
            head, slots = (int(m.group(1)), int(m.group(2)), _flags(m.group(3) or "")), []
        elif head is not None and line.startswith(" value: "):
            v = _VALUE_RE.match(line)
            if v is None:
                raise AnalysisError(f"{where}, line {number}: not a value line XLA writes: "
                                    f"{line[:120]!r}")
            slots.append(Slot(value=value_name(v.group(1)), size=int(v.group(2)), offset=int(v.group(3)),
                              shape=v.group(4)))
        elif line and not line.startswith(" "):
            close()
            head = None
    close()
    if not allocations:
        raise AnalysisError(f"{where} lists no allocation: is it a buffer-assignment dump?")
    return tuple(allocations)


def memory_of_buffer_assignment(text: str, where: str = "the buffer assignment") -> Memory:
    """The `Memory` record of one buffer-assignment dump (no peak, no flops: the dump
    has neither)."""
    arguments = outputs = temp = aliases = 0
    for a in parse_buffer_assignment(text, where):
        if "color" in a.flags:
            continue  # another memory space (TPU VMEM, SMEM, semaphores)
        live_out = "maybe-live-out" in a.flags
        outputs += a.size if live_out else 0
        if "parameter" in a.flags:
            arguments += a.size
            aliases += a.size if live_out else 0
        elif "preallocated-temp" in a.flags:
            temp += a.size
    return Memory(argument_bytes=arguments, output_bytes=outputs, temp_bytes=temp,
                  alias_bytes=aliases, peak_bytes=None, flops=None)


def value_name(text: str) -> str:
    """`broadcast.3{}` -> `broadcast.3`; a tuple element keeps its index, `sort.17{1}`."""
    return text[:-2] if text.endswith("{}") else text


def _flags(text: str) -> frozenset[str]:
    """`parameter 1, shape |f32[4]| at ShapeIndex {}, maybe-live-out` -> the flag words."""
    text = re.sub(r"\|[^|]*\|", "", text)  # shapes can hold commas
    return frozenset(part.strip().split(" ", 1)[0] for part in text.split(",") if part.strip())
