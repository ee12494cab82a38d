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
import dataclasses
import math
import warnings
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from .. import _jax
from .._errors import NothingToRewrite, RewriteError, ShardlintError, first_line
from .._wrapped import as_jitted, is_nnx_jit
from ._emit import emit
from ._jitted import jitted_like
from ._regions import plan_regions
from ._step import JittedStep
from .._token_axes import TokenAxes
from ._trace import Tokens, trace_step, user_frame_of


class RewrittenStep(JittedStep):
    """A step whose routed-expert regions run per shard; same signature and outputs.

    Built once per distinct arguments (`JittedStep`): the token axes come from `axes`
    when given, else from the analysis of the step on those arguments' shardings (the
    first build may reuse one already made, `lost`)."""

    def __init__(self, step: Callable, mesh, *, axes: TokenAxes | None = None,
                 progress: Callable[[str], None] | None = None, lost: _Lost | None = None,
                 per_shard_capacity: bool = False, params_argnums: tuple[int, ...] | None = None):
        self.step = step
        self.mesh = mesh
        self.axes = axes
        self.params_argnums = params_argnums
        self.lost = lost     # what an analysis of the first arguments built for said
        self.per_shard_capacity = per_shard_capacity
        self.progress = progress or (lambda message: None)
        self.notes: list[str] = []
        self.changed: bool | None = None   # known once built for some arguments

    # The step was traced without a mesh in context, and its equations are replayed the
    # same way: an ambient mesh (the analyzer sets one) would type the replayed values
    # with the Auto mesh and clash with shard_map's manual axes.
    def _context(self):
        return _jax.no_ambient_mesh()

    def _build(self, args):
        flat = jax.tree_util.tree_leaves(args)
        if self.axes is None and not any(isinstance(getattr(x, "sharding", None), NamedSharding) for x in flat):
            raise RewriteError("rewrite needs the arguments' NamedShardings to find the token "
                               "axes: call it on arrays or ShapeDtypeStructs that carry them")
        lost, self.lost = self.lost, None
        if lost is None and self.axes is None:
            lost = _lost_in(self.step, args, self.progress, params_argnums=self.params_argnums)
        tokens = Tokens(self.axes) if self.axes else lost.tokens
        if tokens is None:
            return self._unchanged(NOTHING_LOST)
        axes = tokens.axes
        traces = trace_step(self.step, args, dataclasses.replace(tokens, params_argnums=self.params_argnums),
                            self.mesh)
        if traces.retraced:
            self.retraced = traces.retraced
            self.notes.append(f"{traces.retraced}: its jaxpr was traced there instead")
            self.progress(self.notes[-1])
        plan = plan_regions(traces, axes, seed_lines=lost.lines if lost else frozenset(),
                            per_shard_capacity=self.per_shard_capacity)
        if not plan.top.changed:
            return self._unchanged("no routed region loses the sequence sharding: no reshape folds "
                                   "it into tokens before a grouped matmul, and no routing op "
                                   "feeding the experts is where the analysis found it lost")
        self.changed = True
        self.notes.append(f"rewrote {plan.top.count()} routed region(s) to run per shard over "
                          f"{', '.join(axes.all)}")
        self.progress(self.notes[-1])
        return jitted_like(emit(plan, self.mesh), args, lambda: traces.out_tree, traces.jit_eqn,
                           self.__name__)

    def _unchanged(self, why: str):
        self.changed = False
        self.notes.append(f"nothing to rewrite: {why}")
        self.progress(self.notes[-1])
        _warn_unchanged(self.notes[-1], stacklevel=6)
        if "_as_is" not in self.__dict__:
            self._as_is = as_jitted(self.step)
        return self._as_is


NOTHING_LOST = ("the analysis finds no sharding lost in routed-expert code (no flatten before "
                "a grouped matmul, no routing op)")


def rewrite(step: Callable, mesh, *, verify: bool = False, args: tuple | None = None,
            batch_axes: tuple[str, ...] | None = None, seq_axes: tuple[str, ...] | None = None,
            analysis=None, capacity: str = "global", params_argnums: tuple[int, ...] | None = None,
            progress: Callable[[str], None] | None = None):
    """Returns `step` with each routed-expert region computed per shard.

    The token axes (those sharding batch and sequence where a routed layer loses the
    sharding: a flatten before a grouped matmul, or a routing op) come from the analysis
    of `step` on the arguments' shardings (pass `analysis=` to reuse one you have), or
    from `batch_axes`/`seq_axes`. The arguments that carry those tokens (and shrink per
    shard) are those sharded like the lost value, wherever they sit in the signature;
    `params_argnums` names the parameters instead, for the analysis too. `capacity="per-shard"` lets a capacity computed from
    the tokens (GShard-style dispatch) run per shard: the one-hot masks, the running totals,
    the capacity, the dispatch, the expert matmuls and the combine then run on each shard's
    tokens with the capacity of its own token count (GShard groups; a sharding constraint
    in there that asks for the whole sequence is dropped), so each shard drops by its own
    capacity, which changes which tokens drop: it is opt-in, and by default such a region
    is refused. With `verify=True` (needs `args`) both versions run once on random inputs
    of the real shapes and a `RewriteError` is raised if any output differs beyond float32
    tolerance. A step whose Python does not trace at one shard's shapes (a mask of the
    configured length), or traces into other equations there, has its jaxpr traced there
    instead (`result.retraced` says why) and its numbers verified so whenever `args` is
    given. The result behaves like a jitted function (`__call__`, `trace`, `lower`);
    `result.changed` says whether anything was rewritten (known once built for some
    arguments: at once when `args` is given), and a `NothingToRewrite` warning says so
    when nothing was.
    """
    from ._swap import swap_moe_layers

    if capacity not in ("global", "per-shard"):
        raise RewriteError(f"capacity={capacity!r}: expected 'global' (the default: refuse a capacity "
                           "computed from all tokens) or 'per-shard'")
    # Axes the caller names hold for every arguments; those the analysis finds, only for
    # the arguments it analyzed (others are analyzed when the step first meets them).
    given = TokenAxes(tuple(batch_axes or ()), tuple(seq_axes)) if seq_axes else None
    lost = None
    if args is not None and (given is None or analysis is not None):
        lost = _lost_in(step, args, progress, analysis, params_argnums)
    axes = given or (lost.axes if lost else None)
    per_shard = capacity == "per-shard"
    swapped = None if args is not None and axes is None else swap_moe_layers(
        step, mesh, args=args, axes=axes, progress=progress)
    result = swapped or _rewritten(step, mesh, given, progress, lost, per_shard, params_argnums)
    if args is not None:
        with warnings.catch_warnings():   # said once, below, at the caller's line
            warnings.simplefilter("ignore", NothingToRewrite)
            _build_or_refuse(result, args)   # says what it rewrote, or that nothing was
        if result.changed is False:
            _warn_unchanged(result.notes[-1], stacklevel=3)
    if verify and result.changed:
        if args is None:
            raise RewriteError("verify=True needs args= to build inputs of the real shapes")
        verify_same(step, result, args, progress=progress)
    elif result.changed and result.retraced and not isinstance(result, NnxRewrittenStep):
        # Its per-shard equations were reconstructed, and numbers the step's Python drew
        # from array sizes (a mean's 1/T) kept their global values there: check them.
        verify_same(step, result, args, progress=progress)
    return result


def _build_or_refuse(result: JittedStep, args) -> None:
    """Traces the rewritten step once; JAX's own error on the way is a RewriteError that
    says where, never a raw traceback."""
    try:
        result.trace(*args)
    except ShardlintError:
        raise
    except Exception as e:  # JAX refused what the rewrite emitted
        raise RewriteError(
            f"the rewritten step does not trace{user_frame_of(e.__traceback__)}: {type(e).__name__}: "
            f"{first_line(e)}. The step is left as it is; name the token axes with batch_axes=/seq_axes= "
            "(CLI --batch-axes/--seq-axes) if the analysis chose them wrongly, or report it "
            "with this message") from None


def _warn_unchanged(note: str, stacklevel: int) -> None:
    warnings.warn(f"shardlint.rewrite: {note}; the result runs the step as it is",
                  NothingToRewrite, stacklevel=stacklevel)


def _rewritten(step, mesh, axes, progress, lost, per_shard_capacity, params_argnums=None):
    kwargs = dict(axes=axes, progress=progress, lost=lost, per_shard_capacity=per_shard_capacity,
                  params_argnums=params_argnums)
    if is_nnx_jit(step):
        return NnxRewrittenStep(step, RewrittenStep(step.jitted_fn, mesh, **kwargs))
    return RewrittenStep(step, mesh, **kwargs)


class NnxRewrittenStep(JittedStep):
    """An `nnx.jit` step whose inner jitted function is a RewrittenStep: called with the
    same modules and optimizer, it updates them in place as the original does.

    Flax's wrapper splits the modules into pure states under an update context tagged by
    the wrapper object itself, and its inner function merges them under the same tag, so
    the rewritten inner function must run under the original wrapper: for the duration
    of each call (and only then) the wrapper's `jitted_fn` instance attribute is the
    rewritten one. Not thread-safe across concurrent calls of the same wrapper.
    """

    def __init__(self, step, inner: RewrittenStep):
        self.step = step
        self.inner = inner

    @property
    def changed(self):
        return self.inner.changed

    @property
    def notes(self):
        return self.inner.notes

    @property
    def retraced(self):
        return self.inner.retraced

    def _build(self, args):
        return self.step

    def _staged(self, args):
        return self.step   # Flax's wrapper; the inner step caches its builds

    def _context(self):
        return self._serving()

    @contextlib.contextmanager
    def _serving(self):
        original = self.step.jitted_fn
        self.step.jitted_fn = self.inner
        try:
            yield
        finally:
            self.step.jitted_fn = original


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


@dataclasses.dataclass(frozen=True)
class _Lost:
    """What the analysis says to rewrite: the tokens at the lossy ops (their axes and sizes;
    None: nothing lost in routed code) and the (file, line) of every op where sharding was
    lost."""

    tokens: Tokens | None
    lines: frozenset

    @property
    def axes(self) -> TokenAxes | None:
        return self.tokens.axes if self.tokens else None


# Ops the analysis names where a routed layer loses the sharding without a flatten
# (JAX 0.12 often names the matmul that feeds top_k instead of top_k itself).
_ROUTING_FINDING_OPS = {"top_k", "scatter", "scatter-add", "gather", "sort", "cumsum",
                        "reduce-window", "dot_general"}


def _lost_in(step, args, progress, analysis=None, params_argnums=None) -> _Lost:
    from ..analyzer import analyze

    if analysis is None:
        analysis = analyze(step, *args, params_argnums=params_argnums, progress=progress)
    lost = [f for f in analysis.findings if f.cause == "lost"]
    lines = frozenset((s.file, s.line) for s in
                      [f.source for f in lost] + [c.source for c in analysis.collectives if c.cause == "lost"]
                      if s is not None)
    # A flatten of (batch, seq) has the sequence sharded in its second dimension; a lost
    # reshape without that (attention's heads split off a score tensor) is no flatten.
    flattens = [t for f in lost if f.op == "reshape" and f.feeds_grouped_matmul and len(f.operand_spec) >= 2
                for t in [_tokens_of(f)] if t.axes.seq]
    routing = [t for f in lost if f.op in _ROUTING_FINDING_OPS and len(f.operand_spec) >= 3
               for t in [_tokens_of(f)] if t.axes.seq]
    found = {t.axes: dataclasses.replace(t, roles=analysis.argument_roles)
             for t in reversed(flattens or routing)}   # the first finding's sizes
    if len(found) > 1:
        raise RewriteError(f"the lossy ops are sharded differently "
                           f"({sorted((a.batch, a.seq) for a in found)}); pass batch_axes= and "
                           "seq_axes= to choose")
    return _Lost(next(iter(found.values())) if found else None, lines)


def _tokens_of(finding) -> Tokens:
    """The lost operand's batch and sequence: its first two dimensions' axes and sizes."""
    dims = finding.operand_dims
    return Tokens(TokenAxes(tuple(finding.operand_spec[0]), tuple(finding.operand_spec[1]), "analysis"),
                  dims[0] if len(dims) > 1 else None, dims[1] if len(dims) > 1 else None)


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
