"""The drawings: the neighbourhood layout follows the data flow, the chart plots the numbers."""

from __future__ import annotations

import pytest

from shardlint.analyzer import GraphNode, Neighbourhood
from shardlint.reports._svg import (ideal_line, layout_neighbourhood, memory_chart_svg,
                                    neighbourhood_svg, sharded_axes)


def _nb(edges, focus="r"):
    ids = sorted({n for e in edges for n in e})
    shapes = {"x": "f32[4,64] P('data', 'context')", "r": "f32[256] P('data')"}
    return Neighbourhood(nodes=tuple(GraphNode(id=i, op="reshape" if i == focus else "add",
                                               shape=shapes.get(i, "f32[256] P(None)"), source=None,
                                               focus=i == focus)
                                     for i in ids), edges=tuple(edges))


def test_layers_follow_edges_and_sources_sit_next_to_their_consumer():
    nb = _nb([("x", "r"), ("r", "a"), ("a", "b"), ("w", "b"), ("r", "c")])
    pos = layout_neighbourhood(nb)
    for a, b in nb.edges:
        assert pos[a][0] < pos[b][0], (a, b, pos)
    assert pos["w"][0] == pos["b"][0] - 1  # the weight is drawn just left of its consumer
    rows = [(p[0], p[1]) for p in pos.values()]
    assert len(set(rows)) == len(rows)  # no two nodes share a slot


def test_cycles_are_collapsed_not_fatal():
    nb = _nb([("x", "r"), ("r", "a"), ("a", "r"), ("a", "b")])
    pos = layout_neighbourhood(nb)
    assert pos["r"][0] == pos["a"][0] and pos["b"][0] > pos["a"][0]
    svg = neighbourhood_svg(nb, ("context",))
    assert svg.count("<g class=") == 4


def test_nodes_are_coloured_by_whether_they_keep_the_lost_axis():
    svg = neighbourhood_svg(_nb([("x", "r"), ("r", "a")]), ("context",))
    assert 'class="node kept" data-node="x"' in svg
    assert 'class="node focus" data-node="r"' in svg
    assert 'class="node lost" data-node="a"' in svg
    assert neighbourhood_svg(None) == ""


@pytest.mark.parametrize("shape,axes", [
    ("f32[4,64,16] P('data', 'context', None)", ("data", "context")),
    ("s32[512] P(None)", ()),
    ("f32[4,64]{data,-}", ("data",)),
])
def test_sharded_axes_reads_both_notations(shape, axes):
    assert sharded_axes(shape) == axes


def test_chart_plots_each_point_and_an_ideal_line_per_series():
    svg = memory_chart_svg("context", {"before": [(1, 1000), (2, 990), (4, 1000)],
                                       "after": [(1, 800), (2, 400), (4, None)]})
    assert svg.count('data-series="before"') == 3
    assert svg.count('data-series="after"') == 2  # a missing point is not drawn
    assert 'data-x="4" data-bytes="1000"' in svg
    assert 'data-series="ideal-before"' in svg and 'data-series="ideal-after"' in svg
    assert ideal_line([(1, 1000), (2, 990), (4, 1000)]) == [(1, 1000.0), (2, 500.0), (4, 250.0)]
    assert ideal_line([(2, None), (4, 800), (8, 100)]) == [(4, 800.0), (8, 400.0)]
    assert memory_chart_svg("context", {}) == ""


def test_log_axis_spaces_powers_of_two_evenly():
    svg = memory_chart_svg("context", {"before": [(1, 8), (2, 4), (4, 2), (8, 1)]})
    xs = [float(part.split('"')[1]) for part in svg.split('cx=')[1:]]
    gaps = {round(b - a, 1) for a, b in zip(xs, xs[1:])}
    assert len(gaps) == 1


def test_ideal_lines_that_coincide_are_drawn_once():
    svg = memory_chart_svg("context", {"before": [(1, 1000), (2, 1000), (4, 1000)],
                                       "after": [(1, 1001), (2, 500), (4, 260)]})
    assert svg.count("<polyline") == 3  # before, after, one shared ideal
    assert 'data-series="ideal"' in svg and "ideal-before" not in svg


@pytest.mark.parametrize("op, node_id, shape", [
    ("reshape", "reshape.0", "f32[8,256,64] P('data', 'context', None)"),
    ("get-tuple-element", "top_k.1", "f32[2048,2] P('data', None)"),
    ("parameter", "params__w_in__.0", "f32[8,64,128] P(None, None, None)"),
])
def test_node_labels_wrap_whole_inside_the_box(op, node_id, shape):
    from shardlint.reports._svg import _CHARS, node_label

    lines = node_label(op, node_id, shape)
    runs = [run for line in lines for run in line]
    assert "".join(text for _, text in runs).replace(" ", "") == (op + node_id + shape).replace(" ", "")
    assert [text for css, text in runs if css == "op"] == [op]
    assert all(len(text) <= _CHARS for css, text in runs if css == "shape")
    svg = neighbourhood_svg(Neighbourhood(nodes=(GraphNode(id=node_id, op=op, shape=shape, source=None,
                                                            focus=True),), edges=()))
    assert svg.count("<text ") == len(lines) and "…" not in svg


def test_a_label_too_long_for_the_box_is_cut_and_whole_in_its_title():
    from shardlint.reports._svg import _MAX_LINES, node_label

    shape = ", ".join(["f32[4096,64]"] * 12)
    lines = node_label("all-reduce", "all-reduce.5", shape)
    assert len(lines) == _MAX_LINES and lines[-1][-1][1].endswith("…")
    svg = neighbourhood_svg(Neighbourhood(nodes=(GraphNode(id="all-reduce.5", op="all-reduce", shape=shape,
                                                            source=None, focus=True),), edges=()))
    assert f"<title>all-reduce all-reduce.5\n{shape}</title>" in svg
