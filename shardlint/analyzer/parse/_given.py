"""What a dumped module says about the mesh the step ran on.

A live analysis knows the mesh from the traced step. Reading a dump, it comes from the
module XLA was given (`before_optimizations`), as JAX lowered it: Shardy modules carry it
as `frontend_attributes={xla.sdy.meshes={mesh = #sdy.mesh<["data"=2, "context"=4]>}}` on
the module line (JAX 0.10), or only in the StableHLO the compiler was given, `sdy.mesh
@mesh = <["data"=2, "context"=4]>` (JAX 0.12). A GSPMD module names no axes; then the mesh
it ran on must be given (`--mesh`). Which arguments are weights needs no more than the
partitioned module (`_dataflow`).
"""

from __future__ import annotations

import re

import numpy as np

from ..._errors import AnalysisError
from ._devices import MeshInfo

_MESH_RE = re.compile(r'sdy\.mesh(?:\s+@[\w.]+\s*=\s*)?<\[([^\]]*)\]')
_AXIS_RE = re.compile(r'\\?"([^"\\]+)\\?"\s*=\s*(\d+)')
_PARTITIONS_RE = re.compile(r"\bnum_partitions=(\d+)")


def mesh_of_module(header: str, stablehlo: str | None = None,
                   given: dict[str, int] | None = None) -> MeshInfo:
    """The mesh of a module from its first line (`HloModule ...`) or the StableHLO it was
    lowered from; `given` (from `--mesh`) is used when neither names one, and must agree
    with it when they do."""
    partitions = _PARTITIONS_RE.search(header)
    devices = int(partitions.group(1)) if partitions else 1
    meshes = [tuple((name, int(size)) for name, size in _AXIS_RE.findall(m))
              for m in _MESH_RE.findall(header + "\n" + (stablehlo or ""))]
    named = max((m for m in meshes if m and np.prod([s for _, s in m]) == devices),
                key=len, default=None)
    if given is not None:
        if named is not None and dict(named) != dict(given):
            raise AnalysisError(f"--mesh {_text(given)} disagrees with the module's own mesh "
                                f"{_text(dict(named))}; drop --mesh")
        if int(np.prod(list(given.values()))) != devices:
            raise AnalysisError(f"--mesh {_text(given)} has {int(np.prod(list(given.values())))} "
                                f"devices; the module was partitioned for {devices}")
        return MeshInfo(tuple(given), tuple(given.values()))
    if named is None:
        if devices == 1:
            return MeshInfo((), ())
        raise AnalysisError(f"the module names no mesh axes (GSPMD writes device lists only) "
                            f"over its {devices} devices: give the mesh it was compiled on, e.g. "
                            f"--mesh data=2,context={max(devices // 2, 1)}")
    return MeshInfo(tuple(n for n, _ in named), tuple(s for _, s in named))


def _text(axes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items())
