"""The example steps analyzed once per test session, shared by the analyzer tests."""

from __future__ import annotations

import functools

import shardlint
from shardlint.examples import steps

from .meshes import context_mesh

# Two batch rows per device at every mesh: with a single row per device a (batch, seq)
# merge can carry the seq sharding, and XLA rightly loses nothing.
SIZES = steps.Sizes(batch=8)


@functools.cache
def analysis(make_name: str, context: int) -> shardlint.Analysis:
    fn, args = getattr(steps, make_name)(context_mesh(context), SIZES)
    return shardlint.analyze(fn, *args)
