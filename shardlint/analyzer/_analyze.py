"""`analyze(fn, *args)` and `analyze_dump(folder)`: one explanation of a compiled step.

A live step is lowered and compiled once (`_compile.compile_step`); a real job's
`--xla_dump_to` folder is read as it is (`_dump.read_dump`, the function the live compile
reads its own dump with). Both become a `Compiled` record, and from there one path parses
the partitioned and propagated HLO, builds the graph and explains every collective.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jaxlib

from .. import _jax
from .._vocab import ArgumentRole
from .._errors import AnalysisError, HloParseError
from .explain import (attribute, collectives_of, explain, find_contracted_tokens,
    find_lost_sharding, with_gathered_tokens)
from .parse import (asked_for, memory_of_buffer_assignment, mesh_of_module,
    parse_buffer_assignment, parse_hlo, parse_live_range)
from .compile import compile_step, Compiled, libtpu_version, read_dump
from .graph import build_graph, provenance
from ._model import Analysis, Memory
from .memory import peak_buffers


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
    versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                **({"libtpu": libtpu_version()} if compiled.topology else {})}
    return _explain(compiled, versions, progress)


def analyze_dump(folder: str, *, module: str | None = None, mesh: dict[str, int] | None = None,
                 progress: Callable[[str], None] | None = None) -> Analysis:
    """Analyzes the training step a real job compiled, from the folder that
    `XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=shardy-xla|sharding-propagation"`
    wrote (see `shardlint.analyzer._dump`).

    `module` picks the module (its name, e.g. `jit_train_step`, or its number,
    `module_0012`) when the folder holds more than one large one. `mesh` (axis -> size) is
    needed only for GSPMD modules, which name no mesh axes. What the folder lacks is listed
    in `Analysis.unread`. Without the traced program, a dump cannot say which dots were a
    `ragged_dot` on XLA:CPU (it lowers them to dense dots), nor what the partitioner logged.
    """
    dumped = read_dump(folder, module)
    if progress:
        progress(f"reading {dumped.stem} ({dumped.platform}) from {folder}")
    header = (dumped.given or dumped.partitioned).split("\n", 1)[0]
    compiled = Compiled(
        dumped=dumped,
        mesh=mesh_of_module(header, dumped.stablehlo, mesh),
        memory=(memory_of_buffer_assignment(dumped.buffer_assignment, f"{dumped.stem}'s buffer assignment")
                if dumped.buffer_assignment is not None else Memory.empty()),
        partitioner=dumped.partitioner,
        platform=dumped.platform,
        asked=_asked_in(dumped),
    )
    return _explain(compiled, {}, progress)


def _explain(compiled: Compiled, versions: dict[str, str], progress) -> Analysis:
    if progress:
        progress("reading XLA's propagated shardings and collectives")
    dumped = compiled.dumped
    partitioned = _parsed(dumped, "partitioned")
    collectives = collectives_of(partitioned, compiled.mesh)
    flow = with_gathered_tokens(provenance(partitioned, compiled.named_params), collectives)
    drops, requested, graph = (), (), None
    if dumped.propagated is not None:
        graph = build_graph(_parsed(dumped, "propagated"), compiled.mesh,
                            compiled.grouped_matmul_sources)
        asked_lines = frozenset(
            (a.file, a.line) for a in compiled.asked if a.op in ("sharding_constraint", "reshard"))
        drops, requested, collectives = find_lost_sharding(graph, compiled.mesh, collectives,
                                                           asked_lines, flow.is_weight)
        contracted = find_contracted_tokens(graph, compiled.mesh, collectives)
        drops, collectives = drops + contracted, attribute(collectives, contracted)
    collectives, findings, requested = explain(
        collectives, partitioned, flow, drops, requested, compiled.asked, graph,
        compiled.remats, compiled.mesh.as_dict())
    memory = compiled.memory
    if dumped.buffer_assignment is not None and dumped.live_range is not None:
        where = dumped.files.get("partitioned", dumped.stem)
        memory = dataclasses.replace(memory, peak_buffers=peak_buffers(
            parse_buffer_assignment(dumped.buffer_assignment, f"{where}'s buffer assignment"),
            parse_live_range(dumped.live_range, f"{where}'s live ranges"), partitioned, collectives,
            memory.temp_bytes, platform=compiled.platform))
    roles = [ArgumentRole.UNUSED] * compiled.argument_leaves
    for number, leaf in enumerate(compiled.kept_leaves):
        roles[leaf] = ArgumentRole.WEIGHT if flow.is_weight_parameter(number) else ArgumentRole.INPUT
    return Analysis(
        argument_roles=tuple(roles),
        mesh=compiled.mesh.as_dict(),
        memory=memory,
        collectives=collectives,
        findings=findings,
        requested=requested,
        versions=versions,
        partitioner=compiled.partitioner,
        platform=compiled.platform,
        topology=compiled.topology,
        dump=None if compiled.mesh_object is not None else dumped.folder,
        unread=() if compiled.mesh_object is not None else dumped.unread(),
        does_not_fit=compiled.does_not_fit,
    )


def _parsed(dumped, text: str):
    """One of the dump's HLO texts, parsed; a text the parser refuses is named by its file
    (HloParseError names the line)."""
    hlo = getattr(dumped, text)
    if hlo is None:
        return None
    try:
        return parse_hlo(hlo)
    except HloParseError as e:
        e.args = (f"{dumped.files.get(text, text)}: {e}",)
        raise


def _asked_in(dumped) -> tuple:
    if dumped.stablehlo is None:
        return ()
    try:
        return asked_for(_jax.parse_mlir_module(dumped.stablehlo))
    except Exception as e:  # MLIR's parser raises its own error types
        raise AnalysisError(f"{dumped.stem}/module.mlir is not StableHLO this JAX can read "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
