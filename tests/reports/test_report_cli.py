"""`shardlint report`: analyze, rewrite, analyze again, sweep, write one HTML file.

The rewrite belongs to `shardlint.rewrites`; here it is replaced by the example pair (the
per-shard step is what a correct rewrite of `make_step` produces), so these tests check
the command's wiring whatever state the rewrite is in.
"""

from __future__ import annotations


import pytest

from shardlint import UsageError
from shardlint.cli import main
from shardlint.commands._sweep import device_count, parse_sweep_spec, sweep_meshes

TARGET = "shardlint.examples.steps:make_step"


def _side(page, figure, side):
    found = page.find(data_figure=figure).find_all(data_side=side)
    return found[0].attrs["data-value"] if found else None


def test_report_with_rewrite_and_sweep(parse, tmp_path, capsys):
    out = tmp_path / "report.html"
    code = main(["report", TARGET, "--mesh", "data=2,context=4", "--sweep", "context=2,4",
                 "--out", str(out)])
    assert code == 0  # the rewritten step has no findings
    err = capsys.readouterr().err
    assert "wrote" in err
    # The mesh point is rewritten and verified; the one new sweep point (context=4 is
    # reused) is rewritten without running it.
    assert err.count("verifying the rewrite") == 1
    assert "sweep context=2" in err and "sweep context=4" not in err
    page = parse(out.read_text(encoding="utf-8"))
    assert int(_side(page, "all-gathers", "before")) > 0
    assert int(_side(page, "all-gathers", "after")) == 0
    assert int(_side(page, "findings", "after")) == 0
    chart = page.find("svg", **{"class": "chart"})
    assert sorted(int(c.attrs["data-x"]) for c in chart.find_all("circle", data_series="after")) == [2, 4]
    assert page.find("h1").text() == TARGET


def test_report_without_rewrite_is_a_single_analysis(parse, tmp_path):
    out = tmp_path / "single.html"
    assert main(["report", TARGET, "--mesh", "data=2,context=4", "--no-rewrite", "--out", str(out)]) == 1
    page = parse(out.read_text(encoding="utf-8"))
    # The flatten and the argsort drop axes; XLA:CPU's partitioner also gathers the
    # router logits for its TopK custom call (an `unsplit-op` finding).
    assert int(_side(page, "findings", "before")) == 3
    assert _side(page, "findings", "after") is None
    assert not page.find_all("svg", **{"class": "chart"})


@pytest.mark.parametrize("argv,message", [
    (["--sweep", "context=a"], "cannot read 'context=a'"),
    (["--sweep", "expert=1,2"], "--sweep expert: neither an axis of --mesh (data, context) nor an option"),
    (["--sweep", "sizes=1,2", "--set", "sizes=1"], "give its values in --sweep only"),
    (["--sweep", "context=2,2"], "repeats a value"),
    (["--mesh", "data=2,context=x"], "--mesh: cannot read"),
])
def test_usage_errors_are_one_line_and_exit_2(argv, message, tmp_path, capsys):
    mesh = [] if "--mesh" in argv else ["--mesh", "data=2,context=4"]
    args = ["report", TARGET, *mesh, "--no-rewrite", "--out", str(tmp_path / "r.html"), *argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "r.html").exists()


def test_sweep_spec_and_device_count():
    assert parse_sweep_spec("context=8,1, 2,4") == ("context", (1, 2, 4, 8))
    mesh = {"data": 2, "context": 4}
    assert sweep_meshes(mesh, "context", (1, 8)) == [{"data": 2, "context": 1}, {"data": 2, "context": 8}]
    assert list(sweep_meshes(mesh, "context", (8,))[0]) == ["data", "context"]  # order kept
    assert device_count(mesh, ("context", (1, 2, 4, 8))) == 16
    assert device_count(mesh, ("context", (1, 2))) == 8
    assert device_count(mesh, None) == 8
    with pytest.raises(UsageError, match=">= 1"):
        parse_sweep_spec("context=0,2")


@pytest.mark.slow
def test_sweep_simulates_the_largest_mesh_before_jax_starts(tmp_path, run_cli):
    """A fresh process: --mesh needs 8 devices, context=8 needs 16."""
    out = tmp_path / "sweep.html"
    proc = run_cli("report", TARGET, "--mesh", "data=2,context=4", "--no-rewrite",
                   "--sweep", "context=1,8", "--out", str(out))
    assert proc.returncode == 1, proc.stderr
    text = out.read_text(encoding="utf-8")
    assert 'data-series="before" data-x="8"' in text and "compiling for 16 devices" in proc.stderr
