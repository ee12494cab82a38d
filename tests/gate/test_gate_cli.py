"""`shardlint check` through `shardlint.cli.main`, in process: exit codes and formats.

Exit 2 cases fail before anything is compiled; the others compile the example steps.
"""

from __future__ import annotations

import json
import os

import pytest

import shardlint
from shardlint.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shardlint.__file__)))
LOSSY = "shardlint.examples.steps:make_step"
PER_SHARD = "shardlint.examples.steps:make_per_shard_step"
MESH = "data=2,context=4"


def _check(target, baseline, *extra):
    return main(["check", target, "--mesh", MESH, "--baseline", str(baseline), "--root", ROOT,
                 *extra])


@pytest.fixture(scope="module")
def per_shard_baseline(tmp_path_factory):
    """The baseline of the sharding-preserving step, recorded through the CLI."""
    path = tmp_path_factory.mktemp("cli") / "shardlint.baseline.json"
    assert _check(PER_SHARD, path, "--update") == 0
    return path


def test_update_writes_a_baseline_and_the_same_step_passes(per_shard_baseline, capsys):
    doc = json.loads(per_shard_baseline.read_text())
    assert doc["schema"] == "shardlint.baseline/2" and doc["target"] == PER_SHARD
    assert doc["mesh"] == {"data": 2, "context": 4}
    assert _check(PER_SHARD, per_shard_baseline) == 0
    out = capsys.readouterr().out
    assert out.startswith("shardlint check: passed")


@pytest.mark.parametrize("fmt", ["text", "json", "github", "sarif"])
def test_new_all_gather_exits_1_in_every_format(per_shard_baseline, capsys, fmt):
    assert _check(LOSSY, per_shard_baseline, "--format", fmt) == 1
    out = capsys.readouterr().out
    flatten = "shardlint/examples/steps.py"
    if fmt == "text":
        assert "FAILED" in out and f"{flatten}:" in out and "new all-gather over context" in out
    elif fmt == "json":
        doc = json.loads(out)
        assert doc["passed"] is False
        assert any(c["status"] == "new" and c["axes"] == ["context"] for c in doc["changes"])
    elif fmt == "github":
        assert any(line.startswith(f"::error file={flatten},line=") for line in out.splitlines())
    else:
        doc = json.loads(out)  # stdout holds the SARIF document and nothing else
        assert doc["version"] == "2.1.0"
        assert any(r["level"] == "error" for r in doc["runs"][0]["results"])


def test_widening_kinds_and_tolerance_are_accepted(per_shard_baseline, capsys):
    """all-reduces of the fix are in its own baseline, so widening to them still passes."""
    assert _check(PER_SHARD, per_shard_baseline, "--kinds", "all-gather,all-reduce",
                  "--tolerance", "5%") == 0
    assert "watching all-gather, all-reduce; byte tolerance 5%" in capsys.readouterr().out


def test_missing_baseline_exits_2_and_says_how_to_create_it(tmp_path, capsys):
    assert _check(LOSSY, tmp_path / "none.json") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no baseline at" in err[0] and "--update" in err[0]


@pytest.mark.parametrize("content", ['{"schema": "shardlint.baseline/2", "collec',
                                     '{"schema": "shardlint.baseline/9", "collectives": []}'])
def test_corrupted_or_foreign_baseline_exits_2(tmp_path, capsys, content):
    path = tmp_path / "b.json"
    path.write_text(content)
    assert _check(LOSSY, path) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    assert captured.err.startswith("shardlint: error: baseline") and "--update" in captured.err


@pytest.mark.parametrize("extra, says", [(["--kinds", "all-gathr"], "--kinds"),
                                         (["--tolerance", "lots"], "--tolerance"),
                                         # With a space argparse would take -5% for an option.
                                         (["--tolerance", "-5%"], "give a percentage >= 0")])
def test_bad_options_exit_2(tmp_path, capsys, extra, says):
    assert _check(LOSSY, tmp_path / "b.json", *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "usage:" not in err[0]


def test_unknown_format_is_a_usage_error(tmp_path, capsys):
    assert _check(LOSSY, tmp_path / "b.json", "--format", "xml") == 2
    assert "--format" in capsys.readouterr().err


def test_a_baseline_from_another_mesh_fails_with_the_way_out(per_shard_baseline, capsys):
    capsys.readouterr()
    code = main(["check", PER_SHARD, "--mesh", "data=4,context=2", "--baseline", str(per_shard_baseline),
                 "--root", ROOT])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert f"recorded on mesh {MESH}, this run is on data=4,context=2" in err
    assert "--update" in err and "data=4,context=2" in err.split("record a baseline for this one:")[1]
