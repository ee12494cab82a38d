"""Lower and compile a step once, keeping everything XLA tells us about it.

One compile yields all the analysis reads. The compiled texts come from a per-compile
dump into a temporary folder (removed afterwards), read back by `_dump.read_dump`, the
function that reads a real job's `--xla_dump_to` folder: the HLO right after sharding
propagation (XLA's own propagated shardings) and the partitioned, optimised HLO with
every collective. The live compile adds what only it has: `memory_analysis()`,
`cost_analysis()`, the traced program (grouped matmuls, which arguments are parameters,
what the code asked for) and what XLA's partitioner logged on C++ stderr. The dump is
restricted to the propagation pass so the overhead over a bare compile stays small (see
benchmarks/analysis_overhead.py).

A step the compiler refuses for lack of memory (a TPU compile's `RESOURCE_EXHAUSTED`) is
still analyzed: libtpu dumps the partitioned program, its buffer assignment and live
ranges before it refuses (measured with libtpu 0.0.50), so the findings, the collectives
and the buffers at the peak are read as for any step, the memory comes from that buffer
assignment, and `Compiled.does_not_fit` keeps the compiler's own figures.

The step is lowered as `jax.jit(step).lower(*args)` lowers it, with no mesh in context
unless it needs one (`_lower`), and compiled in the same context.

The compile never touches JAX's persistent compilation cache: its key ignores the dump
options, so a hit would skip the passes whose output the analysis reads.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import tempfile
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from ... import _interrupt, _jax
from ..._errors import AnalysisError
from ..._source import Source, user_sources
from ..parse import Asked, asked_for, memory_of_buffer_assignment, MeshInfo, op_stack
from ._dump import PROPAGATION_PASSES, DumpedModule, read_dump
from ...jaxpr import grouped_matmul_sources
from ._lower import lower_as_jit
from .._model import Memory, NoFit
from ._topology import INSTALL, check_libtpu, topology_of
from ._xla_log import Remat, captured_stderr, involuntary_rematerializations

# Per-compile options override XLA_FLAGS: a module filter set there (MaxText's config sets
# `--xla_dump_hlo_module_re=jit_train_step`) must not hide this step's module.
_DUMP_OPTIONS = {"xla_dump_hlo_pass_re": PROPAGATION_PASSES, "xla_dump_hlo_module_re": ".*",
                 "xla_dump_hlo_as_text": True, "xla_dump_buffer_assignment_analysis": True}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compiled:
    """Everything the analysis reads about one compiled step, live or from a dump."""

    dumped: DumpedModule             # the texts XLA wrote (propagated, partitioned, ...)
    mesh: MeshInfo
    memory: Memory
    partitioner: str
    platform: str
    grouped_matmul_sources: frozenset = frozenset()  # (file, line) of ragged_dot & co (live)
    asked: tuple[Asked, ...] = ()
    topology: str | None = None      # TPU topology of compile-only devices (libtpu AOT)
    named_params: frozenset[int] | None = None   # entry parameters the user named (params_argnums)
    kept_leaves: tuple[int, ...] = ()   # entry parameter number -> the argument leaf it holds (live)
    argument_leaves: int = 0         # how many leaves the step's arguments have (live)
    remats: tuple[Remat, ...] = ()   # "Involuntary full rematerialization" logged by XLA
    mesh_object: Any = None          # the jax.sharding.Mesh the arguments live on
    does_not_fit: NoFit | None = None   # the compiler refused it for lack of memory


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


def compile_step(fn: Callable, args: tuple, mesh=None, progress=None,
                 params_argnums: tuple[int, ...] | None = None) -> Compiled:
    mesh = mesh if mesh is not None else mesh_of(args)
    info = MeshInfo.from_mesh(mesh)
    topology = topology_of(mesh.devices.flat)
    if topology is not None:
        check_libtpu()  # a mismatched libtpu fails inside the compiler with a RET_CHECK
    lowering = lower_as_jit(fn, args, mesh, progress)
    traced, lowered = lowering.traced, lowering.lowered
    module = lowered.compiler_ir("stablehlo")
    asked = asked_for(module)
    dump_dir = tempfile.mkdtemp(prefix="shardlint-")
    _interrupt.register(dump_dir, "tree")   # XLA may still write into it after Ctrl-C
    try:
        with lowering.enter():
            if progress:
                progress(f"compiling for {info.num_devices} devices on mesh {info.as_dict()}"
                         + (f" with the TPU compiler for {topology}" if topology else ""))
            compiled = refused = error = None
            try:
                with _jax.persistent_cache_off(), captured_stderr() as log:
                    compiled = lowered.compile(compiler_options=_DUMP_OPTIONS | {"xla_dump_to": dump_dir})
            except Exception as e:
                refused, error = no_fit(e), e
                if refused is None:
                    raise compile_error(e, info, topology, module) from e
        try:   # a refused TPU compile dumps the partitioned program and its buffers first
            dumped = read_dump(dump_dir, compiled_only=True)
        except AnalysisError:
            if error is None:
                raise
            raise compile_error(error, info, topology, module) from error
        if refused is not None and progress:
            progress(f"the compiler refused the step for lack of memory ({refused.message}); "
                     "analyzing what it partitioned and assigned before it refused")
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
        _interrupt.forget(dump_dir)
    kept = _kept_leaves(traced, lowered)
    if dumped.propagated is None and info.num_devices > 1:
        raise AnalysisError(
            "XLA wrote no module after sharding propagation; is the step sharded over more "
            "than one device?")
    return Compiled(
        dumped=dumped,
        mesh=info,
        memory=memory_of(compiled) if compiled is not None else _memory_of_dump(dumped),
        partitioner=dumped.partitioner,
        platform=mesh.devices.flat[0].platform,
        grouped_matmul_sources=grouped_matmul_sources(traced.jaxpr),
        asked=asked,
        topology=topology,
        named_params=_named_params(traced, kept, params_argnums),
        kept_leaves=kept,
        argument_leaves=sum(len(jax.tree_util.tree_leaves(a)) for a in traced.args_info[0]),
        remats=involuntary_rematerializations(log.text),
        mesh_object=mesh,
        does_not_fit=refused,
    )


def compile_error(error: Exception, info: MeshInfo, topology: str | None, module=None) -> AnalysisError:
    """The compiler's refusal as one error. Out of memory (`RESOURCE_EXHAUSTED`, which
    libtpu raises when the step cannot fit a chip's HBM) says so in one line: the
    compiler's first line, which has the numbers, not the buffer listing after it. An op
    XLA:CPU does not implement (`UNIMPLEMENTED: HLO opcode ...`) is named with the user's
    line that made it (from the lowered `module`), and the TPU compiler is offered."""
    refused = no_fit(error)
    unimplemented = _UNIMPLEMENTED_RE.search(str(error))
    if unimplemented and not topology:
        opcode = unimplemented.group(1)
        return AnalysisError(
            f"XLA:CPU cannot compile {opcode}{_made_at(module, opcode)}: compile the step for a "
            f"TPU topology instead (no TPU needed), e.g. --topology v5p:2x2x2 (needs {INSTALL})")
    if refused is None:
        return AnalysisError(f"XLA could not compile the step on mesh {info.as_dict()}: "
                             f"{type(error).__name__}: {str(error).strip()}")
    where = f"the chips of {topology}" if topology else f"{info.num_devices} devices"
    return AnalysisError(f"the step does not fit {where} on mesh {info.as_dict()}: {refused.message}; "
                         f"shard it over more devices (a larger mesh or topology), or make "
                         f"the batch or sequence smaller")


# XLA:CPU's words for an op it has no emitter for (JAX 0.10.2 and 0.12.0.1): "UNIMPLEMENTED:
# HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter".
_UNIMPLEMENTED_RE = re.compile(r"UNIMPLEMENTED: HLO opcode `?([\w-]+)`? is not supported")


def _made_at(module, opcode: str) -> str:
    """` (made at model.py:42)`: the user's line of the op `opcode` comes from ("" if none)."""
    stack = op_stack(module, opcode) if module is not None else ()
    frames = user_sources(tuple(Source(file, line) for file, line in stack))
    return f" (made at {frames[0]})" if frames else ""


# libtpu's words for a step that needs more HBM than a chip has (0.0.42 and 0.0.50 alike):
# "the total memory required for HLO temporaries (105.24G) exceeds available HBM (95.73G)";
# XLA prints sizes in binary units. Other words leave the figures unknown (None).
_NO_FIT_RE = re.compile(r"required for .*?\(([\d.]+)([KMGT]?)\) exceeds available \w+ \(([\d.]+)([KMGT]?)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def no_fit(error: Exception) -> NoFit | None:
    """The compiler's refusal of a step for lack of memory (`RESOURCE_EXHAUSTED`) with its
    figures; None for any other error."""
    text = str(error).strip()
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    first = text.splitlines()[0].split("RESOURCE_EXHAUSTED:", 1)[-1].strip()
    m = _NO_FIT_RE.search(text)
    if m is None:
        return NoFit(needed_bytes=None, available_bytes=None, message=first)
    needed, available = (int(float(m.group(i)) * _UNITS[m.group(i + 1)]) for i in (1, 3))
    return NoFit(needed_bytes=needed, available_bytes=available, message=first)


def _memory_of_dump(dumped) -> Memory:
    """The memory of a step the compiler refused: its buffer assignment (no FLOPs, no peak)."""
    if dumped.buffer_assignment is None:
        return Memory.empty()
    return memory_of_buffer_assignment(dumped.buffer_assignment, f"{dumped.stem}'s buffer assignment")


def _named_params(traced, kept: tuple[int, ...], params_argnums) -> frozenset[int] | None:
    """The entry parameters that hold the positional arguments `params_argnums` names (None
    where it names none: then every floating-point argument may be a weight)."""
    if params_argnums is None:
        return None
    named = [i in params_argnums for i, a in enumerate(traced.args_info[0]) for _ in jax.tree_util.tree_leaves(a)]
    return frozenset(number for number, index in enumerate(kept) if index < len(named) and named[index])


def _kept_leaves(traced, lowered) -> tuple[int, ...]:
    """Entry parameter number -> the flat leaf of the positional arguments it holds, as the
    jitted function received them (for nnx.jit, the graph nodes' states)."""
    count = sum(len(jax.tree_util.tree_leaves(a)) for a in traced.args_info[0])
    return tuple(i for i in _jax.kept_argument_indices(lowered, count) if i < count)


def parameter_argnums(leaves_per_arg: list[list], out_avals) -> tuple[int, ...]:
    """The positional arguments that hold parameters as a training step returns them:
    every argument but the last whose floating-point leaves come back as outputs of the
    same shape and dtype. Only the rewrite's last resort for which arguments carry tokens
    (`rewrites._trace`), when no argument is sharded like the lost tokens."""
    outputs = {(tuple(a.shape), str(a.dtype)) for a in out_avals}
    return tuple(i for i, leaves in enumerate(leaves_per_arg[:-1])
                 if any(_is_float(x) for x in leaves)
                 and all((tuple(x.shape), str(x.dtype)) in outputs for x in leaves if _is_float(x)))


def _is_float(leaf) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.floating)


def memory_of(compiled) -> Memory:
    """`memory_analysis()` and the flops of `cost_analysis()` as a `Memory` record."""
    stats = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jaxlib returns one dict per program
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    if stats is None:
        return Memory.empty(flops)
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
