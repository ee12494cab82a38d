"""Would the step fit? A device's memory need against a limit: `--hbm-gib`, or the chip's
published HBM for a TPU topology.

The HBM per chip is a table of the published figures; the need is read only from the
compiler's memory analysis.
"""

from __future__ import annotations

import dataclasses

from ..._format import human_bytes
from .._model import NoFit
from ..compile import TopologyError

# Published HBM per chip, in GiB, by the chip name a topology starts with.
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}


def hbm_gib(topology: str | None) -> float | None:
    """Published HBM per chip of the topology's chip, or None where unknown."""
    if not topology:
        return None
    return HBM_GIB.get(topology.split(":")[0].strip().lower())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fit:
    """Whether one device's arguments, outputs and temporaries fit in its memory."""

    need_bytes: int
    limit_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int | None
    where: str                   # "v5p HBM per chip" or "--hbm-gib 16"
    refused: NoFit | None = None     # the compiler refused the step for lack of memory

    @property
    def fits(self) -> bool:
        return self.refused is None and self.need_bytes <= self.limit_bytes

    def line(self) -> str:
        if self.refused is not None:
            figures = (f": needs {human_bytes(self.refused.needed_bytes)} of temporaries > "
                       f"{human_bytes(self.refused.available_bytes)} available"
                       if self.refused.needed_bytes is not None else f" ({self.refused.message})")
            return (f"does not fit: the compiler refused the step for lack of memory{figures} "
                    f"(its own figures); its buffer assignment holds arguments "
                    f"{human_bytes(self.argument_bytes)} + outputs {human_bytes(self.output_bytes)} "
                    f"+ temp {human_bytes(self.temp_bytes)} per device")
        parts = (f"arguments {human_bytes(self.argument_bytes)} + outputs {human_bytes(self.output_bytes)} "
                 f"+ temp {human_bytes(self.temp_bytes)}")
        if self.alias_bytes:
            parts += f" - aliased {human_bytes(self.alias_bytes)}"
        parts += f" = {human_bytes(self._sum)}"
        if self.peak_bytes:
            parts += f"; compiler's peak {human_bytes(self.peak_bytes)}"
        verdict, sign = ("fits", "<=") if self.fits else ("would not fit", ">")
        return (f"{verdict}: needs {human_bytes(self.need_bytes)} per device {sign} "
                f"{human_bytes(self.limit_bytes)} ({self.where}): {parts}")

    @property
    def _sum(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def memory_fit(memory, limit_gib: float, where: str = "") -> Fit:
    """Checks `Analysis.memory` against `limit_gib` GiB per device.

    The need is arguments + outputs + temp (outputs that alias donated arguments counted
    once) or the compiler's peak, whichever is larger: the v4 and v5e compilers report
    (almost) no temp and put the temporaries in the peak only (measured: v4 temp 0 B,
    peak 42 MiB for a step whose v5p temp is 31 MiB).
    """
    total = memory.argument_bytes + memory.output_bytes + memory.temp_bytes - memory.alias_bytes
    need = max(total, memory.peak_bytes or 0)
    return Fit(need_bytes=need, limit_bytes=int(limit_gib * 2**30), argument_bytes=memory.argument_bytes,
               output_bytes=memory.output_bytes, temp_bytes=memory.temp_bytes,
               alias_bytes=memory.alias_bytes, peak_bytes=memory.peak_bytes,
               where=where or f"{limit_gib:g} GiB")


def fit_of(analysis, limit_gib: float | None = None) -> Fit | None:
    """The fit of an analysis against `limit_gib`, else its chip's HBM; None if neither.
    A step the compiler refused for lack of memory does not fit, whatever the limit."""
    if analysis.does_not_fit is not None:
        refused = analysis.does_not_fit
        fit = memory_fit(analysis.memory, limit_gib or hbm_gib(analysis.topology) or 0, "the compiler")
        return dataclasses.replace(fit, refused=refused, need_bytes=refused.needed_bytes or fit.need_bytes,
                                   limit_bytes=refused.available_bytes or fit.limit_bytes)
    if limit_gib is not None:
        if limit_gib <= 0:
            raise TopologyError(f"--hbm-gib must be > 0, got {limit_gib:g}")
        return memory_fit(analysis.memory, limit_gib, f"--hbm-gib {limit_gib:g}")
    known = hbm_gib(analysis.topology)
    if known is None:
        return None
    chip = analysis.topology.split(":")[0]
    return memory_fit(analysis.memory, known, f"{chip} HBM per chip")
