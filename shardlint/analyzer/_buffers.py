"""Per-device memory from XLA's buffer assignment, as a dump folder holds it.

A live compile asks the executable (`memory_analysis()`); a dump folder has the text XLA
wrote for the same numbers, `*after_optimizations-buffer-assignment.txt`: one line per
allocation, `allocation 3: size 8192, parameter 1, shape |f32[4,16,32]| at ShapeIndex {}:`
with flags such as `maybe-live-out`, `preallocated-temp`, `thread-local`, `constant` and
`color N` (a memory space other than the default one: TPU VMEM, SMEM, ...).

The sums follow `memory_analysis()`: arguments are the entry parameters' allocations,
outputs the live-out ones, aliases the parameters that are also live out (donated
buffers, counted in both), temp the preallocated temp of the default memory space. On XLA:CPU they equal
`memory_analysis()` to the byte (tests/analyzer/test_dump.py); a TPU executable also counts
scratch that the buffer assignment does not list, so its temp reads higher live.
"""

from __future__ import annotations

import re

from .._errors import AnalysisError
from ._model import Memory

_ALLOCATION_RE = re.compile(r"allocation (\d+): size (\d+)(?:, (.*))?:\s*$")


def memory_of_buffer_assignment(text: str, where: str = "the buffer assignment") -> Memory:
    """The `Memory` record of one buffer-assignment dump (no peak, no flops: the dump
    has neither)."""
    arguments = outputs = temp = aliases = 0
    seen = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("allocation "):
            continue
        m = _ALLOCATION_RE.match(line)
        if m is None:
            raise AnalysisError(f"{where}, line {number}: not an allocation line XLA writes: "
                                f"{line[:120]!r}")
        seen += 1
        size, flags = int(m.group(2)), _flags(m.group(3) or "")
        if "color" in flags:
            continue  # another memory space (TPU VMEM, SMEM, semaphores)
        live_out = "maybe-live-out" in flags
        outputs += size if live_out else 0
        if "parameter" in flags:
            arguments += size
            aliases += size if live_out else 0
        elif "preallocated-temp" in flags:
            temp += size
    if not seen:
        raise AnalysisError(f"{where} lists no allocation: is it a buffer-assignment dump?")
    return Memory(argument_bytes=arguments, output_bytes=outputs, temp_bytes=temp,
                  alias_bytes=aliases, peak_bytes=None, flops=None)


def _flags(text: str) -> set[str]:
    """`parameter 1, shape |f32[4]| at ShapeIndex {}, maybe-live-out` -> the flag words."""
    text = re.sub(r"\|[^|]*\|", "", text)  # shapes can hold commas
    return {part.strip().split(" ", 1)[0] for part in text.split(",") if part.strip()}
