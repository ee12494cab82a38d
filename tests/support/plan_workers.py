"""Workers for `shardlint.commands._engine` tests: importable by the processes it spawns."""

from __future__ import annotations

import os


def pid_and_spec(spec):
    """What ran where: this process's id, and the spec it was given."""
    return os.getpid(), spec, os.environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD")


def raises(spec):
    raise ValueError(f"no point at {spec}")


def dies(spec):
    os._exit(9)
