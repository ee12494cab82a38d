"""Lower and compile a step once, keeping everything XLA tells us about it.

One compile yields all the analysis reads: the HLO right after sharding propagation
(XLA's own propagated shardings, from a per-compile dump into a temporary folder that is
removed afterwards), the partitioned and optimised HLO with every collective,
`memory_analysis()` and `cost_analysis()`. The dump is restricted to the propagation pass
so the overhead over a bare compile stays small (see benchmarks/analysis_overhead.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import tempfile
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from .._errors import AnalysisError
from ._devices import MeshInfo
from ._jaxpr import grouped_matmul_sources
from ._stablehlo import Asked, asked_for
from ._topology import check_libtpu, topology_of

# Shardy exports its result to HLO as `after_shardy-xla`; GSPMD's pass is
# `sharding-propagation` (run more than once; the last run is XLA's final answer).
_PROPAGATION_PASSES = "shardy-xla|sharding-propagation"


@dataclasses.dataclass(frozen=True)
class Compiled:
    propagated_hlo: str | None
    partitioned_hlo: str
    mesh: MeshInfo
    memory: Any
    cost: dict
    partitioner: str
    platform: str
    grouped_matmul_sources: frozenset
    asked: tuple[Asked, ...] = ()
    topology: str | None = None      # TPU topology of compile-only devices (libtpu AOT)


def mesh_of(args) -> Any:
    """The one mesh all NamedSharding arguments share; raises when they disagree."""
    meshes = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(args):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            meshes.setdefault((tuple(sharding.mesh.axis_names), sharding.mesh.devices.shape),
                              (sharding.mesh, jax.tree_util.keystr(path)))
    if not meshes:
        raise AnalysisError(
            "no argument carries a NamedSharding: pass arrays or jax.ShapeDtypeStruct(shape, "
            "dtype, sharding=NamedSharding(mesh, spec)) so the step is compiled on a mesh")
    if len(meshes) > 1:
        seen = "; ".join(f"{k[0]}={k[1]} (first at args{p})" for k, (_, p) in meshes.items())
        raise AnalysisError(f"arguments use different meshes: {seen}; use one mesh for all")
    return next(iter(meshes.values()))[0]


def compile_step(fn: Callable, args: tuple, mesh=None, progress=None) -> Compiled:
    mesh = mesh if mesh is not None else mesh_of(args)
    info = MeshInfo.from_mesh(mesh)
    topology = topology_of(mesh.devices.flat)
    if topology is not None:
        check_libtpu()  # a mismatched libtpu fails inside the compiler with a RET_CHECK
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    dump_dir = tempfile.mkdtemp(prefix="shardlint-")
    try:
        with _mesh_context(mesh):
            try:
                traced = jitted.trace(*args)
                lowered = traced.lower()
                asked = asked_for(lowered.compiler_ir("stablehlo"))
            except Exception as e:  # the user's code raised while tracing
                raise AnalysisError(f"tracing the step failed: {type(e).__name__}: {e}") from e
            if progress:
                progress(f"compiling for {info.num_devices} devices on mesh {info.as_dict()}"
                         + (f" with the TPU compiler for {topology}" if topology else ""))
            try:
                compiled = lowered.compile(compiler_options={
                    "xla_dump_to": dump_dir, "xla_dump_hlo_pass_re": _PROPAGATION_PASSES})
            except Exception as e:
                raise AnalysisError(f"XLA could not compile the step on mesh "
                                    f"{info.as_dict()}: {type(e).__name__}: {e}") from e
        propagated = _read_propagated(dump_dir, info.num_devices)
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jaxlib returns one dict per program
        cost = cost[0] if cost else {}
    return Compiled(
        propagated_hlo=propagated,
        partitioned_hlo=compiled.as_text(),
        mesh=info,
        memory=compiled.memory_analysis(),
        cost=dict(cost or {}),
        partitioner="shardy" if jax.config.jax_use_shardy_partitioner else "gspmd",
        platform=mesh.devices.flat[0].platform,
        grouped_matmul_sources=grouped_matmul_sources(traced.jaxpr),
        asked=asked,
        topology=topology,
    )


def _mesh_context(mesh):
    # Code that names PartitionSpecs without a mesh (with_sharding_constraint(x, P(...)))
    # needs the mesh in context, as it has in the user's own training loop.
    set_mesh = getattr(jax, "set_mesh", None)
    return set_mesh(mesh) if set_mesh is not None else contextlib.nullcontext()


def _read_propagated(dump_dir: str, num_devices: int) -> str | None:
    """The HLO text after the last sharding-propagation pass of the first module."""
    files = sorted(f for f in os.listdir(dump_dir)
                   if f.endswith(".txt") and re.search(r"after_(shardy-xla|sharding-propagation)\.", f))
    if not files and num_devices == 1:
        return None  # one device: XLA does not partition, nothing can be lost
    if not files:
        raise AnalysisError(
            "XLA wrote no module after sharding propagation; is the step sharded over more "
            f"than one device? (dump: {sorted(os.listdir(dump_dir))[:5]})")
    first_module = files[0].split(".")[0]
    mine = [f for f in files if f.startswith(first_module + ".")]
    with open(os.path.join(dump_dir, mine[-1])) as fh:
        return fh.read()
