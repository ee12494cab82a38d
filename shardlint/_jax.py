"""JAX internals and version shims that shardlint relies on, each with the versions it serves.

Supported: JAX 0.10 through 0.12. Anything that reaches past JAX's public API lives here
so that a JAX upgrade has one place to look.
"""

from __future__ import annotations

import contextlib

import jax


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
    own = getattr(fn, "trace", None)
    traced = own(*args) if callable(own) else jax.jit(fn).trace(*args)
    while not hasattr(traced, "jaxpr") and hasattr(traced, "traced"):
        traced = traced.traced
    return traced


def set_mesh(mesh):
    """`jax.set_mesh(mesh)` as a context manager (JAX 0.7+); a no-op context before."""
    set_mesh_fn = getattr(jax, "set_mesh", None)
    return set_mesh_fn(mesh) if set_mesh_fn is not None else contextlib.nullcontext()
