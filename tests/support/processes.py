"""The environment of a process that a test starts as a user would (`user_env`).

The test process's own XLA_FLAGS are set once, in `tests/conftest.py`; a process started as
a user would gets the XLA_FLAGS of what it tests (a device count the CLI must read, a dump
folder), with LLVM at -O0 for XLA:CPU's kernels where its compiles are not what is tested
(`FAST_KERNELS`: the HLO passes the tests read are the same; compiles take two thirds of
the time).
"""

from __future__ import annotations

import os

FAST_KERNELS = "--xla_backend_optimization_level=0"


def user_env(xla_flags: str = FAST_KERNELS, *, drop: tuple[str, ...] = (),
             **extra: str) -> dict[str, str]:
    """This process's environment with XLA_FLAGS `xla_flags` (none when empty) in place of
    the tests' own, the variables in `drop` left out and `extra` added."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and k not in drop}
    return env | ({"XLA_FLAGS": xla_flags} if xla_flags else {}) | extra
