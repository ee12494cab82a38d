"""Strings from user code (op names, paths, source lines) reach the page inert.

A hostile analysis is built from a real one with `dataclasses.replace`: op names, op
paths, shapes, a function name, a version and a source line carry `<script>`, quotes and
an `<img onerror>`. The page must show them as text and never as markup, and the
embedded JSON must not be able to close its <script>.
"""

from __future__ import annotations

import dataclasses
import json

from shardlint.analyzer import Analysis, GraphNode, Neighbourhood, Source
from shardlint.reports import render_html

EVIL = '<script>alert("pwned")</script>'
IMG = "<img src=x onerror=alert(1)>"
LINE = 'y = "<script>alert(1)</script>"  # it\'s "quoted" & <b>bold</b>'


def _hostile(analysis: Analysis, tmp_path) -> tuple[Analysis, Source]:
    path = tmp_path / 'evil"<dir>.py'
    path.write_text(f"def f():\n    {LINE}\n    return y\n")
    src = Source(str(path), 2, EVIL)
    nodes = (GraphNode(id='n"1', op=EVIL, shape=f"f32[4] P('data') {IMG}", source=src, focus=True),
             GraphNode(id="n2", op=IMG, shape="f32[4] P(None)", source=None))
    finding = dataclasses.replace(
        analysis.findings[0], op=EVIL, op_path=EVIL + IMG, message=EVIL, way_out=IMG, source=src,
        operand_shape=EVIL, result_shape=IMG, axes=("context",),
        neighbourhood=Neighbourhood(nodes=nodes, edges=(('n"1', "n2"),)))
    first = analysis.collectives[0]
    collective = dataclasses.replace(first, op_path=EVIL, shape=IMG, source=src,
                                     id=finding.collectives[0] if finding.collectives else first.id)
    hostile = dataclasses.replace(
        analysis, findings=(finding,), collectives=(collective, *analysis.collectives[1:]),
        versions={**analysis.versions, "jax": EVIL})
    return hostile, src


def test_user_strings_are_escaped_and_inert(pair, parse, tmp_path):
    hostile, src = _hostile(pair[0], tmp_path)
    text = render_html(hostile, pair[1], title=EVIL)
    page = parse(text)

    assert "<script>alert" not in text and "<img src=x" not in text
    scripts = page.find_all("script")
    assert len(scripts) == 2, "a user string opened a <script>"
    assert text.count("</script>") == 2
    assert not page.find_all("img") and "bold" not in [b.text() for b in page.find_all("b")]
    assert not [e for e in page.iter() for k in e.attrs if k.startswith("on")]

    # shown as text, exactly as written
    art = page.find("article", data_side="before")
    assert art.attrs["data-op"] == EVIL  # the quote did not break out of the attribute
    assert art.find("code", **{"class": "op"}).text() == EVIL
    assert LINE in art.find("span", **{"class": "line focus"}).text()
    assert art.find("pre").attrs["data-file"] == src.file
    assert EVIL in art.find(**{"class": "message"}).text()
    assert IMG in art.find(**{"class": "way-out"}).text()
    node = art.find("g", data_node='n"1')
    assert node.attrs["data-op"] == EVIL and EVIL in node.find("title").text()
    assert page.find(data_figure="version-jax").attrs["data-value"] == EVIL
    assert page.find("title").text() == f"shardlint report: {EVIL}"
    table = page.find("table", id="collectives-table")
    assert any(td.attrs.get("title", "").startswith(EVIL + " (") for td in table.find_all("td", **{"class": "path"}))
    assert IMG in [td.text() for td in table.find_all("td", **{"class": "mono shape"})]

    # the JSON keeps the strings and cannot close its script
    raw = page.find("script", id="shardlint-analysis").text()
    assert "<" not in raw and ">" not in raw
    doc = json.loads(raw)
    assert Analysis.from_json(doc["before"]) == hostile
    assert doc["title"] == EVIL
