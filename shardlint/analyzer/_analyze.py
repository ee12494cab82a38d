"""`analyze(fn, *args)`: lower, compile, parse, graph, explain; one compile, one result."""

from __future__ import annotations

from typing import Callable

import jax
import jaxlib

from ._causes import explain
from ._collectives import collectives_of
from ._compile import compile_step
from ._dataflow import input_marks
from ._detect import find_lost_sharding
from ._graph import build_graph
from ._hlo import parse_hlo
from ._model import Analysis, Memory
from ._topology import libtpu_version


def analyze(fn: Callable, *args, mesh=None, params_argnums: tuple[int, ...] | None = None,
            progress: Callable[[str], None] | None = None) -> Analysis:
    """Analyzes the step `fn(*args)` on the mesh its arguments' NamedShardings name.

    Arguments are arrays or `jax.ShapeDtypeStruct`s carrying `NamedSharding`s; nothing is
    executed. `fn` may be a plain function, a `jax.jit` (its shardings and donation are
    kept) or an `nnx.jit` step. Returns every collective of the partitioned program with
    its cause, the findings (activations gathered over an axis that sharded them, nobody
    asking), what the user asked for, and per-device memory.

    `params_argnums` names the positional arguments that hold parameters (and optimizer
    state): gathers of values derived from them alone are `weights`. By default they are
    the arguments, but the last, that the step returns with the same shapes.
    """
    compiled = compile_step(fn, args, mesh=mesh, progress=progress, params_argnums=params_argnums)
    if progress:
        progress("reading XLA's propagated shardings and collectives")
    partitioned = parse_hlo(compiled.partitioned_hlo)
    collectives = collectives_of(partitioned, compiled.mesh)
    marks = input_marks(partitioned, compiled.entry_marks)
    drops, requested, graph = (), (), None
    if compiled.propagated_hlo is not None:
        graph = build_graph(parse_hlo(compiled.propagated_hlo), compiled.mesh,
                            compiled.grouped_matmul_sources)
        asked_lines = frozenset(
            (a.file, a.line) for a in compiled.asked if a.op in ("sharding_constraint", "reshard"))
        drops, requested, collectives = find_lost_sharding(graph, compiled.mesh, collectives,
                                                           asked_lines)
    collectives, findings, requested = explain(
        collectives, partitioned, marks, drops, requested, compiled.asked, graph,
        compiled.remats, compiled.mesh.as_dict())
    return Analysis(
        mesh=compiled.mesh.as_dict(),
        memory=_memory(compiled),
        collectives=collectives,
        findings=findings,
        requested=requested,
        versions={"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                  **({"libtpu": libtpu_version()} if compiled.topology else {})},
        partitioner=compiled.partitioner,
        platform=compiled.platform,
        topology=compiled.topology,
    )


def _memory(compiled) -> Memory:
    stats = compiled.memory
    flops = compiled.cost.get("flops")
    if stats is None:
        return Memory(0, 0, 0, 0, None, flops)
    # XLA:CPU reports a "peak" below the temp buffers it allocates (not a per-device peak);
    # a peak is kept only where the platform computes one that covers them (TPU).
    peak = getattr(stats, "peak_memory_in_bytes", None)
    if peak is not None and peak < stats.temp_size_in_bytes:
        peak = None
    return Memory(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        peak_bytes=int(peak) if peak else None,
        flops=float(flops) if flops is not None else None,
    )
