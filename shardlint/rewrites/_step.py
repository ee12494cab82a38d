"""What every rewritten step is: something that behaves like a jitted function.

As haliax's `WrappedCallable`: `__call__`, `trace` and `lower` on the step's arguments,
so `shardlint.analyze(result, *args)` and a training loop treat it as they treated the
original. Each route (the jaxpr rewrite, the `shardlint.moe` swap, the `nnx.jit`
wrapper) says which jitted function serves a set of arguments (`_staged`) and in which
context it runs; `changed` says whether anything was rewritten (None until built for
some arguments) and `notes` what was done.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable


class JittedStep(abc.ABC):
    changed: bool | None = None
    retraced: str = ""        # why its jaxpr was traced at one shard's shapes, if it was
    notes: list[str]
    step: Callable

    @abc.abstractmethod
    def _staged(self, args: tuple) -> Any:
        """The jitted function (with `trace` and `lower`) that runs these arguments."""

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
            return self._staged(args).lower(*args)

    @property
    def __name__(self) -> str:
        return getattr(self.step, "__name__", "step")
