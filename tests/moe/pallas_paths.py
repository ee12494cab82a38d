"""One MoE layer through the Pallas grouped matmul and through XLA's, side by side: what the
multi-device CPU tests (`test_sharded_pallas.py`) and the one-chip check
(`tests/tpu/moe_pallas_one_chip.py`) share. No tests here.

`layer_vjp` traces a fresh function with the kernel scope entered inside it: `jax.jit`
caches one trace per function, and `_plan.grouped_kernel` is read only while tracing,
so a function jitted once and called under two scopes runs the first scope's kernel twice
(test_gmm's comparisons did, before this).

Tolerances: float32 (the kernels accumulate and write float32) as everywhere in tests/moe,
rtol = atol = 1e-5. In bfloat16 the two paths compute the same float32 sums but round them
to bfloat16 at different places, half a unit in the last place (eps / 2 of a value) per
rounding. Allowed: four such roundings at each leaf's largest |value|, atol = 4 * eps / 2
* max |value| (eps = `jnp.finfo(jnp.bfloat16).eps` = 2^-7): each path's rounding of the
result and of the hidden activations that feed it (h forward; dh, dh0, dh1 backward). The
chains are longer than that (dx passes dh, dh0 and dh1, a row's dx and the sum of a
token's K rows), but the roundings of a product's many terms add up as independent
errors, not in magnitude. Measured: at most 1.4 eps of the largest value in these tests,
1.02 eps on a v5e at T=8192 (benchmarks/README.md, RoutedMoE now vs today).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardlint.moe.kernels import _plan as _gmm_plan

F32_TOL = 1e-5
# bfloat16 roundings that may differ between the two paths (the module docstring says which)
ROUNDINGS = 4


def layer_vjp(layer, params, x, r, kernel: str, row_tile: int | None = None) -> Any:
    """`traced_step`'s results for `layer(params, x)` with cotangent r, its grouped
    matmuls on `kernel`, jitted afresh (see the module docstring), on the host."""
    return jax.device_get(jax.jit(traced_step(layer, kernel, row_tile))(params, x, r))


def traced_step(layer, kernel: str, row_tile: int | None = None,
                vmem_limit: int | None = None):
    """(params, x, r) -> {"output": y, "grad params": dparams, "grad x": dx}, its grouped
    matmuls on `kernel` (with `row_tile` and `vmem_limit`, `grouped_kernel`'s) when
    traced."""
    def step(params, x, r):
        with _gmm_plan.grouped_kernel(kernel, row_tile=row_tile, vmem_limit=vmem_limit):
            y, back = jax.vjp(layer, params, x)
            dparams, dx = back(r)
        return {"output": y, "grad params": dparams, "grad x": dx}
    return step


def equations(jaxpr, primitive: str) -> list:
    """The equations that bind `primitive` in a jaxpr and in every jaxpr inside it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found.append(eqn)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += equations(inner, primitive)
    return found


def tolerance(dtype: Any, want: np.ndarray) -> tuple[float, float]:
    """(rtol, atol) for one leaf of the XLA path's results `want`."""
    if jnp.dtype(dtype) == jnp.float32:
        return F32_TOL, F32_TOL
    eps = float(jnp.finfo(dtype).eps)
    return 0.0, ROUNDINGS * eps / 2 * float(np.max(np.abs(want)))


def _leaves(got: Any, want: Any):
    """(path, got leaf, want leaf) in float32, leaf by leaf."""
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    for (path, g), w in zip(flat_got, jax.tree.leaves(want), strict=True):
        yield jax.tree_util.keystr(path), np.asarray(g, np.float32), np.asarray(w, np.float32)


def differences(got: Any, want: Any, dtype: Any) -> list[tuple[str, float, float, float]]:
    """Per leaf: (its path, max |got - want|, max |want|, the atol it is held to)."""
    return [(path, float(np.max(np.abs(g - w))), float(np.max(np.abs(w))),
             tolerance(dtype, w)[1]) for path, g, w in _leaves(got, want)]


def assert_close(got: Any, want: Any, dtype: Any) -> None:
    """Every leaf of the Pallas path's results `got` within `tolerance` of the XLA path's
    `want`, element by element."""
    for path, g, w in _leaves(got, want):
        rtol, atol = tolerance(dtype, w)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=path)
