"""The example's whole story at context 2, 4 and 8 (findings before, none after, memory
per device falling with the context degree) and the demo's outputs agreeing with each
other: the terminal summary, both JSON analyses and the HTML report show the same numbers.
"""

from __future__ import annotations

import functools
import json
from html.parser import HTMLParser

import pytest

import shardlint
from shardlint.examples import decoder

from support import build_mesh

CFG = decoder.DecoderConfig(layers=1)


@functools.cache
def _before_after(context: int):
    # data=1: the batch stays whole, so only context parallelism divides the tokens.
    mesh = build_mesh({"data": 1, "context": context})
    step, args = decoder.make_step(mesh, CFG)
    before = shardlint.analyze(step, *args)
    fixed = shardlint.rewrite(step, mesh, args=args, analysis=before, verify=True)
    return before, shardlint.analyze(fixed, *args)


@pytest.mark.parametrize("context", [2, 4, 8])
def test_example_findings_before_none_after(context):
    before, after = _before_after(context)
    assert any(f.op == "reshape" and "context" in f.axes and f.feeds_grouped_matmul for f in before.findings)
    assert after.findings == ()
    # What stays gathered over context is the attention's K/V, which the model asks for.
    assert all(c.source.file.endswith("decoder.py") for c in after.all_gathers())


def test_example_memory_after_falls_with_the_context_degree():
    temps = [_before_after(n)[1].memory.temp_bytes for n in (2, 4, 8)]
    originals = [_before_after(n)[0].memory.temp_bytes for n in (2, 4, 8)]
    assert temps[0] > temps[1] > temps[2]
    # Each doubling of the context degree at least nearly halves the rewritten step's
    # memory (attention's gathered K/V is the part that does not shrink), while the
    # original keeps most of it.
    assert temps[2] < 0.35 * temps[0]
    assert originals[2] > 0.5 * originals[0]


class _Figures(HTMLParser):
    def __init__(self):
        super().__init__()
        self.values: dict[tuple[str, str], str] = {}
        self._figure = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-figure" in attrs:
            self._figure = attrs["data-figure"]
        if self._figure and "data-side" in attrs and "data-value" in attrs:
            self.values.setdefault((self._figure, attrs["data-side"]), attrs["data-value"])


@pytest.mark.slow
def test_demo_outputs_agree(tmp_path):
    from shardlint.commands import run_demo

    summary = run_demo(str(tmp_path), progress=lambda message: None)
    before = shardlint.Analysis.from_json(json.loads((tmp_path / "before.json").read_text()))
    after = shardlint.Analysis.from_json(json.loads((tmp_path / "after.json").read_text()))
    assert f"findings:        {len(before.findings)} -> {len(after.findings)}" in summary
    assert f"all-gathers:     {len(before.all_gathers())} " in summary
    page = _Figures()
    page.feed((tmp_path / "report.html").read_text(encoding="utf-8"))
    assert int(page.values[("findings", "before")]) == len(before.findings)
    assert int(page.values[("findings", "after")]) == len(after.findings) == 0
    assert int(page.values[("all-gathers", "before")]) == len(before.all_gathers())
    assert int(page.values[("all-gathers", "after")]) == len(after.all_gathers())
