"""A rewrite of a Flax `nnx.jit` step: the original wrapper serving a rewritten inner function.

Flax's `nnx.jit` object is not a `jax.jit`: it splits the modules into pure states and
calls its `jitted_fn` on them. What a rewrite rewrites is that inner function; the wrapper
itself stays, so that called with the same modules and optimizer the result updates them in
place as the original does.
"""

from __future__ import annotations

import contextlib

from ._jaxpr import RewrittenStep
from .._step import JittedStep


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
    def traced_in(self):
        return self.inner.traced_in

    @property
    def regions(self):
        return self.inner.regions

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
