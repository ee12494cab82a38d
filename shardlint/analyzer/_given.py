"""What a dumped module says about the step it came from: its mesh and its arguments.

A live analysis knows the mesh and which arguments hold parameters from the traced step.
Reading a dump, the same facts come from the module XLA was given
(`before_optimizations`), as JAX lowered it:

- the mesh: Shardy modules carry it as `frontend_attributes={xla.sdy.meshes={mesh =
  #sdy.mesh<["data"=2, "context"=4]>}}` on the module line (JAX 0.10), or only in the
  StableHLO the compiler was given, `sdy.mesh @mesh = <["data"=2, "context"=4]>` (JAX
  0.12). A GSPMD module names no axes; then the mesh it ran on must be given (`--mesh`).
- the arguments: each entry parameter's `op_name` is the argument's path as JAX named it
  (`params['w_in']`, `state.opt_state[0].mu['w']`, `x_BSD`); grouped by their leading name
  they are the step's positional arguments, and `parameter_argnums` tells parameters from
  the batch as it does live.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from .._errors import AnalysisError
from ._compile import parameter_argnums
from ._dataflow import DATA, WEIGHTS
from ._devices import MeshInfo
from ._hlo import HloModule

_MESH_RE = re.compile(r'sdy\.mesh(?:\s+@[\w.]+\s*=\s*)?<\[([^\]]*)\]')
_AXIS_RE = re.compile(r'\\?"([^"\\]+)\\?"\s*=\s*(\d+)')
_PARTITIONS_RE = re.compile(r"\bnum_partitions=(\d+)")
_ARGUMENT_RE = re.compile(r"^[A-Za-z_]\w*(?:\[\d+\])?")
# HLO element types -> numpy names, for the float test `parameter_argnums` makes.
_FLOATS = {"f16": "float16", "bf16": "float32", "f32": "float32", "f64": "float64"}


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


def entry_marks_of_module(given: HloModule | None) -> dict[int, int]:
    """Entry parameter number -> DATA or WEIGHTS, by the argument JAX named it after.
    Without names every parameter is data (a false finding rather than a hidden one)."""
    if given is None:
        return {}
    entry = given.entry
    parameters = [i for i in entry.instructions if i.opcode == "parameter"
                  and i.parameter_number is not None]
    groups: dict[str, list] = {}
    for p in sorted(parameters, key=lambda i: i.parameter_number):
        m = _ARGUMENT_RE.match(p.op_name)
        if m is None:
            return {}  # unnamed parameters: nothing to group by
        groups.setdefault(m.group(0), []).append(p)
    leaves_per_arg = [[_leaf(p.result[0]) for p in members if p.result] for members in groups.values()]
    root = entry.root
    outputs = [_leaf(a) for a in root.result] if root is not None else []
    weights = set(parameter_argnums(leaves_per_arg, outputs))
    return {p.parameter_number: WEIGHTS if index in weights else DATA
            for index, members in enumerate(groups.values()) for p in members}


def _leaf(array) -> SimpleNamespace:
    return SimpleNamespace(shape=array.dims, dtype=np.dtype(_FLOATS.get(array.dtype, "int32")))


def _text(axes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items())
