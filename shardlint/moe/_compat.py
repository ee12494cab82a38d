"""What `shardlint.moe` needs from JAX beyond the obvious: `shard_map` with its checks on
(the version shim itself lives in `shardlint._jax`, with every other one), a stable
argsort that keeps a value's varying-manual-axes type, and the varying-axes types a
`pallas_call` inside `shard_map` must state, or interpret mode there avoid (`per_device`;
public API: `jax.typeof`, `jax.lax.pcast`, `jax.sharding.ManualAxisType`, JAX 0.10.2-0.12.1).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from .. import _jax


def shard_map(f: Callable[..., Any], *, mesh: jax.sharding.Mesh, in_specs: Any,
              out_specs: Any) -> Callable[..., Any]:
    """`jax.shard_map` over every mesh axis, with replication/varying-ness checks on.

    The checks stay on because they are what makes the transpose insert the psum of
    gradients for inputs that are replicated over an axis the body varies over (weights
    over the token axes, activations over the tensor axis).
    """
    return _jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, checked=True)


def argsort(keys: jax.Array) -> jax.Array:
    """Stable argsort of a 1-D array that keeps the varying-manual-axes type.

    `jnp.argsort` drops the `{V:axis}` type of a value that varies over a `shard_map` axis
    (seen in JAX 0.10.2 and 0.12.0.1), so autodiff treats the permutation as replicated and
    the backward pass of a gather through it uses one device's permutation on every
    device: wrong input gradients, no error. `lax.sort` over (keys, iota) keeps the type.
    """
    iota = jax.lax.broadcasted_iota(jnp.int32, keys.shape, 0)
    return jax.lax.sort((keys, iota), num_keys=1, is_stable=True)[1]


def varying_axes(x: jax.Array) -> frozenset:
    """The `shard_map` axes a value varies over (empty outside one)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def vary_alike(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """The arrays, each cast to vary over every axis any of them varies over.

    A `pallas_call` inside `shard_map` (checks on) must declare how its outputs vary, and
    a custom VJP must return each input's gradient typed as the input: casting the
    inputs alike first makes both the union, and autodiff turns the cast of a weight
    that does not vary into the psum of its gradient.
    """
    axes = frozenset().union(*(varying_axes(a) for a in arrays))
    return tuple(_vary(a, axes) for a in arrays)


def _vary(x: jax.Array, axes: frozenset) -> jax.Array:
    """x cast to vary over `axes` too."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def out_struct(shape: tuple[int, ...], dtype: Any, *like: jax.Array) -> jax.ShapeDtypeStruct:
    """A `pallas_call` output shape that varies over every axis the arrays `like` vary
    over (its operands: an output depends on all of them)."""
    axes = frozenset().union(*(varying_axes(a) for a in like))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(
        varying=axes))


def per_device(fn: Callable[..., Any], *args: jax.Array) -> Any:
    """`fn(*args)`, where `fn` calls Pallas kernels in interpret mode; inside `shard_map`,
    where the args vary over its axes, each device runs `fn` on its own values in a host
    callback, and the results vary over those axes.

    JAX's Pallas interpreters (the HLO one and TPU interpret mode; JAX 0.10.2 and 0.12.1)
    evaluate a kernel's index maps and body under the varying-axes checks of the
    `shard_map` around them, and fail at the first op that meets a varying block with a
    grid index or a constant ("Primitive dynamic_slice requires varying manual axes to
    match"). Outside `shard_map` they run: the callback runs `fn` jitted on the host, on
    one device's arrays. (A nested `shard_map` with its checks off is refused by JAX 0.12.)
    Compiled kernels need none of this. A callback has no derivative: call this only
    where nothing differentiates `fn` (a custom VJP's rules).
    """
    axes = frozenset().union(*(varying_axes(a) for a in args))
    if not axes:
        return fn(*args)
    shapes = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))
    outs = jax.pure_callback(jax.jit(fn), shapes, *args)
    return jax.tree.map(lambda o: _vary(o, axes), outs)
