"""What "a jitted step" is, decided once for the analyzer and every rewrite route.

A step reaches shardlint as a plain function, a `jax.jit` object (with its in/out
shardings and donation), Flax's `nnx.jit` object, or a step shardlint rewrote. Whatever
behaves like `jax.stages.Wrapped` (`__call__`, `trace`, `lower`) is jit-like and traces
itself; `jax.jit` objects also say which Python function they wrap (`__wrapped__`), which
a rewrite traces again at other shapes. `signature` is the key a rewritten step caches its
build under: what `jax.jit` itself keys a compile on, as far as the rewrite depends on it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import jax
from jax.sharding import NamedSharding


@runtime_checkable
class Wrapped(Protocol):
    """A jitted callable, as `jax.stages.Wrapped` (with `eval_shape`, as `jax.jit`'s
    objects and `nnx.jit` have it)."""

    def __call__(self, *args): ...

    def trace(self, *args): ...

    def lower(self, *args): ...

    def eval_shape(self, *args): ...


def is_jit_like(fn: Any) -> bool:
    """Traces and lowers itself: `jax.jit`, `nnx.jit`, a rewritten step."""
    return callable(getattr(fn, "trace", None)) and callable(getattr(fn, "lower", None))


def is_nnx_jit(fn: Any) -> bool:
    """Flax's `nnx.jit` object: its `jitted_fn` is the `jax.jit` of a pure function of the
    graph nodes' states, which is what a rewrite rewrites (flax 0.12)."""
    return callable(getattr(fn, "jitted_fn", None)) and type(fn).__module__.startswith("flax.")


def unwrap(fn: Callable) -> Callable:
    """The Python function a `jax.jit` object wraps (traced afresh, without its trace
    cache or its in-shardings' checks), else `fn` itself."""
    inner = getattr(fn, "__wrapped__", None)
    return inner if inner is not None and is_jit_like(fn) and not is_nnx_jit(fn) else fn


def as_jitted(fn: Callable) -> Callable:
    """`fn` if it is jit-like, else `jax.jit(fn)`."""
    return fn if is_jit_like(fn) else jax.jit(fn)


def signature(args: tuple) -> tuple:
    """A hashable key of the arguments: their tree and, per leaf, shape, dtype, weak type
    and sharding (a NamedSharding as its mesh and spec padded to the rank, so that
    `P('data')` and `P('data', None)` of a matrix are one key). A traced value inside an
    outer jit has no concrete sharding: None."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, tuple(_leaf_key(x) for x in leaves))


def quick_signature(args: tuple) -> tuple:
    """A cheaper key for the calls of a training loop: the tree and, per leaf, shape, dtype
    and sharding as they are (equal shardings hash alike). It maps to a `signature` once;
    it costs about a sixth of one (28 against 163 us for the decoder's 32 leaves)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x)),
                         None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None))
                        for x in leaves))


def without_shardings(key: tuple) -> tuple:
    """`signature`'s key with the shardings left out: what a traced call (inside a caller's
    jit, where values carry no concrete sharding) can match."""
    tree, leaves = key
    return (tree, tuple(leaf[:3] for leaf in leaves))


def _leaf_key(x) -> tuple:
    shape = tuple(getattr(x, "shape", ()))
    dtype = getattr(x, "dtype", None)
    return (shape, str(dtype) if dtype is not None else type(x).__name__,
            bool(getattr(x, "weak_type", False)), _sharding_key(x, len(shape)))


def _sharding_key(x, rank: int):
    if isinstance(x, jax.core.Tracer):
        return None
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (rank - len(sharding.spec))
        return ("named", sharding.mesh, spec, sharding.memory_kind)
    return sharding
