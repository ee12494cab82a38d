"""Test configuration: simulate 8 CPU devices before any backend starts.

This is the one place the test process's device count and XLA_FLAGS are set. Tests that
start a process as a user would give it the XLA_FLAGS of what they test (a dump folder, a
device count the CLI must read) through `support.processes.user_env`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from support.processes import FAST_KERNELS, user_env

# Keras fixes its backend when it is first imported, and other test files' libraries import it
# (TensorFlow's, through MaxText's imports); a test process runs several files, in any order.
os.environ.setdefault("KERAS_BACKEND", "jax")

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

# LLVM at -O0 for the kernels XLA:CPU emits: the tests read XLA's HLO passes (propagated
# shardings, the partitioned program, the buffer assignment), which this flag leaves as they
# are (the same compiled text and memory_analysis() on the examples, JAX 0.10.2 and 0.12.0.1);
# compiles take about two thirds of the time (the demo's three meshes: 40.6 s -> 27.7 s).
# Set before the backend starts; processes the tests start as a user would get theirs from
# `support.processes.user_env`.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_KERNELS}".strip()


@pytest.fixture(scope="session")
def mesh():
    """data=2 x context=4 on Auto axes (`support.build_mesh`): the mesh most tests analyze on.
    A test that parametrizes `mesh` itself gets its own values instead."""
    from support import build_mesh

    return build_mesh({"data": 2, "context": 4})


@pytest.fixture
def run_cli():
    """Runs `shardlint ARGS...` in a fresh process, as a user would: the environment's
    XLA_FLAGS are dropped (but the -O0 kernels above), so the device count comes from the
    CLI's own --mesh handling."""

    def run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "shardlint.cli", *argv], capture_output=True,
                              text=True, env=user_env(), timeout=timeout)

    return run
