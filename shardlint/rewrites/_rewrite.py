"""`rewrite(step, mesh)`: the same step with its routed-expert regions computed per shard.

The analyzer says where XLA loses the sequence sharding and which mesh axes shard batch
and sequence at that flatten; the jaxpr route (`_regions`, `_emit`) re-emits those regions
inside `shard_map`; models built on `shardlint.moe` are instead re-traced with
`ShardedRoutedMoE` in place of `RoutedMoE` (`_swap`). Either way the result is a
`RewrittenStep` that behaves like a jitted function (`__call__`, `trace`, `lower`), so
`shardlint.analyze(rewritten, *args)` works as on the original, and that can verify
itself against the original on random inputs.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from .._errors import RewriteError
from ._emit import emit
from ._regions import TokenAxes, entry_axes, plan_regions


class RewrittenStep:
    """A step whose routed-expert regions run per shard; same signature and outputs."""

    def __init__(self, step: Callable, mesh, *, axes: TokenAxes | None = None,
                 progress: Callable[[str], None] | None = None):
        self.step = step
        self.mesh = mesh
        self.axes = axes
        self.progress = progress or (lambda message: None)
        self.notes: list[str] = []
        self._cache: dict = {}

    # The step was traced without a mesh in context, and its equations are replayed the
    # same way: an ambient mesh (the analyzer sets one) would type the replayed values
    # with the Auto mesh and clash with shard_map's manual axes.
    def __call__(self, *args):
        with _no_ambient_mesh():
            return self._prepare(args)(*args)

    def trace(self, *args):
        with _no_ambient_mesh():
            return jax.jit(self._prepare(args)).trace(*args)

    def lower(self, *args):
        with _no_ambient_mesh():
            return jax.jit(self._prepare(args)).lower(*args)

    @property
    def __name__(self):
        return getattr(self.step, "__name__", "step")

    def _prepare(self, args) -> Callable:
        key = tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))))
                    for x in jax.tree_util.tree_leaves(args))
        if key not in self._cache:
            self._cache[key] = self._build(args)
        return self._cache[key]

    def _build(self, args) -> Callable:
        flat, tree = jax.tree_util.tree_flatten(args)
        specs = [_spec_of(x) for x in flat]
        if any(s is None for s in specs) and self.axes is None:
            raise RewriteError("rewrite needs the arguments' NamedShardings to find the token "
                               "axes: call it on arrays or ShapeDtypeStructs that carry them")
        axes = self.axes or _token_axes(self.step, args, self.progress)
        if axes is None:
            self.notes.append("nothing to rewrite: no flatten loses sharding before a grouped matmul")
            self.progress(self.notes[-1])
            return self.step
        out_tree = []

        def flat_step(*leaves):
            out = self.step(*jax.tree_util.tree_unflatten(tree, leaves))
            leaves_out, treedef = jax.tree_util.tree_flatten(out)
            out_tree[:] = [treedef]
            return leaves_out

        nb = math.prod(self.mesh.shape[a] for a in axes.batch)
        ns = math.prod(self.mesh.shape[a] for a in axes.seq)
        # Traced without the mesh in context: the avals then carry no mesh, so the
        # per-shard equations can be replayed inside shard_map's manual axes.
        global_j = jax.make_jaxpr(flat_step)(*[_abstract(x) for x in flat])
        local_j = jax.make_jaxpr(flat_step)(*[_shrunk(x, s, axes, nb, ns) for x, s in zip(flat, specs)])
        seq_j = jax.make_jaxpr(flat_step)(*[_shrunk(x, s, axes, 1, ns) for x, s in zip(flat, specs)])
        plan = plan_regions(global_j, local_j, seq_j, axes)
        if not plan.groups:
            self.notes.append("nothing to rewrite: no reshape folds the sharded sequence into tokens")
            self.progress(self.notes[-1])
            return self.step
        self.notes.append(f"rewrote {len(plan.groups)} routed region(s) to run per shard over "
                          f"{', '.join(axes.batch + axes.seq)}")
        self.progress(self.notes[-1])
        run = emit(plan, self.mesh)
        treedef = out_tree[0]

        def rewritten(*call_args):
            return jax.tree_util.tree_unflatten(treedef, run(*jax.tree_util.tree_leaves(call_args)))

        return rewritten


def rewrite(step: Callable, mesh, *, verify: bool = False, args: tuple | None = None,
            batch_axes: tuple[str, ...] | None = None, seq_axes: tuple[str, ...] | None = None,
            analysis=None, progress: Callable[[str], None] | None = None) -> Callable:
    """Returns `step` with each routed-expert region computed per shard.

    The token axes (those sharding batch and sequence at the lossy flatten) come from the
    analysis of `step` on the arguments' shardings (pass `analysis=` to reuse one you
    have), or from `batch_axes`/`seq_axes`. With
    `verify=True` (needs `args`) both versions run once on random inputs of the real shapes
    and a `RewriteError` is raised if any output differs beyond float32 tolerance. A step
    with nothing to rewrite is returned unchanged.
    """
    from ._swap import swap_moe_layers

    axes = TokenAxes(tuple(batch_axes or ()), tuple(seq_axes)) if seq_axes else None
    if args is not None and axes is None:
        axes = _token_axes(step, args, progress, analysis)
        if axes is None:
            if progress:
                progress("nothing to rewrite: no flatten loses sharding before a grouped matmul")
            return step
    swapped = swap_moe_layers(step, mesh, args=args, axes=axes, progress=progress)
    if swapped is not None:
        result = swapped
    else:
        result = RewrittenStep(step, mesh, axes=axes, progress=progress)
        if args is not None and result._prepare(args) is step:
            return step
    if verify:
        if args is None:
            raise RewriteError("verify=True needs args= to build inputs of the real shapes")
        verify_same(step, result, args, progress=progress)
    return result


def verify_same(original: Callable, rewritten: Callable, args, *, rtol: float = 1e-5,
                atol: float = 1e-5, max_bytes: int = 2 << 30, progress=None) -> bool:
    """Runs both on random inputs of `args`' shapes and shardings; raises if they differ.

    Returns False (and says so) when the inputs would not fit in `max_bytes`.
    """
    leaves = jax.tree_util.tree_leaves(args)
    total = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
    if total > max_bytes:
        if progress:
            progress(f"skipping verification: inputs need {total / 2**30:.1f} GiB")
        return False
    if progress:
        progress("verifying the rewrite on random inputs")
    values = _random_like(args)
    want = jax.jit(original)(*values)
    got = jax.jit(rewritten)(*values) if not hasattr(rewritten, "lower") else rewritten(*values)
    bad = []
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
        w, g = np.asarray(w), np.asarray(g)
        if w.shape != g.shape or not np.allclose(g, w, rtol=rtol, atol=atol):
            diff = float(np.max(np.abs(g.astype(np.float64) - w))) if w.shape == g.shape else float("nan")
            bad.append(f"output{jax.tree_util.keystr(path)} {w.dtype}{list(w.shape)}: max |diff| {diff:.3g}")
    if bad:
        raise RewriteError("the rewritten step computes different numbers; left unchanged. "
                           + "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""))
    return True


def _token_axes(step, args, progress, analysis=None) -> TokenAxes | None:
    from ..analyzer import analyze

    if analysis is None:
        analysis = analyze(step, *args, progress=progress)
    found = set()
    for f in analysis.findings:
        if f.op == "reshape" and f.feeds_grouped_matmul and len(f.operand_spec) >= 2:
            found.add((tuple(f.operand_spec[0]), tuple(f.operand_spec[1])))
    if not found:
        return None
    if len(found) > 1:
        raise RewriteError(f"the lossy flattens are sharded differently ({sorted(found)}); "
                           "pass batch_axes= and seq_axes= to choose")
    batch, seq = found.pop()
    if not seq:
        return None
    return TokenAxes(batch, seq)


def _spec_of(x):
    sharding = getattr(x, "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else None


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _shrunk(x, spec, axes: TokenAxes, nb: int, ns: int):
    """`x` at one shard's size along the dims sharded over batch or sequence axes."""
    shape = list(x.shape)
    for d, entry in enumerate(spec or ()):
        names = entry_axes(entry)
        if not names:
            continue
        factor = 1
        if names == axes.batch:
            factor = nb
        elif names == axes.seq:
            factor = ns
        elif names == axes.batch + axes.seq:
            factor = nb * ns
        if shape[d] % factor:
            raise RewriteError(f"argument dim {d} of size {shape[d]} does not divide over "
                               f"{names} ({factor} shards)")
        shape[d] //= factor
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def _random_like(args):
    leaves, tree = jax.tree_util.tree_flatten(args)
    keys = jax.random.split(jax.random.key(0), max(len(leaves), 1))
    values = []
    for key, x in zip(keys, leaves):
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
            v = jax.random.normal(key, x.shape, jax.numpy.float32).astype(x.dtype) * 0.5
        elif jax.numpy.issubdtype(x.dtype, jax.numpy.integer):
            v = jax.random.randint(key, x.shape, 0, 2).astype(x.dtype)
        else:
            v = jax.numpy.zeros(x.shape, x.dtype)
        sharding = getattr(x, "sharding", None)
        values.append(jax.device_put(v, sharding) if sharding is not None else v)
    return jax.tree_util.tree_unflatten(tree, values)


def _no_ambient_mesh():
    """Clears a mesh set with `jax.set_mesh` for the duration (only possible outside jit;
    inside a caller's jit the mesh, if any, is the caller's to keep)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    set_mesh = getattr(jax, "set_mesh", None)
    if get is None or set_mesh is None or get().empty:
        return contextlib.nullcontext()
    try:
        return set_mesh(None)
    except ValueError:
        return contextlib.nullcontext()
