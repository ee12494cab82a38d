"""XLA dumps written as a user's job writes them, and the live analysis to compare them with.

`write_dumps` runs `dump_job.py` once per job, each in a process of its own with
`XLA_FLAGS=--xla_dump_to=...` set (two at a time); `live_analysis` builds the same step with
the job's own function and analyzes it in the test's process. The dump and peak tests share
both.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from shardlint import analyze
from shardlint.analyzer.compile._dump import PROPAGATION_PASSES

from .dump_job import build
from .processes import user_env

JOB = Path(__file__).with_name("dump_job.py")
FULL_FLAGS = f"--xla_dump_hlo_as_text --xla_dump_hlo_pass_re={PROPAGATION_PASSES}"


def write_dumps(root: Path, jobs: dict[str, tuple], flags: str = FULL_FLAGS,
                topology: str | None = None, env_extra: dict | None = None) -> dict[str, Path]:
    """Runs every job in its own process (two at a time) and returns their dump folders."""
    folders, running = {}, []
    for label, (step, axes) in jobs.items():
        folder = root / label.replace(" ", "_").replace(",", "")
        devices = "" if topology else f"--xla_force_host_platform_device_count={math.prod(axes.values())} "
        env = user_env(f"{devices}--xla_dump_to={folder} {flags}",
                       # this session's own libtpu holds its lockfile; the job loads another
                       **({"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"} if topology else {}), **(env_extra or {}))
        argv = [sys.executable, str(JOB), step, ",".join(f"{k}={v}" for k, v in axes.items())]
        running.append((label, subprocess.Popen(argv + ([topology] if topology else []), env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        folders[label] = folder
        if len(running) == 2 or label == list(jobs)[-1]:
            for name, proc in running:
                _, err = proc.communicate(timeout=600)
                assert proc.returncode == 0, f"the {name} job failed:\n{err[-3000:]}"
            running = []
    return folders


def live_analysis(step_name: str, axes: dict[str, int]):
    """The same step, built by the job's own function, analyzed live in this process."""
    step, args = build(step_name, axes, None)
    return analyze(step, *args)
