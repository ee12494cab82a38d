"""XLA's live ranges, as `--xla_dump_buffer_assignment_analysis` writes them: the one
parser of `*after_optimizations-live-range.txt`.

    HloLiveRange (max 90):
      InstructionSequence:
        0:partition-id
        ...
      BufferLiveRange:
        wrapped_copy{}:16-23
        custom-call{1}:27-33
      Live ranges at 62 (peak):
        broadcast_select_fusion.2{}: 262144 bytes (cumulative: 262144 bytes)
        ...
      Stack trace breakdown for peak usage: 799 532 bytes
        ...

The schedule is a sequence of instructions; each value lives from the step that defines it
to its last use. The peak is the step where the values alive weigh most (XLA's own heap
simulation, which `memory_analysis().peak_memory_in_bytes` reports on TPU). The text is
read only as far as the peak needs: the instruction sequence and the stack-trace breakdown
after the peak are skipped.
"""

from __future__ import annotations

import dataclasses
import re

from ..._errors import AnalysisError
from ._buffers import value_name

_RANGE_RE = re.compile(r"\s+(\S+):(\d+)-(\d+)\s*$")
_PEAK_RE = re.compile(r"\s+Live ranges at (\d+) \(peak\):\s*$")
_LIVE_RE = re.compile(r"\s+(\S+): (\d+) bytes")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LiveRanges:
    peak_time: int
    peak: dict[str, int]                  # value -> bytes, the values alive at the peak
    ranges: dict[str, tuple[int, int]]    # value -> (first step, last step) it is alive

    def alive_at_peak(self, value: str) -> bool:
        first, last = self.ranges.get(value, (-1, -1))
        return value in self.peak or first <= self.peak_time <= last


def parse_live_range(text: str, where: str = "the live-range dump") -> LiveRanges:
    ranges: dict[str, tuple[int, int]] = {}
    peak: dict[str, int] = {}
    peak_time = None
    section = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "BufferLiveRange:":
            section = "ranges"
        elif stripped.startswith("InstructionSequence"):
            section = "sequence"
        elif (m := _PEAK_RE.match(line)) is not None:
            section, peak_time = "peak", int(m.group(1))
        elif stripped.startswith("Stack trace breakdown") or (section == "peak" and not stripped):
            break
        elif section == "ranges" and (m := _RANGE_RE.match(line)) is not None:
            ranges[value_name(m.group(1))] = (int(m.group(2)), int(m.group(3)))
        elif section == "peak" and (m := _LIVE_RE.match(line)) is not None:
            peak[value_name(m.group(1))] = int(m.group(2))
    if peak_time is None:
        raise AnalysisError(f"{where} has no 'Live ranges at T (peak):' section: is it XLA's "
                            f"live-range dump (--xla_dump_buffer_assignment_analysis)?")
    return LiveRanges(peak_time=peak_time, peak=peak, ranges=ranges)
