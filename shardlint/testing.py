"""Assertions for a project's own test suite: keep a training step's collectives fixed.

`assert_no_new_all_gathers` fails a test with the gate's text report (which all-gather is
new, where, how many bytes, which finding explains it) so the failure reads the same as
`shardlint check`. Baselines come from the `shardlint_baseline` pytest fixture, which also
handles `pytest --shardlint-update`, or from a plain path.
"""

from __future__ import annotations

import os
from typing import Callable

from .analyzer import Analysis
from .gate import DEFAULT_KINDS, BaselineRef, CheckResult, check_step, format_text


def assert_no_new_all_gathers(step: Callable | Analysis, *args,
                              baseline: BaselineRef | str | os.PathLike,
                              kinds: tuple[str, ...] = DEFAULT_KINDS, tolerance: float = 0.0,
                              root: str | None = None) -> CheckResult:
    """Compiles `step(*args)` (or takes an Analysis) and raises AssertionError if a
    collective of a watched kind (all-gather unless `kinds` widens it) is new or grew by
    more than `tolerance` (a fraction: 0.05 = 5%) against the baseline. Returns the
    comparison, which also lists improvements."""
    result = check_step(step, *args, baseline=baseline, kinds=kinds, tolerance=tolerance, root=root)
    if not result.passed:
        raise AssertionError(format_text(result))
    return result
