"""Gate one step against its baseline, or record the baseline: the library entry point
that the CLI's `check`, `shardlint.testing` and the pytest plugin share.

The baseline is read before the step is compiled, so a missing or broken file fails in
a second, not after a compile. Keys name files relative to a project root; by default the
git top-level of the current directory, so the same checkout gives the same keys wherever
it lives and whichever folder the command runs from.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from typing import Callable

from ..analyzer import Analysis
from ._baseline import Baseline, baseline_of, read_baseline, write_baseline
from ._compare import DEFAULT_KINDS, CheckResult, compare


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaselineRef:
    """Where a baseline lives and whether this run records it instead of checking it."""

    path: str
    update: bool = False          # write the current collectives instead of comparing
    root: str | None = None       # project root for relative paths; None: default_root()
    update_hint: str = ""         # the command that records it, for error messages
    target: str = ""              # recorded in the file for the reader
    on_write: Callable[[str], None] | None = dataclasses.field(default=None, compare=False)


def default_root(cwd: str | None = None) -> str:
    """The git top-level of `cwd` (default: the current directory), else `cwd` itself."""
    cwd = os.path.abspath(cwd or os.getcwd())
    try:
        done = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd, timeout=10,
                              capture_output=True, text=True, check=False)
    except (OSError, subprocess.SubprocessError):
        return cwd
    top = done.stdout.strip()
    return os.path.abspath(top) if done.returncode == 0 and top else cwd


def check_step(step: Callable | Analysis, *args, baseline: BaselineRef | str | os.PathLike,
               kinds: tuple[str, ...] = DEFAULT_KINDS, tolerance: float = 0.0,
               root: str | None = None, progress: Callable[[str], None] | None = None
               ) -> CheckResult:
    """Analyzes `step(*args)` (or takes a finished Analysis) and compares it with the
    baseline; with `baseline.update` it first records the current collectives, so the
    result passes and lists nothing."""
    ref = baseline if isinstance(baseline, BaselineRef) else BaselineRef(path=os.fspath(baseline))
    root = os.path.abspath(root or ref.root or default_root())
    hint = ref.update_hint or f"shardlint check TARGET --mesh ... --baseline {ref.path} --update"
    before = None if ref.update else read_baseline(ref.path, how_to_create=hint)
    analysis = step if isinstance(step, Analysis) else _analyze(step, args, progress)
    if ref.update:
        before = record(analysis, ref, root)
    return compare(analysis, before, root=root, baseline_path=ref.path, kinds=tuple(kinds),
                   tolerance=tolerance, update_hint=hint)


def record(analysis: Analysis, ref: BaselineRef, root: str) -> Baseline:
    """Writes the baseline that accepts `analysis`; calls `ref.on_write` if the file changed."""
    baseline = baseline_of(analysis, root, target=ref.target)
    if write_baseline(baseline, ref.path) and ref.on_write is not None:
        ref.on_write(ref.path)
    return baseline


def _analyze(step: Callable, args: tuple, progress) -> Analysis:
    from ..analyzer import analyze

    return analyze(step, *args, progress=progress)
