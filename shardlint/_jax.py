"""JAX internals and version shims that shardlint relies on, each with the versions it serves.

Supported: JAX 0.10 through 0.12. Anything that reaches past JAX's public API lives here
so that a JAX upgrade has one place to look.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import numpy as np

from ._source import display_path, is_jax_shim


def kept_argument_indices(lowered, count: int) -> tuple[int, ...]:
    """Which flat arguments the compiled program kept as entry parameters, in order.

    `jax.jit` drops unused arguments (`keep_unused=False`); the entry parameter numbers then
    skip them. The lowering records what it kept in `compile_args["kept_var_idx"]`
    (private; the same in JAX 0.10.2 and 0.12.0.1). Without it, all arguments are kept.
    """
    lowering = getattr(lowered, "_lowering", None)
    kept = getattr(lowering, "compile_args", {}).get("kept_var_idx") if lowering else None
    return tuple(sorted(kept)) if kept is not None else tuple(range(count))


@contextlib.contextmanager
def persistent_cache_off():
    """Compiles inside skip JAX's persistent compilation cache, reading and writing.

    The cache key leaves XLA's dump options out, so a cache hit would skip the passes the
    analysis reads. JAX decides once per process whether the cache is used
    (`compilation_cache.is_cache_used` memoises it); `reset_cache()` (public under
    `jax.experimental.compilation_cache`, JAX 0.4.x through 0.12) forgets that decision, so
    the setting is switched off, forgotten, and restored and forgotten again afterwards.
    """
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def trace(fn, args: tuple):
    """`jax.stages.Traced` of the step as the user runs it.

    A `jax.jit` step traces itself, keeping its in/out shardings and donation. Flax's
    `nnx.jit` has its own `trace()` whose result wraps JAX's in `.traced` (flax 0.12): it
    must trace itself too, because under an outer `jax.jit` its in-place updates of the
    model and optimizer are no outputs, and XLA would drop the backward pass. Anything
    else is traced inside `jax.jit`.
    """
    from ._wrapped import as_jitted

    traced = as_jitted(fn).trace(*args)
    while not hasattr(traced, "jaxpr") and hasattr(traced, "traced"):
        traced = traced.traced
    return traced


def parse_mlir_module(text: str):
    """An MLIR module (StableHLO with sdy) parsed from text in a context that knows JAX's
    dialects: `mlir.make_ir_context()` (private; the same in JAX 0.10.2 and 0.12.0.1).
    The module keeps its context alive."""
    from jax._src.interpreters import mlir
    from jax.extend.mlir import ir

    with mlir.make_ir_context():
        return ir.Module.parse(text)


def set_mesh(mesh):
    """`jax.set_mesh(mesh)` as a context manager (public since JAX 0.7)."""
    return jax.set_mesh(mesh)


@contextlib.contextmanager
def legacy_mesh(mesh):
    """`with mesh:`, the resource environment pjit-era code reads (bare PartitionSpecs in
    `pjit`'s shardings, `pxla.thread_resources`), which `jax.set_mesh` does not set. JAX
    0.10.2 through 0.12.1 still honour it and warn (DeprecationWarning) on entering: the
    warning is about the user's code, which asked for this context, so it is not repeated."""
    with contextlib.ExitStack() as stack:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            stack.enter_context(mesh)
        yield


def no_ambient_mesh():
    """Clears a mesh set with `jax.set_mesh` for the duration (`jax.set_mesh` and
    `jax.sharding.get_abstract_mesh`, public since JAX 0.7); only possible outside jit:
    inside a caller's jit the mesh, if any, is the caller's to keep (JAX raises
    ValueError there)."""
    if jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    try:
        return jax.set_mesh(None)
    except ValueError:
        return contextlib.nullcontext()


# --- jaxpr replay (shardlint.rewrites). The same in JAX 0.10.2 through 0.12.0.1. ---------

def struct_of(aval, shape=None) -> jax.ShapeDtypeStruct:
    """An abstract value to trace with, weak type kept (a Python scalar's stays weak), at
    `shape` when given (one shard's, or a scan body's slice of a stacked value)."""
    return jax.ShapeDtypeStruct(tuple(aval.shape if shape is None else shape), aval.dtype,
                                weak_type=getattr(aval, "weak_type", False))


def unplaced(value):
    """A literal's value without the mesh it was traced under: from JAX 0.11 a literal is a
    `TypedNdArray` (private) whose type names the abstract mesh in context then (a
    shard_map's manual one); viewed again it keeps its dtype and weak type and drops that
    mesh. Other values as they are."""
    if isinstance(value, np.ndarray) and type(value) is not np.ndarray and hasattr(value, "aval"):
        return value.view(type(value))
    return value


def user_frame(eqn) -> tuple[str, int] | None:
    """(file, line) of the innermost user frame that traced `eqn`
    (`source_info_util.user_frames`, private), passing over functions installed in place
    of JAX's own (MaxText's compat shim around `jax.lax.top_k`), as the analyzer does."""
    from jax._src import source_info_util

    traceback = eqn.source_info.traceback
    frames = source_info_util.user_frames(traceback) if traceback else ()
    frame = next((f for f in frames if not is_jax_shim(f.file_name, f.function_name)), None)
    return (frame.file_name, frame.start_line) if frame else None


def eqn_line(eqn) -> str:
    """` at file:line` of the user's line that traced `eqn` ("" where none did), for one-line
    messages about an equation."""
    frame = user_frame(eqn)
    return f" at {display_path(frame[0])}:{frame[1]}" if frame else ""


@contextlib.contextmanager
def as_traced(eqn, *, its_mesh: bool = True):
    """Binds made inside carry `eqn`'s source location, name stack and context (the
    `user_context` and `name_stack` of `source_info_util`, private), so a replayed
    equation still points at the user's line in the compiled program. `its_mesh=False`
    keeps the abstract mesh in context instead of the one the equation was traced under
    (its `JaxprEqnContext.cur_abstract_mesh`, private; the same slot in JAX 0.10.2 through
    0.12): inside a `shard_map` the mesh's axes are manual, and an equation traced under
    `jax.set_mesh` would bring back the Auto mesh."""
    from jax._src import source_info_util

    ctx = eqn.ctx if its_mesh else _with_current_mesh(eqn.ctx)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), ctx.manager:
        yield


def _with_current_mesh(ctx):
    """A copy of a `JaxprEqnContext` whose abstract mesh is the one in context now. Up to
    JAX 0.12.0 the mesh is a field of its own (`cur_abstract_mesh`; the other fields differ
    between versions: each slot is copied as it is); from 0.12.1 the context holds the
    values of the configs it was traced under (`configs`, named by
    `config.jaxpr_eqn_ctx_names()`), the abstract mesh's among them."""
    from jax._src import config

    slots = [s for s in type(ctx).__slots__ if s != "__weakref__" and hasattr(ctx, s)]
    if "configs" in slots and "cur_abstract_mesh" not in slots:
        names = config.jaxpr_eqn_ctx_names()
        i = names.index("abstract_mesh_context_manager")
        configs = tuple(config.jaxpr_eqn_ctx_vals()[i] if k == i else v for k, v in enumerate(ctx.configs))
        metadata = None if ctx.xla_metadata is None else tuple(sorted(ctx.xla_metadata.items()))
        return type(ctx)._create(metadata, configs)   # interned, as JAX makes them
    copy = object.__new__(type(ctx))
    for slot in slots:
        object.__setattr__(copy, slot, getattr(ctx, slot))
    object.__setattr__(copy, "cur_abstract_mesh", jax.sharding.get_abstract_mesh())
    return copy


def open_jaxpr(closed) -> tuple[object, list]:
    """`(jaxpr, consts)`: a ClosedJaxpr as an open Jaxpr that takes its constants as
    leading inputs (`partial_eval.convert_constvars_jaxpr`, private), for primitives whose
    parameter is an open Jaxpr (`checkpoint`/`remat`)."""
    from jax._src.interpreters import partial_eval as pe

    if not closed.consts:
        return closed.jaxpr, []
    return pe.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def scan_counts(params) -> tuple[int, int]:
    """(constants, carries) among a `scan` equation's operands. JAX 0.10 and 0.11 name
    them `num_consts`/`num_carry`; JAX 0.12 groups the operands as `ft_in` = (consts,
    carries, stacked), a flat tree (`jax._src.flattree`) that unpacks into the three,
    one leaf per operand."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = (_num_leaves(part) for part in params["ft_in"].unpack())
    return consts, carry


def _num_leaves(flat_tree) -> int:
    vals = flat_tree.vals
    return len(list(vals() if callable(vals) else vals))


def backends_are_initialized() -> bool:
    """Whether JAX started a backend yet (`xla_bridge.backends_are_initialized`, private;
    JAX 0.10.2 through 0.12.0.1): a platform choice made after that has no effect."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


# --- shard_map (shardlint.moe). ---------------------------------------------------------

def shard_map(f, *, mesh, in_specs, out_specs, checked: bool = True, axis_names=None):
    """`jax.shard_map` with its varying-ness check (`check_vma`, public since JAX 0.7) on
    or off; `axis_names` only where given."""
    kwargs = {} if axis_names is None else {"axis_names": axis_names}
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=checked,
                         **kwargs)
