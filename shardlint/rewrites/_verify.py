"""Numeric verification of a rewrite: both steps run on the same random inputs of the real
shapes, dtypes and shardings, and every output must agree within a tolerance that knows the
precision the step computes in.

A correct rewrite runs the step's own equations on each shard's tokens: every value of one
token is computed as before, and the sums over tokens (weight gradients, a summed loss) are
taken in parts, one per shard, and then added (a psum). In float32 that moves a result by
float32 rounding, which `rtol`/`atol` 1e-5 covers, as before. Where the step writes values
in a lower precision (a matmul writing bfloat16, a cast to bfloat16 anywhere), each part
is rounded there: the original rounds a sum T once (error up to u|T|, u half the dtype's
epsilon) and the rewrite each of its N parts (up to u times the parts' magnitudes, about
sqrt(N)|T| for parts of either sign), and results built from such values move by the same
order. So each floating output may differ, on top of float32's tolerance, by
eps * (1 + sqrt(N)) / 2 times the output's largest |value|: eps the epsilon of the least
precise dtype the step's equations write, N the devices its arguments are laid over.

The original under a second sharding does not show that noise: its routed layer gathers
the tokens and sums them whole either way. Measured on tests/support/precision_steps.py
(experts writing bfloat16, 8 devices, the gradients' largest |difference| over their
largest |value|, in units of bfloat16's epsilon 2**-7; the allowance is 1.91 of them),
JAX 0.10.2 / 0.12.1: the original with every argument replicated 0 / 2.4e-5; the rewrite
0.37 / 0.86; the layer per shard written by hand 3e-5 / 0.43; wrong ones: a dropped
combine weight 7.0, a token sent to the wrong expert 9.4, a capacity one larger 36, a
missing psum 129 (on both).

`random_like` draws the inputs as an initializer draws weights, so that a comparison
measures the rewrite rather than float32 cancellation in exploding sums; an input the step
takes a square root or a logarithm of, through elementwise ops alone (an optimizer's second
moments: optax's `nu`, Keras's velocities), is drawn non-negative (`rooted_leaves`), so that
neither step computes NaN, which compares equal to nothing.
"""

from __future__ import annotations

import dataclasses
import contextlib
import math
from typing import Callable, ContextManager

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax
from .._errors import RewriteError
from .._ops import JAXPR_LAYOUT
from .._wrapped import as_jitted
from .shard import elementwise
from ..jaxpr import equations, is_literal, sub_of

FLOAT32_RTOL = FLOAT32_ATOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far each element of a rewrite's output may sit from the original's:
    `atol + rtol * |original| + eps(precision) * (1 + sqrt(parts)) / 2 * max |original|`
    over that output, the last term only for floating outputs of a step that writes
    `precision` (module docstring)."""

    rtol: float = FLOAT32_RTOL
    atol: float = FLOAT32_ATOL
    precision: np.dtype | None = None   # the least precise float dtype the step writes, below float32
    parts: int = 1                      # the devices its arguments are laid over: a sum's parts

    @property
    def units(self) -> float:
        """The allowance per unit of an output's largest |value|."""
        if self.precision is None:
            return 0.0
        return float(jnp.finfo(self.precision).eps) * (1 + math.sqrt(self.parts)) / 2

    def bound(self, want: np.ndarray, floating: bool) -> np.ndarray:
        """Per element of `want` (the original's output as float64; `floating`: its own
        dtype is a floating one)."""
        bound = self.atol + self.rtol * np.abs(want)
        if self.precision is not None and floating and want.size:
            largest = np.max(np.abs(want), initial=0.0, where=np.isfinite(want))
            bound = bound + self.units * largest
        return bound

    def words(self) -> str:
        fixed = f"rtol/atol {self.rtol:g}/{self.atol:g}"
        if self.precision is None:
            return fixed
        return (f"{fixed} plus {self.units:.3g} times each output's largest |value| (the step writes "
                f"{self.precision.name}: its epsilon times (1 + sqrt({self.parts})) / 2, the rounding of "
                f"a sum in {self.parts} parts)")


def tolerance_of(step: Callable, args) -> Tolerance:
    """Float32's tolerance, plus the rounding of a sum split over the arguments' devices in
    the least precise float dtype the step's equations write (its traced jaxpr, every
    inner jaxpr included) where that is below float32 (module docstring)."""
    devices = [len(x.sharding.device_set) for x in jax.tree_util.tree_leaves(args)
               if getattr(x, "sharding", None) is not None]
    return Tolerance(precision=least_precise(_jax.trace(step, args).jaxpr), parts=max(devices, default=1))


def least_precise(closed_jaxpr) -> np.dtype | None:
    """The floating dtype with the largest epsilon among the values the jaxpr's equations
    write, where it is less precise than float32; else None."""
    written = _written_dtypes(closed_jaxpr.jaxpr)
    floats = [np.dtype(d) for d in written if jnp.issubdtype(d, jnp.floating)]
    lowest = max(floats, key=lambda d: jnp.finfo(d).eps, default=None)
    return lowest if lowest is not None and jnp.finfo(lowest).eps > jnp.finfo(jnp.float32).eps else None


def _written_dtypes(jaxpr) -> set:
    return {v.aval.dtype for eqn in equations(jaxpr) for v in eqn.outvars if hasattr(v.aval, "dtype")}


def verify_same(original: Callable, rewritten: Callable, args, *, rtol: float | None = None,
                atol: float | None = None, max_bytes: int = 2 << 30, progress=None,
                context: Callable[[], ContextManager] = contextlib.nullcontext) -> bool:
    """Runs both on random inputs of `args`' shapes and shardings; raises RewriteError
    naming each output that differs, by how much and against what tolerance.

    The tolerance is derived from the step (`tolerance_of`); `rtol`/`atol` fix it instead
    (float32's 1e-5 for the one not given, no allowance for a lower precision). Returns
    False (and says so) when the inputs would not fit in `max_bytes`. `context`: the mesh
    context the original is traced in (the one `jax.jit` needs for it, `_trace`).
    """
    leaves = jax.tree_util.tree_leaves(args)
    total = sum(math.prod(x.shape) * getattr(x.dtype, "itemsize", 8) for x in leaves)
    if total > max_bytes:
        if progress:
            progress(f"skipping verification: inputs need {total / 2**30:.1f} GiB")
        return False
    fixed = rtol is not None or atol is not None
    with context():
        tolerance = (Tolerance(FLOAT32_RTOL if rtol is None else rtol, FLOAT32_ATOL if atol is None else atol)
                     if fixed else tolerance_of(original, args))
        if progress:
            progress(f"verifying the rewrite on random inputs ({tolerance.words()})")
        rooted = rooted_leaves(original, args)
        # Fresh inputs for each run (the same values): a step may donate its arguments.
        want = as_jitted(original)(*random_like(args, non_negative=rooted))
    got = as_jitted(rewritten)(*random_like(args, non_negative=rooted))
    bad = []
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
        differs = _differs(_as_numpy(w), _as_numpy(g), tolerance)
        if differs:
            bad.append(f"output{jax.tree_util.keystr(path)} {differs}")
    if bad:
        raise RewriteError("the rewritten step computes different numbers; left unchanged. "
                           + "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
                           + f". Tolerance: {tolerance.words()}")
    return True


def _differs(w: np.ndarray, g: np.ndarray, tolerance: Tolerance) -> str | None:
    """Where `g` leaves the tolerance around `w`, in words (None where it does not): the
    element furthest past its bound, by how much it differs and what the bound is there."""
    what = f"{w.dtype}{list(w.shape)}"
    if w.shape != g.shape:
        return f"{what}: the rewrite gives {g.dtype}{list(g.shape)}"
    w64, g64 = w.astype(np.float64), g.astype(np.float64)
    diff = np.abs(g64 - w64)
    bound = np.broadcast_to(tolerance.bound(w64, jnp.issubdtype(w.dtype, jnp.floating)), w.shape)
    over = ~(diff <= bound)   # NaN differs
    if not over.any():
        return None
    excess = np.where(over, np.nan_to_num(diff - bound, nan=np.inf), -np.inf)
    at = np.unravel_index(int(np.argmax(excess)), w.shape)
    index = f" at {list(map(int, at))}" if w.ndim else ""
    return (f"{what}: differs by {diff[at]:.3g}{index} (original {w64[at]:.7g}, rewrite {g64[at]:.7g}) "
            f"where the tolerance is {bound[at]:.3g}; {int(over.sum())} of {w.size} element(s) past it")


# Ops whose operand must be non-negative for a real result.
_ROOTS = {"sqrt", "rsqrt", "log", "log1p", "pow"}
# Ops that pass a value on as it is, laid out, annotated or broadcast otherwise (the op table's).
_PASSES_ON = JAXPR_LAYOUT | {"broadcast_in_dim"}


def rooted_leaves(step: Callable, args) -> frozenset[int]:
    """The flat positions of the leaves of `args` that the step takes a root or logarithm
    of through elementwise ops alone (an optimizer's second moments), in and out of the
    bodies of calls."""
    jaxpr = _jax.trace(step, args).jaxpr.jaxpr
    found: set[int] = set()
    _rooted(jaxpr, {v: {k} for k, v in enumerate(jaxpr.invars)}, found)
    return frozenset(found)


def _rooted(jaxpr, origin: dict, found: set[int]) -> list:
    """Adds to `found` the leaves (as `origin` maps `jaxpr`'s values to them) that reach a
    root; returns the leaves each of its outputs carries on."""
    def of(atom) -> set:
        return set() if is_literal(atom) else origin.get(atom, set())

    for eqn in jaxpr.eqns:
        sources = set().union(*(of(a) for a in eqn.invars))
        if not sources:
            continue
        sub = sub_of(eqn)
        if sub is not None:
            outs = _rooted(sub.jaxpr, {v: of(a) for a, v in zip(eqn.invars, sub.jaxpr.invars)}, found)
            origin.update((v, o) for v, o in zip(eqn.outvars, outs) if o)
        elif eqn.primitive.name in _ROOTS:
            found |= of(eqn.invars[0])
        elif elementwise(eqn) or eqn.primitive.name in _PASSES_ON:
            origin.update((v, sources) for v in eqn.outvars)
    return [of(v) for v in jaxpr.outvars]


def _as_numpy(value) -> np.ndarray:
    """An output as numbers; typed PRNG keys (a train state's rngs) as their key data."""
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    return np.asarray(value)


def random_like(args, non_negative: frozenset[int] = frozenset()):
    """Random values of `args`' shapes, dtypes and shardings, drawn as an initializer
    draws weights: N(0, 1/fan_in) with fan_in the second-to-last dimension (N(0, 1/4) for
    vectors and scalars), so a deep step's activations and gradients stay of order one and
    a comparison measures the rewrite, not float32 cancellation in exploding sums;
    integers in {0, 1}. The floating leaves at the flat positions `non_negative`
    (`rooted_leaves`: an optimizer's second moments, whose negative values make Adam's
    update NaN) are drawn non-negative."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    keys = jax.random.split(jax.random.key(0), max(len(leaves), 1))
    values = []
    for k, (key, x) in enumerate(zip(keys, leaves)):
        if jnp.issubdtype(x.dtype, jnp.floating):
            scale = 1 / math.sqrt(x.shape[-2]) if len(x.shape) >= 2 else 0.5
            v = jax.random.normal(key, x.shape, jnp.float32) * scale
            v = (jnp.abs(v) if k in non_negative else v).astype(x.dtype)
        elif jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):   # typed PRNG keys (MaxText's rngs)
            v = jax.random.split(key, math.prod(x.shape)).reshape(x.shape)
        elif jnp.issubdtype(x.dtype, jnp.integer):
            v = jax.random.randint(key, x.shape, 0, 2).astype(x.dtype)
        else:
            v = jnp.zeros(x.shape, x.dtype)
        sharding = getattr(x, "sharding", None)
        values.append(jax.device_put(v, sharding) if sharding is not None else v)
    return jax.tree_util.tree_unflatten(tree, values)
