"""Whether this JAX can still run GSPMD, for the tests that compare it with Shardy."""

from __future__ import annotations

import functools

import jax
import pytest


@functools.cache
def gspmd_runs() -> bool:
    """Whether `jax_use_shardy_partitioner=False` lowers to GSPMD here (JAX 0.12.1 keeps
    the switch and lowers to Shardy whatever it says)."""
    if not hasattr(jax.config, "jax_use_shardy_partitioner"):
        return False
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
        spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
        text = jax.jit(lambda a: a * 2, in_shardings=spec).lower(jax.numpy.ones(8)).as_text()
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    return "sdy." not in text


def skip_without_gspmd() -> None:
    if not gspmd_runs():
        pytest.skip(f"JAX {jax.__version__} does not lower to GSPMD "
                    f"(jax_use_shardy_partitioner=False gives Shardy, or is gone)")
