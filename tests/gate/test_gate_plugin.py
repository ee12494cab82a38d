"""The pytest plugin end to end: an inner pytest session (its own process, so it sets its
own device count) records a baseline, fails when the step gains an all-gather, and passes
again once `--shardlint-update` accepts it."""

from __future__ import annotations

import json

pytest_plugins = ["pytester"]

# inner sessions skip plugins they do not need: each run starts a fresh interpreter
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")

CONFTEST = """
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
"""

TEST_MODULE = """
import jax

from shardlint.examples import steps
from shardlint.testing import assert_no_new_all_gathers


def test_train_step_collectives(shardlint_baseline):
    mesh = jax.make_mesh((2, 4), ("data", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    step, args = steps.{factory}(mesh)
    assert_no_new_all_gathers(step, *args, baseline=shardlint_baseline("train_step"))
"""


def test_plugin_fails_on_a_new_all_gather_and_passes_after_update(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_train=TEST_MODULE.format(factory="make_per_shard_step"))
    baseline = pytester.path / "shardlint_baselines" / "train_step.json"

    recorded = pytester.runpytest_subprocess(*QUIET, "--shardlint-update")
    recorded.assert_outcomes(passed=1)
    recorded.stdout.fnmatch_lines(["*shardlint baselines written*", "*train_step.json*"])
    assert json.loads(baseline.read_text())["schema"] == "shardlint.baseline/2"

    # the change under review: flatten (batch, seq) outside shard_map
    pytester.makepyfile(test_train=TEST_MODULE.format(factory="make_step"))
    failed = pytester.runpytest_subprocess(*QUIET)
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(["*AssertionError: shardlint check: FAILED*",
                                 "*steps.py:* (routed_moe): new all-gather over context*",
                                 "*to accept these collectives: pytest *--shardlint-update*"])

    pytester.runpytest_subprocess(*QUIET, "--shardlint-update").assert_outcomes(
        passed=1)
    pytester.runpytest_subprocess(*QUIET).assert_outcomes(passed=1)


def test_plugin_says_how_to_create_a_missing_baseline(pytester):
    """Nothing compiles before the baseline is read, so this runs in process."""
    pytester.makepyfile(test_missing=TEST_MODULE.format(factory="make_step"))
    result = pytester.runpytest_inprocess(*QUIET)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*BaselineError: no baseline at *train_step.json; create it "
                                 "with `pytest *test_missing.py::test_train_step_collectives "
                                 "--shardlint-update`*"])
