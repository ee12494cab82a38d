"""The HTML report shows exactly the analysis: headline, findings, collectives, diff, sweep.

Every figure is read back from the parsed page (its `data-*` attributes) and compared
with the Analysis it came from, so a template change that shows a wrong number fails.
"""

from __future__ import annotations

import collections
import json
import os
import re

import pytest

from shardlint.analyzer import Analysis
from shardlint.gate import collective_key
from shardlint.reports import REPORT_SCHEMA, render_html, write_html
from shardlint.reports._html import anchor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def page_text(pair, sweep):
    before, after = pair
    return render_html(before, after, sweep=sweep, title="steps:make_step", root=ROOT)


@pytest.fixture(scope="module")
def page(page_text, parse):
    return parse(page_text)


def _side(page, figure, side):
    box = page.find(data_figure=figure)
    found = box.find_all(data_side=side)
    return found[0].attrs["data-value"] if found else None


def test_headline_shows_all_gathers_memory_findings_mesh_and_versions(page, pair):
    before, after = pair
    for side, a in (("before", before), ("after", after)):
        ags = a.all_gathers()
        assert int(_side(page, "all-gathers", side)) == len(ags)
        assert int(_side(page, "all-gather-bytes", side)) == sum(c.bytes for c in ags)
        assert int(_side(page, "temp-bytes", side)) == a.memory.temp_bytes
        # XLA:CPU computes no per-device peak: the headline leaves the figure out.
        assert a.memory.peak_bytes is None and not page.find_all(data_figure="peak-bytes")
        assert int(_side(page, "findings", side)) == len(a.findings)
        assert int(_side(page, "collectives", side)) == len(a.collectives)
    assert len(before.all_gathers()) > len(after.all_gathers()) == 0  # the example's point
    assert page.find(data_figure="mesh").attrs["data-value"] == "data=2,context=4"
    assert page.find(data_figure="version-jax").attrs["data-value"] == before.versions["jax"]
    assert page.find(data_figure="version-jaxlib").attrs["data-value"] == before.versions["jaxlib"]
    verdict = page.find(id="verdict").text()
    assert f"removes {len(before.all_gathers())} all-gather(s)" in verdict


def test_memory_table_matches_memory_analysis(page, pair):
    before, after = pair
    for field in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "peak_bytes"):
        row = page.find("tr", data_figure=f"memory-{field}")
        for side, a in (("before", before), ("after", after)):
            value = getattr(a.memory, field)
            assert row.find(data_side=side).attrs["data-value"] == ("" if value is None else str(value))


def test_each_finding_shows_axes_op_source_lines_collectives_way_out_and_graph(page, pair):
    before, _ = pair
    articles = page.find_all("article", data_side="before")
    assert len(articles) == len(before.findings) == 3  # flatten, argsort, the TopK custom call
    rows = {tr.attrs["id"] for tr in page.find_all("tr", data_status=True)}
    for art, f in zip(articles, before.findings):
        assert art.attrs["data-op"] == f.op
        assert art.attrs["data-axes"] == ",".join(f.axes)
        assert int(art.attrs["data-bytes"]) == f.bytes
        assert [a.text() for a in art.find_all("span", **{"class": "axis"})] == list(f.axes)
        focus = art.find("span", **{"class": "line focus"})
        assert int(focus.attrs["data-line"]) == f.source.line
        with open(f.source.file) as fh:
            assert fh.read().splitlines()[f.source.line - 1] in focus.text()
        assert len(art.find("pre").find_all("span", data_line=True)) == 7  # 3 lines either side
        causes = art.find_all("li", data_collective=True)
        assert [li.attrs["data-collective"] for li in causes] == list(f.collectives)
        for li in causes:
            assert li.find("a").attrs["href"].lstrip("#") in rows
        assert f.way_out in art.find(**{"class": "way-out"}).text()
        nodes = art.find("svg").find_all("g", data_node=True)
        assert {g.attrs["data-node"] for g in nodes} == {n.id for n in f.neighbourhood.nodes}
        focused = [g.attrs["data-node"] for g in nodes if "focus" in g.classes()]
        assert focused == [n.id for n in f.neighbourhood.nodes if n.focus]
        edges = art.find("svg").find_all("path", data_from=True)
        assert {(p.attrs["data-from"], p.attrs["data-to"]) for p in edges} == set(f.neighbourhood.edges)
    assert page.find(data_figure="after-finding-count").attrs["data-value"] == "0"


def test_collective_table_groups_by_gate_key_and_diffs_before_after(page, pair):
    before, after = pair
    count_b = collections.Counter(collective_key(c, ROOT) for c in before.collectives)
    count_a = collections.Counter(collective_key(c, ROOT) for c in after.collectives)
    key_of = {anchor(k): k for k in set(count_b) | set(count_a)}
    rows = page.find("table", id="collectives-table").find_all("tr", data_status=True)
    assert {r.attrs["id"] for r in rows} == set(key_of)
    statuses = collections.Counter()
    for r in rows:
        key = key_of[r.attrs["id"]]
        count = r.find("td", data_col="count")
        assert int(count.attrs["data-before"]) == count_b[key]
        assert int(count.attrs["data-after"]) == count_a[key]
        expected = ("gone" if not count_a[key] else "new" if not count_b[key]
                    else "same" if count_a[key] == count_b[key] else "changed")
        assert r.attrs["data-status"] == expected
        statuses[expected] += 1
        moved = r.find("td", data_col="bytes")
        assert int(moved.attrs["data-before"]) == sum(
            c.bytes for c in before.collectives if collective_key(c, ROOT) == key)
    for status in ("new", "gone", "changed", "same"):
        assert int(page.find(data_figure=f"diff-{status}").attrs["data-value"]) == statuses[status]
    gone_ags = [r for r in rows if r.attrs["data-kind"] == "all-gather" and r.attrs["data-status"] == "gone"]
    assert len(gone_ags) == len({collective_key(c, ROOT) for c in before.all_gathers()})


def test_sweep_chart_plots_temp_memory_per_point_with_ideal_lines(page, sweep):
    chart = page.find("svg", **{"class": "chart"})
    for series in ("before", "after"):
        points = {int(c.attrs["data-x"]): int(c.attrs["data-bytes"])
                  for c in chart.find_all("circle", data_series=series)}
        assert points == {p["value"]: p[series].memory.temp_bytes for p in sweep["points"]}
        assert chart.find("polyline", data_series=f"ideal-{series}")
    table_rows = page.find("table", **{"class": "grid sweep-table"}).find_all("tr", data_sweep_value=True)
    assert [int(r.attrs["data-sweep-value"]) for r in table_rows] == [1, 2, 4]


def test_analysis_json_is_embedded_and_round_trips(page_text, page, pair, sweep):
    before, after = pair
    blob = page.find("script", id="shardlint-analysis")
    assert blob.attrs["type"] == "application/json"
    raw = blob.text()
    assert "<" not in raw
    doc = json.loads(raw)
    assert doc["schema"] == REPORT_SCHEMA
    assert Analysis.from_json(doc["before"]) == before
    assert Analysis.from_json(doc["after"]) == after
    assert [p["value"] for p in doc["sweep"]["points"]] == [1, 2, 4]
    assert doc["sweep"]["points"][0]["before"]["memory"]["temp_bytes"] == \
        sweep["points"][0]["before"].memory.temp_bytes


def test_page_is_self_contained_under_a_csp_that_forbids_the_network(page_text, page):
    csp = page.find("meta", http_equiv="Content-Security-Policy").attrs["content"]
    assert "default-src 'none'" in csp
    assert "script-src 'unsafe-inline'" in csp and "style-src 'unsafe-inline'" in csp
    assert "img-src data:" in csp
    for e in page.iter():
        assert e.tag not in ("link", "iframe", "object", "embed", "img")
        assert "src" not in e.attrs, f"<{e.tag}> loads {e.attrs['src']}"
        href = e.attrs.get("href", "#")
        assert href.startswith("#"), f"<{e.tag}> links out to {href}"
    assert not re.search(r"url\((?!data:)|@import|https?://(?!www\.w3\.org/2000/svg)", page_text)
    scripts = page.find_all("script")
    assert len(scripts) == 2 and scripts[1].text().strip().startswith("/*")


def test_single_analysis_has_no_after_side(pair, parse, tmp_path):
    before, _ = pair
    path = write_html(before, path=str(tmp_path / "one.html"), root=ROOT)
    page = parse(open(path, encoding="utf-8").read())
    assert int(_side(page, "all-gathers", "before")) == len(before.all_gathers())
    assert _side(page, "all-gathers", "after") is None
    rows = page.find("table", id="collectives-table").find_all("tr", data_status=True)
    assert rows and all(r.attrs["data-status"] == "" and "data-after" not in r.find("td", data_col="count").attrs
                        for r in rows)
    assert not page.find_all(id="after-findings")
    doc = json.loads(page.find("script", id="shardlint-analysis").text())
    assert doc["after"] is None and doc["sweep"] is None


def test_write_html_reports_an_unwritable_path_as_a_usage_error(pair, tmp_path):
    from shardlint import UsageError

    with pytest.raises(UsageError, match="cannot write the report"):
        write_html(pair[0], path=str(tmp_path / "missing" / "r.html"))


def test_sweep_structure_is_checked(pair):
    with pytest.raises(ValueError, match="sweep must be"):
        render_html(pair[0], sweep={"points": []})
    with pytest.raises(ValueError, match="'before' Analysis"):
        render_html(pair[0], sweep={"axis": "context", "points": [{"value": 1, "before": None}]})


def test_merged_collectives_show_a_short_shape_with_the_whole_one_in_the_title(pair, parse):
    from shardlint.reports._html import shape_text

    import dataclasses

    # XLA merges gradient all-reduces into one tuple-shaped op (the decoder's has 20 arrays).
    analysis, _ = pair
    tuple_shape = "f32[32,128], f32[32], f32[32], f32[4,32], f32[32,32]"
    first = dataclasses.replace(analysis.collectives[0], shape=tuple_shape)
    before = dataclasses.replace(analysis, collectives=(first, *analysis.collectives[1:]))
    merged = [first]
    page = parse(render_html(before, root=ROOT))
    cells = {td.attrs.get("title"): td.text() for td in page.find("table", id="collectives-table").find_all("td")
             if "mono" in td.classes() and "src" not in td.classes()}
    for c in merged:
        parts = c.shape.split(", ")
        assert cells[c.shape] == f"{parts[0]}, {parts[1]}, … ({len(parts)} arrays)"
    assert shape_text("f32[4,64,16]") == "f32[4,64,16]"
    assert shape_text("f32[2], s32[4], f32[]") == "f32[2], s32[4], f32[]"


def _count_text(element) -> str:
    return "".join(element.text().split())


def test_the_nav_counts_are_the_cards_figures(page, pair, parse):
    before, after = pair
    for figure, of in (("findings", lambda a: len(a.findings)), ("collectives", lambda a: len(a.collectives))):
        nav = _count_text(page.find("nav").find(data_figure=f"nav-{figure}"))
        card = _count_text(page.find(**{"class": "card", "data-figure": figure}).find(**{"class": "values"}))
        assert nav == card == f"{of(before)}→{of(after)}"
    single = parse(render_html(before, root=ROOT))
    assert _count_text(single.find("nav").find(data_figure="nav-collectives")) == str(len(before.collectives))


def test_the_free_at_the_peak_column_is_explained_beside_it(page):
    for table in page.find_all("table", **{"class": "grid peak-table"}):
        header = next(th for th in table.find_all("th") if th.text() == "free at the peak")
        assert "no buffer holds at the peak" in header.attrs["title"]
    explained = page.find(data_explains="free at the peak").text()
    assert explained.startswith("Free at the peak: of a line's bytes, those no buffer holds at the peak.")


def test_padding_is_worded_for_the_platform_that_compiled(page_text, pair):
    from shardlint.analyzer.memory._peak import _PADDING_WHY

    before, _ = pair
    padding = [b for b in before.memory.peak_buffers if b.op == "padding"]
    assert before.platform == "cpu" and padding   # XLA:CPU aligns its buffers too
    assert all("XLA:CPU places each buffer at a 64-byte-aligned offset" in b.op_path for b in padding)
    assert "TPU compiler" not in page_text
    assert "TPU compiler" in _PADDING_WHY["tpu"]


def test_graph_labels_are_shown_whole(page, pair):
    before, _ = pair
    nodes = {n.id: n for f in before.findings for n in f.neighbourhood.nodes}
    drawn = page.find_all("g", data_node=True)
    assert drawn
    for g in drawn:
        node = nodes[g.attrs["data-node"]]
        shown = "".join(t.text() for t in g.find_all("text"))
        assert "…" not in shown
        assert "".join(shown.split()) == "".join(f"{node.op}{node.id}{node.shape}".split())


def test_a_refused_sweep_point_is_marked_with_its_reason(pair, sweep, parse):
    from shardlint.reports import format_sweep
    from shardlint.reports._data import report_data

    points = [dict(p) for p in sweep["points"]]
    why = "float32[256,2,4,128] has a second dimension that grows with the number of tokens"
    points[1] = {**points[1], "after": None, "refused": why}
    refused = {"axis": sweep["axis"], "points": points}
    page = parse(render_html(*pair, sweep=refused, root=ROOT))
    value = points[1]["value"]
    cell = page.find("tr", data_sweep_value=str(value)).find("td", data_series="after")
    assert cell.text() == "refused" and cell.attrs["title"] == why
    note = page.find("p", data_refused_at=str(value))
    assert note.text() == f"The rewrite was refused at context={value}: {why}"
    doc = report_data(*pair, refused)
    assert [p["refused"] for p in doc["sweep"]["points"]] == [None, why, None]
    assert doc["sweep"]["points"][1]["after"] is None
    embedded = json.loads(page.find("script", id="shardlint-analysis").text())
    assert [p["refused"] for p in embedded["sweep"]["points"]] == [None, why, None]
    text = format_sweep(refused, title="t")
    row = next(line for line in text.splitlines() if line.strip().startswith(f"{value} "))
    assert row.split()[-2:] == ["refused", "-"]
    assert f"the rewrite was refused at context={value}: {why}" in text
