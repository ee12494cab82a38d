"""What every rewritten step is: something that behaves like a jitted function.

As haliax's `WrappedCallable` and `jax.stages.Wrapped`: `__call__`, `trace`, `lower` and
`eval_shape` on the step's arguments, so `shardlint.analyze(result, *args)` and a training
loop treat it as they treated the original. Each route (the jaxpr rewrite, the
`shardlint.moe` swap) builds one jitted function per distinct arguments (`_build`: their
tree, shapes, dtypes and shardings, `_wrapped.signature`), which then dispatches as any
`jax.jit` does: a training loop compiles once. `changed` says whether anything was
rewritten (None until built for some arguments) and `notes` what was done.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, ContextManager

import jax

from .._wrapped import quick_signature, signature, without_shardings


class JittedStep(abc.ABC):
    changed: bool | None = None
    notes: list[str]
    step: Callable
    # The context the step's Python is traced in, as `jax.jit` traces it (a mesh it needs):
    # the original step runs in it beside the rewritten one when they are compared.
    traced_in: Callable[[], ContextManager] = contextlib.nullcontext
    # Routed regions (the jaxpr route) or MoE layers (the swap route) that now run per shard.
    regions: int = 0

    @abc.abstractmethod
    def _build(self, args: tuple) -> Any:
        """The jitted function (with `trace`, `lower`, `eval_shape`) that runs arguments
        like these; called once per `signature(args)`."""

    def _staged(self, args: tuple) -> Any:
        seen = self.__dict__.setdefault("_seen", {})   # quick_signature -> build
        quick = quick_signature(args)
        if quick not in seen:
            seen[quick] = self._staged_by_signature(args)
        return seen[quick]

    def _staged_by_signature(self, args: tuple) -> Any:
        built = self.__dict__.setdefault("_built", {})
        key = signature(args)
        if key not in built:
            # Traced inside a caller's jit (`jax.grad(rewritten)`), the arguments carry no
            # concrete shardings: the latest build for the same shapes serves them.
            alike = [b for k, b in built.items() if without_shardings(k) == without_shardings(key)]
            traced = any(leaf[3] is None for leaf in key[1])
            built[key] = alike[-1] if traced and alike else self._build(args)
        return built[key]

    def _context(self):
        return contextlib.nullcontext()

    def __call__(self, *args):
        with self._context():
            return self._staged(args)(*args)

    def trace(self, *args):
        with self._context():
            return self._staged(args).trace(*args)

    def lower(self, *args):
        with self._context():
            return _Lowered(self._staged(args).lower(*args), self._context)

    def eval_shape(self, *args):
        with self._context():
            staged = self._staged(args)
            own = getattr(staged, "eval_shape", None)
            return own(*args) if callable(own) else jax.eval_shape(staged, *args)

    @property
    def __name__(self) -> str:
        return getattr(self.step, "__name__", "step")


class _Lowered:
    """A rewritten step's `jax.stages.Lowered`, compiled in the context the step is traced
    and called in: JAX keys its compiled programs on the ambient mesh, so a caller that
    compiles under its own `jax.set_mesh` (MaxText's loop) would otherwise compile the
    step again at its first call."""

    def __init__(self, lowered, context):
        self._lowered, self._context = lowered, context

    def compile(self, *args, **kwargs):
        with self._context():
            return self._lowered.compile(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._lowered, name)
