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

import traceback as tb
import warnings
from typing import Callable

import jax

from .._errors import NothingToRewrite, RewriteError, ShardlintError, first_line, shardlint_bug
from .._token_axes import TokenAxes
from .._wrapped import is_nnx_jit
from .._source import display_path, is_library_file, raised_by_shardlint
from .trace import lost_in
from .routes import NnxRewrittenStep, RewrittenStep, warn_unchanged
from ._step import JittedStep
from ._verify import verify_same


def rewrite(step: Callable, mesh, *, verify: bool | None = None, args: tuple | None = None,
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
    is refused. The step's Python is traced once, at its global shapes; a region's per-shard
    program is its own equations bound at one shard's shapes, where numbers the Python drew
    from array sizes (a mean's 1/T) keep their global values. So by default (`verify=None`)
    a step rewritten that way is checked whenever it can be: both versions run once on
    random inputs of `args`' shapes and shardings, and a `RewriteError` is raised if any
    output differs beyond a tolerance the step's own dtypes set (`verify_same`). Not with per-shard capacity (it drops other
    tokens by design) nor on devices that only compile (a TPU topology); `verify=True`
    insists, `verify=False` skips. The result behaves like a jitted function (`__call__`, `trace`, `lower`);
    `result.changed` says whether anything was rewritten (known once built for some
    arguments: at once when `args` is given), and a `NothingToRewrite` warning says so
    when nothing was.
    """
    from .routes import swap_moe_layers

    if capacity not in ("global", "per-shard"):
        raise RewriteError(f"capacity={capacity!r}: expected 'global' (the default: refuse a capacity "
                           "computed from all tokens) or 'per-shard'")
    # Axes the caller names hold for every arguments; those the analysis finds, only for
    # the arguments it analyzed (others are analyzed when the step first meets them).
    given = TokenAxes(tuple(batch_axes or ()), tuple(seq_axes or ())) if batch_axes or seq_axes else None
    lost = None
    if args is not None and (given is None or analysis is not None):
        lost = lost_in(step, args, progress, analysis, params_argnums, given)
    axes = given or (lost.axes if lost else None)
    per_shard = capacity == "per-shard"
    swapped = None if args is not None and axes is None else swap_moe_layers(
        step, mesh, args=args, axes=axes, progress=progress)
    result = swapped or _jaxpr_route(step, mesh, given, progress, lost, per_shard, params_argnums)
    if args is not None:
        with warnings.catch_warnings():   # said once, below, at the caller's line
            warnings.simplefilter("ignore", NothingToRewrite)
            _build_or_refuse(result, args)   # says what it rewrote, or that nothing was
        if result.changed is False:
            warn_unchanged(result.notes[-1], stacklevel=3)
    if verify and result.changed:
        if args is None:
            raise RewriteError("verify=True needs args= to build inputs of the real shapes")
        verify_same(step, result, args, progress=progress, context=result.traced_in)
    elif verify is None and result.changed and _checkable(result, args, per_shard, progress):
        verify_same(step, result, args, progress=progress, context=result.traced_in)
    return result


def _checkable(result: JittedStep, args, per_shard_capacity: bool, progress) -> bool:
    """Whether a rewrite is checked by default: one whose regions were bound at one shard's
    shapes (not the `shardlint.moe` swap, not an `nnx.jit` wrapper that updates its modules
    in place), with the capacity of all tokens, on arguments whose devices can run."""
    if args is None or not isinstance(result, RewrittenStep) or per_shard_capacity:
        return False
    runnable = set(jax.devices())
    placed = [getattr(getattr(x, "sharding", None), "device_set", set()) for x in jax.tree_util.tree_leaves(args)]
    if any(not devices <= runnable for devices in placed):
        if progress:
            progress("not verifying the rewrite's numbers: its devices only compile")
        return False
    return True


def _build_or_refuse(result: JittedStep, args) -> None:
    """Traces the rewritten step once; JAX's own error on the way is a RewriteError that
    says where, never a raw traceback."""
    try:
        result.trace(*args)
    except ShardlintError:
        raise
    except Exception as e:  # JAX refused what the rewrite emitted, or shardlint failed
        if raised_by_shardlint(e):
            last = tb.extract_tb(e.__traceback__)[-1]
            raise shardlint_bug(f"while tracing the rewritten step{user_frame_of(e.__traceback__)}", e,
                                f" (raised at {display_path(last.filename)}:{last.lineno} in {last.name})") from e
        raise RewriteError(
            f"the rewritten step does not trace{user_frame_of(e.__traceback__)}: {type(e).__name__}: "
            f"{first_line(e)}. The step is left as it is; name the token axes with batch_axes=/seq_axes= "
            "(CLI --batch-axes/--seq-axes) if the analysis chose them wrongly, or report it "
            "with this message") from e


def _jaxpr_route(step, mesh, axes, progress, lost, per_shard_capacity, params_argnums=None):
    kwargs = dict(axes=axes, progress=progress, lost=lost, per_shard_capacity=per_shard_capacity,
                  params_argnums=params_argnums)
    if is_nnx_jit(step):
        return NnxRewrittenStep(step, RewrittenStep(step.jitted_fn, mesh, **kwargs))
    return RewrittenStep(step, mesh, **kwargs)


def user_frame_of(traceback) -> str:
    """` at file:line (function)` of the innermost user frame of a traceback, or ""."""
    frames = [f for f in tb.extract_tb(traceback) if not is_library_file(f.filename)
              and "/shardlint/rewrites/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {display_path(f.filename)}:{f.lineno} ({f.name})"
