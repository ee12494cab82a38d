"""The gate on the real analyzer: a planted regression, churn-free baselines, every format.

Each example step is compiled once for the module; the churn tests compile what they must.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

import shardlint
from shardlint.examples import steps
from shardlint.gate import (BaselineRef, baseline_of, check_step, compare, dumps, parse_kinds,
                            read_baseline, render, write_baseline)
from shardlint.testing import assert_no_new_all_gathers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shardlint.__file__)))
STEPS_FILE = "shardlint/examples/steps.py"


def _flatten_line() -> int:
    """The line of the flatten in `routed_moe`, read from the file rather than hard-coded."""
    with open(steps.__file__) as fh:
        lines = fh.read().splitlines()
    start = next(i for i, text in enumerate(lines) if text.startswith("def routed_moe("))
    return next(i + 1 for i in range(start, len(lines))
                if "tokens_TD = x_BSD.reshape(b * s, d)" in lines[i])


@pytest.fixture(scope="module")
def lossy(mesh):
    fn, args = steps.make_step(mesh)
    return shardlint.analyze(fn, *args)


@pytest.fixture(scope="module")
def per_shard(mesh):
    fn, args = steps.make_per_shard_step(mesh)
    return shardlint.analyze(fn, *args)


@pytest.fixture(scope="module")
def regression(lossy, per_shard):
    """make_step checked against the baseline of make_per_shard_step."""
    return compare(lossy, baseline_of(per_shard, ROOT), root=ROOT,
                   baseline_path="shardlint.baseline.json",
                   update_hint="shardlint check T --mesh data=2,context=4 --update")


def test_planted_regression_fails_at_the_flatten_line(regression):
    assert not regression.passed
    context = [c for c in regression.regressions if c.axes == ("context",)]
    assert len(context) == 1
    change = context[0]
    assert change.status == "new" and change.kind == "all-gather"
    assert change.lines(ROOT)[0] == (STEPS_FILE, _flatten_line())
    assert change.bytes > 0
    assert any(f.op == "reshape" and "context" in f.axes for f in change.findings)
    assert all(c.kind == "all-gather" for c in regression.regressions)


def test_sharding_preserving_step_passes_against_its_own_baseline(per_shard):
    result = compare(per_shard, baseline_of(per_shard, ROOT), root=ROOT)
    assert result.passed and result.changes == ()
    assert not per_shard.all_gathers()


def test_fixing_the_step_reports_improvements_and_passes(lossy, per_shard):
    result = compare(per_shard, baseline_of(lossy, ROOT), root=ROOT)
    assert result.passed
    assert {c.status for c in result.improvements} == {"gone"}
    assert len(result.improvements) == len(lossy.all_gathers())


def test_recompiling_gives_a_byte_identical_baseline(mesh, lossy):
    fn, args = steps.make_step(mesh)
    again = shardlint.analyze(fn, *args)
    assert dumps(baseline_of(again, ROOT)) == dumps(baseline_of(lossy, ROOT))


SMALL_STEP = '''
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def make_step(mesh):
    def step(w_DF, x_BSD):
        def loss(w_DF):
            b, s, d = x_BSD.shape
            tokens_TD = x_BSD.reshape(b * s, d)
            return jnp.mean((tokens_TD @ w_DF) ** 2)
        return jax.value_and_grad(loss)(w_DF)

    w = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((4, 64, 16), jnp.float32,
                             sharding=NamedSharding(mesh, P("data", "context", None)))
    return step, (w, x)
'''


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_unrelated_lines_above_the_code_change_nothing(tmp_path, mesh):
    path = tmp_path / "model.py"
    path.write_text(SMALL_STEP)
    fn, args = _import(path, "gate_model_v1").make_step(mesh)
    before = shardlint.analyze(fn, *args)
    baseline = str(tmp_path / "shardlint.baseline.json")
    write_baseline(baseline_of(before, str(tmp_path)), baseline)

    path.write_text('"""A docstring added later."""\n\n# a comment\n\n\n' + SMALL_STEP)
    fn, args = _import(path, "gate_model_v2").make_step(mesh)
    after = shardlint.analyze(fn, *args)

    gathers = before.all_gathers()
    assert gathers, "the small step must gather something for this test to mean anything"
    assert after.all_gathers()[0].source.line == gathers[0].source.line + 5
    result = compare(after, read_baseline(baseline), root=str(tmp_path), kinds=parse_kinds("all"))
    assert result.passed and result.changes == ()
    assert dumps(baseline_of(after, str(tmp_path))) == open(baseline).read()


def test_json_format(regression):
    doc = json.loads(render(regression, "json"))
    assert doc["schema"] == "shardlint.check/1" and doc["passed"] is False
    new = [c for c in doc["changes"] if c["axes"] == ["context"]][0]
    assert new["status"] == "new" and new["fails"] is True
    assert new["lines"][0] == {"file": STEPS_FILE, "line": _flatten_line()}
    assert new["findings"][0]["op"] == "reshape"
    assert "neighbourhood" not in new["findings"][0]


def test_github_format(regression):
    out = render(regression, "github").splitlines()
    errors = [line for line in out if line.startswith("::error ")]
    assert len(errors) == len(regression.regressions)
    assert any(line.startswith(f"::error file={STEPS_FILE},line={_flatten_line()},") for line in errors)
    for line in errors:
        props, _, message = line[len("::error "):].partition("::")
        assert "\n" not in message and message
        assert "title=shardlint%3A new all-gather" in props


def test_github_reports_improvements_as_notices(lossy, per_shard):
    result = compare(per_shard, baseline_of(lossy, ROOT), root=ROOT)
    out = render(result, "github").splitlines()
    assert not any(line.startswith("::error") for line in out)
    assert sum(line.startswith(f"::notice file={STEPS_FILE},") for line in out) == len(
        lossy.all_gathers())


def test_sarif_has_the_required_fields(regression):
    doc = json.loads(render(regression, "sarif"))
    assert doc["version"] == "2.1.0" and doc["$schema"].endswith("sarif-2.1.0.json")
    (run,) = doc["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "shardlint"
    rule_ids = [r["id"] for r in driver["rules"]]
    assert len(rule_ids) == len(set(rule_ids)) and all(r["shortDescription"]["text"]
                                                       for r in driver["rules"])
    assert len(run["results"]) == len(regression.changes)
    for result in run["results"]:
        assert result["ruleId"] in rule_ids and rule_ids[result["ruleIndex"]] == result["ruleId"]
        assert result["level"] in ("none", "note", "warning", "error")
        assert result["message"]["text"]
        for loc in result["locations"]:
            physical = loc["physicalLocation"]
            assert physical["artifactLocation"]["uri"]
            assert physical["region"]["startLine"] >= 1
    flatten = [r for r in run["results"]
               if r["locations"][0]["physicalLocation"]["region"]["startLine"] == _flatten_line()]
    assert flatten and flatten[0]["level"] == "error"
    assert flatten[0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == STEPS_FILE


def test_text_format_names_file_line_bytes_and_finding(regression):
    text = render(regression, "text")
    assert text.startswith("shardlint check: FAILED")
    assert f"{STEPS_FILE}:{_flatten_line()} (routed_moe): new all-gather over context" in text
    assert "KiB per device" in text and "reshape" in text and "way out:" in text
    assert "--update" in text


def test_assert_no_new_all_gathers(tmp_path, lossy, per_shard):
    path = str(tmp_path / "train_step.json")
    write_baseline(baseline_of(per_shard, ROOT), path)
    assert assert_no_new_all_gathers(per_shard, baseline=path, root=ROOT).passed
    with pytest.raises(AssertionError, match="new all-gather over context"):
        assert_no_new_all_gathers(lossy, baseline=path, root=ROOT)
    # recording accepts the current collectives; the next check passes
    check_step(lossy, baseline=BaselineRef(path=path, update=True), root=ROOT)
    assert assert_no_new_all_gathers(lossy, baseline=path, root=ROOT).changes == ()
