"""`analyze(fn, *args)`: lower, compile, parse, graph, detect; one compile, one result."""

from __future__ import annotations

from typing import Callable

import jax
import jaxlib

from ._collectives import collectives_of
from ._compile import compile_step
from ._detect import find_lost_sharding
from ._graph import build_graph
from ._hlo import parse_hlo
from ._model import Analysis, Memory
from ._topology import libtpu_version


def analyze(fn: Callable, *args, mesh=None, progress: Callable[[str], None] | None = None) -> Analysis:
    """Analyzes the step `fn(*args)` on the mesh its arguments' NamedShardings name.

    Arguments are arrays or `jax.ShapeDtypeStruct`s carrying `NamedSharding`s; nothing is
    executed. Returns the collectives of the partitioned program, the places where XLA's
    propagated sharding drops a mesh axis (findings), and per-device memory.
    """
    compiled = compile_step(fn, args, mesh=mesh, progress=progress)
    if progress:
        progress("reading XLA's propagated shardings and collectives")
    partitioned = parse_hlo(compiled.partitioned_hlo)
    collectives = collectives_of(partitioned, compiled.mesh)
    findings, requested = (), ()
    if compiled.propagated_hlo is not None:
        graph = build_graph(parse_hlo(compiled.propagated_hlo), compiled.mesh)
        graph.graph["grouped_matmul_sources"] = compiled.grouped_matmul_sources
        graph.graph["asked_lines"] = frozenset(
            (a.file, a.line) for a in compiled.asked if a.op in ("sharding_constraint", "reshard"))
        findings, requested, collectives = find_lost_sharding(graph, compiled.mesh, collectives)
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
    peak = getattr(stats, "peak_memory_in_bytes", None)
    return Memory(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        peak_bytes=int(peak) if peak else None,
        flops=float(flops) if flops is not None else None,
    )
