"""A step the TPU compiler refuses for lack of HBM is still analyzed: libtpu dumps the
partitioned program, its buffer assignment and live ranges before it refuses, so the
findings, the collectives and the buffers at the peak are read, and the compiler's own
figures say by how much it does not fit (`support/no_fit_step.py` on `v5e:2x2`: 16 GiB a
chip). Needs libtpu; run with `python -m pytest -q -m tpu -n 0`."""

from __future__ import annotations

import json
import os

import pytest

from shardlint.analyzer import analyze, fit_of
from shardlint.analyzer.compile._topology import topology_mesh
from shardlint.cli import main

from support import no_fit_step

pytestmark = pytest.mark.tpu

TOPOLOGY = "v5e:2x2"


@pytest.fixture(scope="module")
def analysis():
    fn, args = no_fit_step.make_step(topology_mesh({"data": 1, "context": 4}, TOPOLOGY))
    return analyze(fn, *args)


def test_the_refused_step_is_analyzed_with_the_compilers_figures(analysis):
    refused = analysis.does_not_fit
    assert refused is not None and refused.needed_bytes > refused.available_bytes > 15 * 2**30
    assert "HBM" in refused.message
    # What was read from the program the compiler partitioned before it refused: the
    # flatten that gathers the sequence, its all-gather, and the buffers at the peak.
    [finding] = analysis.findings
    assert (finding.op, finding.axes) == ("reshape", ("context",))
    lost = [c for c in analysis.all_gathers() if c.cause == "lost"]
    assert lost and {c.axes for c in lost} == {("context",)}
    assert {c.id for c in lost} == set(finding.collectives)
    assert analysis.memory.temp_bytes > refused.available_bytes
    assert analysis.memory.peak_buffers and analysis.memory.flops is None
    fit = fit_of(analysis)
    assert not fit.fits and fit.line().startswith("does not fit: the compiler refused the step")


def test_the_cli_reports_it_and_exits_1_with_both_figures_in_the_json(tmp_path, capsys):
    out = tmp_path / "a.json"
    target = os.path.join(os.path.dirname(no_fit_step.__file__), "no_fit_step.py") + ":make_step"
    code = main(["analyze", target, "--topology", TOPOLOGY, "--mesh", "data=1,context=4", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    assert "reshape drops context" in captured.out
    assert "does not fit: the compiler refused the step for lack of memory: needs" in captured.out
    assert "the compiler refused the step for lack of memory" in captured.err   # progress, then the analysis
    doc = json.loads(out.read_text())["does_not_fit"]
    assert doc["needed_bytes"] > doc["available_bytes"] > 0


def test_the_report_page_says_the_compiler_refused_it(analysis, tmp_path):
    from shardlint.reports import write_html

    page = (tmp_path / "r.html")
    write_html(analysis, path=str(page))
    text = page.read_text()
    assert 'data-figure="does-not-fit-before"' in text
    assert "the compiler refused it for lack of memory, needing" in text
