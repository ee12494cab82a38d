"""Memory across a sweep: which lines hold what does not shrink as a degree grows.

A sweep analyzes the step at several values of one knob (a mesh axis, or a target option
such as MaxText's `ici_context_parallelism`). Each point's temp is set against its *ideal*:
the first point's temp spread over the point's devices (a mesh N times larger: 1/N; the
same devices with context traded for FSDP, as MaxText's `ici_fsdp_parallelism=-1` does:
flat, since each device holds as many tokens). Each line's buffers at the peak (`peak_lines`: the user's source
line, past helpers shared by several callers, and role) are followed from point to point and classed by how their bytes scale
with the swept value: `shrinks` (towards 1/N of the first point), `flat` or `grows`. What a
line holds at the last point beyond its first point's bytes scaled to the ideal is its
excess; the lines with the largest excesses explain the last point's temp above its ideal.
"""

from __future__ import annotations

import dataclasses
import math

from ..._format import human_bytes
from ..._source import Source
from .._model import Analysis
from ._frames import helper_frames
from ._peak import peak_lines, unsourced

# log(bytes ratio) / log(value ratio): at or below -0.5 a line shrinks, at or above 0.2 it grows.
_SHRINKS, _GROWS = -0.5, 0.2
# A line is listed when its excess is at least this share of the excess above the ideal.
_LISTED_SHARE = 0.02
_MOST_LISTED = 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaledLine:
    source: Source | None        # the user's line
    via: Source | None           # the helper frame it went through, if any
    name: str                    # XLA's op name where no source line is known
    op: str
    role: str
    bytes: tuple[int, ...]       # at each point (0 where the line holds nothing)
    scaling: str                 # shrinks, flat or grows
    excess: int                  # at the last point, above its first point's bytes scaled to the ideal


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryScaling:
    key: str                     # what was swept: a mesh axis or a target option
    values: tuple[int, ...]
    temp: tuple[int, ...]        # temp per device at each point
    ideal: tuple[int, ...]       # the first point's temp spread over each point's devices
    lines: tuple[ScaledLine, ...]   # every line, by excess (largest first)
    listed: int                  # how many of `lines` explain the excess (the headline's)
    # The listed lines' excess over the last point's temp above its ideal. Above 1 where
    # other lines fall below their ideal (they offset `offset` bytes of it).
    above_ideal_explained: float | None
    offset: int = 0              # bytes the lines below their ideal hold less than it

    @property
    def excess(self) -> int:
        return self.temp[-1] - self.ideal[-1]

    def headline(self) -> str:
        last = f"{self.key} {self.values[-1]}: temp {human_bytes(self.temp[-1])}, ideal {human_bytes(self.ideal[-1])}"
        if self.excess <= 0.05 * self.ideal[-1] or not self.listed:
            return f"{last}; temp follows its ideal"
        shown = self.lines[:self.listed]
        held = sum(line.excess for line in shown)
        where = "; ".join(f"{line.source or unsourced(line)} {line.op} ({line.scaling}, +{human_bytes(line.excess)})"
                          for line in shown[:3])
        more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
        return (f"{last}; {len(shown)} line(s) hold {human_bytes(held)} that does not shrink: "
                f"{where}{more}")


def memory_scaling(key: str, values: tuple[int, ...], analyses: list[Analysis]) -> MemoryScaling:
    """The sweep's memory, point by point (`analyses` in the order of `values`)."""
    temps = tuple(a.memory.temp_bytes for a in analyses)
    devices = [math.prod(a.mesh.values()) for a in analyses]
    ratios = [devices[0] / n for n in devices]
    ideal = tuple(round(temps[0] * r) for r in ratios)
    helpers = frozenset().union(*(helper_frames(a) for a in analyses))
    per_point = [{line.where: line for line in peak_lines(a.memory.peak_buffers, helpers=helpers)}
                 for a in analyses]
    wheres = list(dict.fromkeys(w for point in per_point for w in point))
    lines = []
    for where in wheres:
        held = tuple(point[where].bytes if where in point else 0 for point in per_point)
        sample = next(point[where] for point in per_point if where in point)
        lines.append(ScaledLine(source=sample.source, via=sample.via, name=sample.name, op=sample.op, role=sample.role, bytes=held,
                                scaling=_scaling(held, values),
                                excess=held[-1] - round(held[0] * ratios[-1])))
    lines.sort(key=lambda line: (-line.excess, str(line.source)))
    excess = temps[-1] - ideal[-1]
    listed = [line for line in lines[:_MOST_LISTED]
              if line.excess > 0 and excess > 0 and line.excess >= _LISTED_SHARE * excess]
    explained = (sum(line.excess for line in listed) / excess) if excess > 0 else None
    return MemoryScaling(key=key, values=tuple(values), temp=temps, ideal=ideal, lines=tuple(lines),
                         listed=len(listed), above_ideal_explained=explained,
                         offset=-sum(line.excess for line in lines if line.excess < 0))


def _scaling(held: tuple[int, ...], values: tuple[int, ...]) -> str:
    first, last = held[0], held[-1]
    if not first:
        return "grows" if last else "flat"
    if not last:
        return "shrinks"
    span = math.log(values[-1] / values[0])
    slope = math.log(last / first) / span if span else 0.0
    return "shrinks" if slope <= _SHRINKS else "grows" if slope >= _GROWS else "flat"
