"""The example steps analyzed once per test session, shared by the analyzer tests."""

from __future__ import annotations

import functools

import jax
from jax.sharding import AxisType

import shardlint
from shardlint.examples import steps

# Two batch rows per device at every mesh: with a single row per device a (batch, seq)
# merge can carry the seq sharding, and XLA rightly loses nothing.
SIZES = steps.Sizes(batch=8)


def mesh(context: int):
    return jax.make_mesh((8 // context, context), ("data", "context"),
                         axis_types=(AxisType.Auto,) * 2)


@functools.cache
def analysis(make_name: str, context: int) -> shardlint.Analysis:
    fn, args = getattr(steps, make_name)(mesh(context), SIZES)
    return shardlint.analyze(fn, *args)
