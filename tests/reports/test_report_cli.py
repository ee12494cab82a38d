"""`shardlint report`: analyze, rewrite, analyze again, sweep, write one HTML file.

The rewrite belongs to `shardlint.rewrites`; here it is replaced by the example pair (the
per-shard step is what a correct rewrite of `make_step` produces), so these tests check
the command's wiring whatever state the rewrite is in.
"""

from __future__ import annotations

import json

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
    captured = capsys.readouterr()
    err, capsys_out = captured.err, captured.out
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
    # the summary the demo prints, with the page's own figures
    findings = f"{_side(page, 'findings', 'before')} -> {_side(page, 'findings', 'after')}"
    gathers = f"{_side(page, 'all-gathers', 'before')} ("
    summary = capsys_out.splitlines()
    assert summary[0] == f"shardlint report: {TARGET} on mesh data=2,context=4"
    assert f"  findings:        {findings}" in summary
    assert summary[2].startswith(f"  all-gathers:     {gathers}") and " -> 0 (0 B/device)" in summary[2]
    assert "  context sweep (temp memory per device, before -> after):" in summary
    assert [line.split(":")[0].strip() for line in summary if line.startswith("    context=")] == ["context=2", "context=4"]
    assert any(line.startswith("  fixed: reshape at shardlint/examples/steps.py:") for line in summary)
    assert summary[-1] == f"  report: {out}"


def test_a_refused_rewrite_still_writes_the_page_and_marks_each_point(parse, tmp_path, capsys):
    """The capacity step's rewrite is refused wherever the tokens are sharded (its capacity
    couples all of them): at the report's own point and at context=2 of the sweep. The page
    and the data are written all the same; each refusal is said with its reason."""
    out, data = tmp_path / "report.html", tmp_path / "data.json"
    code = main(["report", "shardlint.examples.steps:make_capacity_step", "--mesh", "data=2,context=4",
                 "--sweep", "context=2,4", "--out", str(out), "--json", str(data)])
    captured = capsys.readouterr()
    assert code == 1, captured.err   # the step as it is keeps its findings
    doc = json.loads(data.read_text())
    reasons = {p["value"]: p["refused"] for p in doc["sweep"]["points"]}
    assert set(reasons) == {2, 4} and all("couples all tokens" in r for r in reasons.values())
    assert all(p["after"] is None for p in doc["sweep"]["points"]) and doc["after"] is None
    page = parse(out.read_text(encoding="utf-8"))
    for value, why in reasons.items():
        assert page.find("p", data_refused_at=str(value)).text() == f"The rewrite was refused at context={value}: {why}"
    assert page.find(id="rewrite-note").text().startswith("The rewrite was refused: ")
    summary = captured.out.splitlines()
    assert summary[1].startswith("  findings:        ") and "->" not in summary[1]
    assert summary[4].startswith("  rewrite refused: ") and "couples all tokens" in summary[4]
    points = [line for line in summary if line.startswith("    context=")]
    assert [p.split(":")[0].strip() for p in points] == ["context=2", "context=4"]
    assert all(p.endswith(" -> rewrite refused") for p in points)


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
