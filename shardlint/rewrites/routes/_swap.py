"""The route for models built on `shardlint.moe`: trace the step again with every
`RoutedMoE` call served by a `ShardedRoutedMoE` of the same config on the same parameters
(`shardlint.moe.served_by`, a context variable: the class is never patched).

Swapping the layer before differentiation means JAX differentiates the sharded layer
itself, so a step with `value_and_grad` inside needs nothing more. The dense strategy is
swapped only when neither version can drop a token (capacity reaches every token of its
group: `capacity_factor <= 0` or `top_k * capacity_factor >= num_experts`); per-shard
capacity would otherwise change which tokens are dropped.
"""

from __future__ import annotations

from typing import Callable

import jax

from ..._errors import RewriteError
from ..._wrapped import unwrap
from ...jaxpr import jit_equation, jitted_like
from .._step import JittedStep


def uses_routed_moe(step: Callable, args) -> list:
    """The RoutedMoE configs the step calls (traced abstractly, nothing runs)."""
    from ...moe import served_by

    seen = []

    def record(layer, params, x_BSD):
        seen.append(layer.cfg)
        with served_by(None):
            return layer(params, x_BSD)

    step = unwrap(step)
    with served_by(record):
        # A fresh function: eval_shape must trace again, not reuse a cached trace made
        # before the layer was served.
        jax.eval_shape(lambda *a: step(*a), *args)
    return seen


def check_swappable(cfg) -> None:
    if cfg.strategy == "dense" and cfg.capacity_factor > 0 and cfg.top_k * cfg.capacity_factor < cfg.num_experts:
        raise RewriteError(
            f"RoutedMoE(strategy='dense', capacity_factor={cfg.capacity_factor}) drops tokens over a "
            f"capacity computed from all tokens; per shard it would drop different ones, so it is "
            f"left alone. Use strategy='sparse' (dropless), or capacity_factor >= "
            f"num_experts/top_k = {cfg.num_experts / cfg.top_k:g} so nothing drops")


class SwappedStep(JittedStep):
    """`step` traced with ShardedRoutedMoE serving every RoutedMoE call, jitted as the
    original was (its shardings and donation kept)."""

    def __init__(self, step: Callable, mesh, *, batch_axes=None, seq_axes=None):
        self.step = step
        self.mesh = mesh
        self.layer_kwargs = {"batch_axes": batch_axes, "seq_axes": seq_axes}
        self.notes = ["swapped RoutedMoE for ShardedRoutedMoE"]
        self.changed = True

    def _call(self, body: Callable, *args):
        from ...moe import ShardedRoutedMoE, served_by

        swapped = []

        def sharded(layer, params, x_BSD):
            swapped.append(layer.cfg)
            # weight_axes=(): the caller's parameters come in the layout chosen for RoutedMoE;
            # a swap changes where tokens go, not where weights live.
            return ShardedRoutedMoE(layer.cfg, self.mesh, weight_axes=(), **self.layer_kwargs)(params, x_BSD)

        with served_by(sharded):
            out = body(*args)
        if not swapped:
            raise RewriteError("the step calls RoutedMoE, but tracing it again did not reach the "
                               "layer (a jitted function inside it reused a trace made before "
                               "the swap); call shardlint.rewrite before the step first runs, "
                               "or call jax.clear_caches() first")
        return out

    def _build(self, args):
        # The Python the step wraps, traced in a jit of its own that no trace from before
        # the swap can serve; named as the step, so op paths read `jit(step)/...` before
        # and after alike.
        body = unwrap(self.step)
        tree = jax.tree_util.tree_structure(args)
        out_tree: list = []

        def run_flat(*leaves):
            out = self._call(body, *jax.tree_util.tree_unflatten(tree, leaves))
            flat, treedef = jax.tree_util.tree_flatten(out)
            out_tree[:] = [treedef]
            return flat

        return jitted_like(run_flat, args, lambda: out_tree[0], jit_equation(self.step, args),
                           self.__name__)


def swap_moe_layers(step: Callable, mesh, *, args=None, axes=None, progress=None):
    """A SwappedStep when the step calls shardlint.moe.RoutedMoE, else None."""
    if args is None:
        return None
    configs = uses_routed_moe(step, args)
    if not configs:
        return None
    for cfg in configs:
        check_swappable(cfg)
    kwargs = {"batch_axes": axes.batch, "seq_axes": axes.seq} if axes is not None else {}
    swapped = SwappedStep(step, mesh, **kwargs)
    swapped.regions = len(configs)
    if progress:
        progress(f"swapping {len(configs)} RoutedMoE call(s) for ShardedRoutedMoE")
    return swapped
