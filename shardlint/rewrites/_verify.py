"""Numeric verification of a rewrite: both steps run on the same random inputs of the real
shapes, dtypes and shardings, and every output must agree at float32 tolerances.

`random_like` draws those inputs as an initializer draws weights, so that a comparison
measures the rewrite rather than float32 cancellation in exploding sums.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import numpy as np

from .._errors import RewriteError
from .._wrapped import as_jitted


def verify_same(original: Callable, rewritten: Callable, args, *, rtol: float = 1e-5,
                atol: float = 1e-5, max_bytes: int = 2 << 30, progress=None) -> bool:
    """Runs both on random inputs of `args`' shapes and shardings; raises if they differ.

    Returns False (and says so) when the inputs would not fit in `max_bytes`.
    """
    leaves = jax.tree_util.tree_leaves(args)
    total = sum(math.prod(x.shape) * getattr(x.dtype, "itemsize", 8) for x in leaves)
    if total > max_bytes:
        if progress:
            progress(f"skipping verification: inputs need {total / 2**30:.1f} GiB")
        return False
    if progress:
        progress("verifying the rewrite on random inputs")
    # Fresh inputs for each run (the same values): a step may donate its arguments.
    want = as_jitted(original)(*random_like(args))
    got = as_jitted(rewritten)(*random_like(args))
    bad = []
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
        w, g = _as_numpy(w), _as_numpy(g)
        if w.shape != g.shape or not np.allclose(g, w, rtol=rtol, atol=atol):
            diff = float(np.max(np.abs(g.astype(np.float64) - w))) if w.shape == g.shape else float("nan")
            bad.append(f"output{jax.tree_util.keystr(path)} {w.dtype}{list(w.shape)}: max |diff| {diff:.3g}")
    if bad:
        raise RewriteError("the rewritten step computes different numbers; left unchanged. "
                           + "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""))
    return True


def _is_second_moment(path) -> bool:
    return any(getattr(k, "key", getattr(k, "name", None)) == "nu" for k in path)


def _as_numpy(value) -> np.ndarray:
    """An output as numbers; typed PRNG keys (a train state's rngs) as their key data."""
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    return np.asarray(value)


def random_like(args):
    """Random values of `args`' shapes, dtypes and shardings, drawn as an initializer
    draws weights: N(0, 1/fan_in) with fan_in the second-to-last dimension (N(0, 1/4) for
    vectors and scalars), so a deep step's activations and gradients stay of order one and
    a comparison measures the rewrite, not float32 cancellation in exploding sums;
    integers in {0, 1}. Optimizer second moments (optax's `nu`, a running mean of squared
    gradients) are drawn non-negative: a negative one makes Adam's update NaN in both
    steps, and NaN compares equal to nothing."""
    leaves_with_paths, tree = jax.tree_util.tree_flatten_with_path(args)
    keys = jax.random.split(jax.random.key(0), max(len(leaves_with_paths), 1))
    values = []
    for key, (path, x) in zip(keys, leaves_with_paths):
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
            scale = 1 / math.sqrt(x.shape[-2]) if len(x.shape) >= 2 else 0.5
            v = jax.random.normal(key, x.shape, jax.numpy.float32) * scale
            v = (jax.numpy.abs(v) if _is_second_moment(path) else v).astype(x.dtype)
        elif jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):   # typed PRNG keys (MaxText's rngs)
            v = jax.random.split(key, math.prod(x.shape)).reshape(x.shape)
        elif jax.numpy.issubdtype(x.dtype, jax.numpy.integer):
            v = jax.random.randint(key, x.shape, 0, 2).astype(x.dtype)
        else:
            v = jax.numpy.zeros(x.shape, x.dtype)
        sharding = getattr(x, "sharding", None)
        values.append(jax.device_put(v, sharding) if sharding is not None else v)
    return jax.tree_util.tree_unflatten(tree, values)
