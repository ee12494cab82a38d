"""Test configuration: simulate 8 CPU devices before any backend starts.

This is the one place the device count is set; test modules never touch XLA_FLAGS.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")


@pytest.fixture
def run_cli():
    """Runs `shardlint ARGS...` in a fresh process, as a user would: the environment's
    XLA_FLAGS are dropped, so the device count comes from the CLI's own --mesh handling."""

    def run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        return subprocess.run([sys.executable, "-m", "shardlint.cli", *argv], capture_output=True,
                              text=True, env=env, timeout=timeout)

    return run


@pytest.fixture
def retraced_only(monkeypatch):
    """The step's Python refuses one shard's shapes, as a step whose mask has the
    configured length does: the rewrite traces its jaxpr again there instead (`_retrace`)."""
    from shardlint.rewrites import _trace

    def refuse(fn, avals):
        raise ValueError("Incompatible shapes for broadcasting (forced by the test)")

    monkeypatch.setattr(_trace, "_python_trace", refuse)
