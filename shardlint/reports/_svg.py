"""Inline SVG for the HTML report: a finding's neighbourhood graph and the sweep's memory chart.

Drawn here, in Python, rather than in the browser: the page then shows its pictures with
no script and no library from elsewhere, and tests read the plotted figures straight from
the markup (`data-*` attributes on every point and node). Every label comes from user code
(op names, shapes, file paths), so each one goes through `markupsafe.escape`; the result
is `Markup`, which the autoescaping template includes as it is.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import networkx as nx
from markupsafe import Markup, escape

from ..analyzer import Neighbourhood
from .._format import clip, human_bytes

# Node box geometry (px) for the neighbourhood drawing. A label is wrapped onto as many
# lines as it needs (at most _MAX_LINES; the box's <title> holds it whole): the op and its
# XLA name, then the shape and its sharding. Monospace glyphs are ~0.6em wide; 0.62 leaves
# room for the fonts a browser may pick.
_NODE_W, _LAYER_GAP, _ROW_GAP, _PAD = 184, 44, 12, 10
_TEXT_W = _NODE_W - 16              # 8 px inside each side of the box
_OP_PX, _ID_PX, _SHAPE_PX, _EM = 12, 10.5, 11, 0.62
_CHARS = int(_TEXT_W / (_SHAPE_PX * _EM))   # shape characters per line
_LINE_H, _MAX_LINES = 15, 5
_MAX_NODES = 48                     # beyond this the drawing stops being readable
_NOT_AXES = {"P", "None", "replicated", "maximal", "device", "devices", "manual", "last_tile_dim_replicate"}


def sharded_axes(shape: str) -> tuple[str, ...]:
    """Mesh axes named in a shape's sharding: `f32[4,64] P('data', None)` -> ('data',)."""
    _, _, tail = shape.partition("]")
    return tuple(w for w in re.findall(r"[A-Za-z_]\w*", tail) if w not in _NOT_AXES)


def layout_neighbourhood(nb: Neighbourhood) -> dict[str, tuple[int, int]]:
    """Layers left to right along the data flow; rows ordered to cross few edges.

    Cycles (rare in a neighbourhood) are collapsed with `nx.condensation`, layers are
    longest paths from the sources, a source sits just left of its first consumer, and a
    few barycenter sweeps order each layer. Returns {node id: (layer, row)}.
    """
    ids = [n.id for n in nb.nodes]
    g = nx.DiGraph()
    g.add_nodes_from(ids)
    g.add_edges_from((a, b) for a, b in nb.edges if a in g and b in g and a != b)
    cond = nx.condensation(g)
    members = cond.graph["mapping"]
    comp_layer: dict[int, int] = {}
    for depth, generation in enumerate(nx.topological_generations(cond)):
        for comp in generation:
            comp_layer[comp] = depth
    for comp in cond:  # pull sources (parameters, constants) next to their consumers
        if cond.in_degree(comp) == 0 and cond.out_degree(comp) > 0:
            comp_layer[comp] = min(comp_layer[s] for s in cond.successors(comp)) - 1
    shift = min(comp_layer.values(), default=0)
    layer = {n: comp_layer[members[n]] - shift for n in ids}
    layers: dict[int, list[str]] = {}
    for n in ids:
        layers.setdefault(layer[n], []).append(n)
    order = {n: i for col in layers.values() for i, n in enumerate(col)}
    for sweep in range(4):
        forward = sweep % 2 == 0
        for depth in sorted(layers, reverse=not forward):
            neighbours = g.predecessors if forward else g.successors

            def centre(n, neighbours=neighbours):
                near = [order[m] for m in neighbours(n)]
                return sum(near) / len(near) if near else order[n]

            layers[depth].sort(key=centre)
            order.update({n: i for i, n in enumerate(layers[depth])})
    return {n: (layer[n], order[n]) for n in ids}


def _trim(nb: Neighbourhood) -> Neighbourhood:
    """Keeps the nodes nearest the focus when a neighbourhood is too big to read."""
    if len(nb.nodes) <= _MAX_NODES:
        return nb
    g = nx.Graph()
    g.add_nodes_from(n.id for n in nb.nodes)
    g.add_edges_from(nb.edges)
    focus = [n.id for n in nb.nodes if n.focus] or [nb.nodes[0].id]
    dist = nx.multi_source_dijkstra_path_length(g, focus)
    keep = set(sorted(dist, key=lambda n: dist[n])[:_MAX_NODES])
    return Neighbourhood(nodes=tuple(n for n in nb.nodes if n.id in keep),
                         edges=tuple(e for e in nb.edges if e[0] in keep and e[1] in keep))


def node_label(op: str, node_id: str, shape: str) -> list[list[tuple[str, str]]]:
    """The lines of a node's box, each a list of (css class, text) runs: the op and its
    XLA name (on a line of its own where both do not fit), then the shape wrapped at
    `_CHARS` characters (after a comma or space where there is one); at most `_MAX_LINES`,
    the last cut with an ellipsis where the label is longer."""
    op_chars = int(_TEXT_W / (_OP_PX * _EM))
    id_chars = int(_TEXT_W / (_ID_PX * _EM))
    lines: list[list[tuple[str, str]]] = []
    op_lines = _wrap(op, op_chars)
    lines += [[("op", text)] for text in op_lines]
    room = int((_TEXT_W - len(op_lines[-1]) * _OP_PX * _EM - 6) / (_ID_PX * _EM))
    if node_id and len(node_id) <= room:
        lines[-1].append(("id", node_id))
    elif node_id:
        lines += [[("id", text)] for text in _wrap(node_id, id_chars)]
    array, spec, sharding = shape.partition(" P(")   # the sharding on a line of its own
    parts = [array, spec.lstrip() + sharding] if spec else [shape]
    lines += [[("shape", text)] for part in parts for text in _wrap(part, _CHARS)]
    if len(lines) > _MAX_LINES:
        lines = lines[:_MAX_LINES]
        css, text = lines[-1][-1]
        lines[-1][-1] = (css, clip(text + "…", _CHARS))
    return lines


def _runs(line: list[tuple[str, str]]) -> str:
    """One line of a label as tspans, 6 px apart."""
    gap = ' dx="6"'
    return "".join(f'<tspan class="{css}"{gap if i else ""}>{escape(run)}</tspan>'
                   for i, (css, run) in enumerate(line))


def _wrap(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` characters, broken after the last comma or space
    that fits (anywhere where none does)."""
    lines = []
    while len(text) > width:
        cut = max(text.rfind(", ", 0, width - 1) + 2, text.rfind(" ", 0, width) + 1)
        cut = cut if cut > width // 3 else width
        lines.append(text[:cut].rstrip())
        text = text[cut:].lstrip()
    return lines + [text] if text or not lines else lines


def neighbourhood_svg(nb: Neighbourhood | None, lost_axes: tuple[str, ...] = ()) -> Markup:
    """The ops around a finding, coloured by whether they still carry the lost axes."""
    if nb is None or not nb.nodes:
        return Markup("")
    nb = _trim(nb)
    pos = layout_neighbourhood(nb)
    labels = {n.id: node_label(n.op, n.id, n.shape) for n in nb.nodes}
    node_h = 10 + _LINE_H * max(len(lines) for lines in labels.values())
    n_layers = max(p[0] for p in pos.values()) + 1
    n_rows = max(sum(1 for p in pos.values() if p[0] == d) for d in range(n_layers))
    width = 2 * _PAD + n_layers * _NODE_W + (n_layers - 1) * _LAYER_GAP
    height = 2 * _PAD + n_rows * node_h + (n_rows - 1) * _ROW_GAP
    per_layer = {d: sum(1 for p in pos.values() if p[0] == d) for d in range(n_layers)}

    def xy(node_id):
        d, r = pos[node_id]
        offset = (n_rows - per_layer[d]) * (node_h + _ROW_GAP) / 2
        return _PAD + d * (_NODE_W + _LAYER_GAP), _PAD + offset + r * (node_h + _ROW_GAP)

    out = [f'<svg class="graph" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-label="graph neighbourhood">']
    for a, b in nb.edges:
        if a not in pos or b not in pos or a == b:
            continue
        (x1, y1), (x2, y2) = xy(a), xy(b)
        sx, sy, ex, ey = x1 + _NODE_W, y1 + node_h / 2, x2, y2 + node_h / 2
        if ex <= sx:  # same layer (a collapsed cycle): loop around the right side
            ex, ey = x2 + _NODE_W, y2 + node_h / 2
            bend = sx + _LAYER_GAP * 0.6
            path = f"M{sx},{sy} C{bend},{sy} {bend},{ey} {ex + 6},{ey}"
            tip = (ex, ey, 1)
        else:
            mid = (sx + ex) / 2
            path = f"M{sx},{sy} C{mid},{sy} {mid},{ey} {ex - 6},{ey}"
            tip = (ex, ey, -1)
        tx, ty, s = tip
        out.append(f'<path class="edge" d="{path}" data-from="{escape(a)}" data-to="{escape(b)}"/>'
                   f'<path class="arrow" d="M{tx},{ty} l{s * 7},-4 v8 z"/>')
    lost = set(lost_axes)
    for node in nb.nodes:
        x, y = xy(node.id)
        carried = set(sharded_axes(node.shape))
        state = "focus" if node.focus else ("kept" if lost and lost <= carried else "lost")
        where = f"{node.source.file}:{node.source.line}" if node.source else ""
        tip = "\n".join(filter(None, (f"{node.op} {node.id}", node.shape, where)))
        text = "".join(f'<text x="{x + 8}" y="{y + 18 + i * _LINE_H}">{_runs(line)}</text>'
                       for i, line in enumerate(labels[node.id]))
        out.append(
            f'<g class="node {state}" data-node="{escape(node.id)}" data-op="{escape(node.op)}">'
            f"<title>{escape(tip)}</title>"
            f'<rect x="{x}" y="{y}" width="{_NODE_W}" height="{node_h}" rx="6"/>{text}</g>')
    out.append("</svg>")
    return Markup("".join(out))


# ---------------------------------------------------------------- the sweep's line chart

_CHART_W, _CHART_H = 900, 340
_M_LEFT, _M_RIGHT, _M_TOP, _M_BOTTOM = 96, 210, 24, 48


def _nice_ceiling(value: float) -> float:
    if value <= 0:
        return 1.0
    exp = 1024 ** math.floor(math.log(value, 1024)) if value >= 1 else 1
    scaled = value / exp
    for step in (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12.5, 15, 20, 25, 40, 50, 60, 80, 100,
                 125, 150, 200, 250, 400, 500, 600, 800, 1000, 1024):
        if scaled <= step:
            return step * exp
    return scaled * exp


def _tick(b: float) -> str:
    """An axis label: human_bytes without the decimals that round ticks do not need."""
    return human_bytes(b).replace(".00 ", " ")


def ideal_line(points: list[tuple[int, int | None]]) -> list[tuple[int, float]]:
    """Perfect scaling from a series' first point: bytes fall as 1/N with the axis size."""
    first = next(((v, b) for v, b in sorted(points) if b), None)
    if first is None:
        return []
    return [(v, first[1] * first[0] / v) for v, _ in sorted(points) if v >= first[0]]


def _same_line(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Two ideal lines that start at the same point (within 0.5%) are drawn once."""
    return (len(a) == len(b) and bool(a)
            and all(va == vb and abs(ba - bb) <= 0.005 * max(ba, bb) for (va, ba), (vb, bb) in zip(a, b)))


def memory_chart_svg(axis: str, series: dict[str, list[tuple[int, int | None]]],
                     metric: str = "temp memory per device",
                     ideals: dict[str, list[tuple[int, float]]] | None = None) -> Markup:
    """A line chart of per-device bytes against the swept axis, with dashed ideal lines.

    `series` maps "before" (and "after") to [(axis value, bytes or None)]. Each series gets
    a dashed ideal line from its own first point (`ideals`, else 1/N), so a fix that
    already saves memory at the smallest size is judged on how it scales, not on where it
    starts. The x axis is logarithmic when the values span a factor of four or more (1, 2,
    4, 8 spaced evenly).
    """
    values = sorted({v for pts in series.values() for v, _ in pts})
    if not values:
        return Markup("")
    names = [n for n in ("before", "after") if n in series]
    lines = {n: [(v, b) for v, b in sorted(series[n]) if b is not None] for n in names}
    ideals = {n: (ideals or {}).get(n) or ideal_line(series[n]) for n in names}
    top = _nice_ceiling(max((b for pts in (*lines.values(), *ideals.values()) for _, b in pts),
                            default=1) * 1.08)
    frame = _Frame(values, top)
    out = [_chart_open(metric, axis), frame.axes(f"{axis} (mesh axis size)", metric)]
    shared = len(names) == 2 and _same_line(ideals["before"], ideals["after"])
    ends = [frame.ideal(name, ideals[name], shared) for name in names
            if len(ideals[name]) > 1 and not (shared and name == "after")]
    ends += [frame.series(name, lines[name], axis) for name in names if lines[name]]
    out += [svg for svg, _ in ends]
    out.append(_end_labels([end for _, end in ends]))
    out.append("</svg>")
    return Markup("".join(out))


def longest_chart_svg(key: str, axis: str, series: dict[str, list[tuple[int, int | None]]]) -> Markup:
    """A line chart of the longest `key` that fits against `axis` (a plan's grid key), one
    line before the fix and one after."""
    values = sorted({v for pts in series.values() for v, _ in pts})
    lines = {n: [(v, y) for v, y in sorted(series[n]) if y] for n in ("before", "after") if n in series}
    if not values or not any(lines.values()):
        return Markup("")
    top = _nice_ceiling(max(y for pts in lines.values() for _, y in pts) * 1.08)
    frame = _Frame(values, top, tick=_count, value=_count)
    out = [_chart_open(f"longest {key}", axis), frame.axes(axis, f"longest {key} that fits")]
    ends = [frame.series(name, pts, axis) for name, pts in lines.items() if pts]
    out += [svg for svg, _ in ends]
    out.append(_end_labels([end for _, end in ends]))
    out.append("</svg>")
    return Markup("".join(out))


def _count(n: float) -> str:
    """A token count as an axis label: 32768 -> 32K."""
    return f"{n / 1024:g}K" if n >= 1024 and n % 1024 == 0 else f"{n:.0f}"


def _chart_open(metric: str, axis: str) -> str:
    return (f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_CHART_W} {_CHART_H}" '
            f'width="{_CHART_W}" height="{_CHART_H}" role="img" '
            f'aria-label="{escape(metric)} against {escape(axis)}">')


_LABELS = {"before": "before", "after": "after rewrite"}


class _Frame:
    """A chart's plot area: where an axis value and a y value land, and its axes drawn; `tick`
    writes a y value on the axis and `value` in a label (bytes by default)."""

    def __init__(self, values: list[int], top: float, tick: Callable[[float], str] = _tick,
                 value: Callable[[float], str] = human_bytes):
        self.values, self.top = values, top
        self.tick, self.value = tick, value
        self.log_x = values[0] > 0 and values[-1] / values[0] >= 4
        self.width = _CHART_W - _M_LEFT - _M_RIGHT
        self.height = _CHART_H - _M_TOP - _M_BOTTOM

    def x(self, v) -> float:
        first, last = self.values[0], self.values[-1]
        if len(self.values) == 1:
            return _M_LEFT + self.width / 2
        t = math.log(v / first) / math.log(last / first) if self.log_x else (v - first) / (last - first)
        return _M_LEFT + t * self.width

    def y(self, b) -> float:
        return _M_TOP + self.height * (1 - b / self.top)

    def points(self, pts) -> str:
        return " ".join(f"{self.x(v):.1f},{self.y(b):.1f}" for v, b in pts)

    def axes(self, x_label: str, metric: str) -> str:
        """Grid lines with y ticks, the axis values' tick marks, and both axis labels."""
        out = []
        for i in range(5):
            b = self.top * i / 4
            y = self.y(b)
            out.append(f'<line class="grid" x1="{_M_LEFT}" x2="{_M_LEFT + self.width}" y1="{y:.1f}" '
                       f'y2="{y:.1f}"/><text class="tick" x="{_M_LEFT - 8}" y="{y + 4:.1f}" '
                       f'text-anchor="end">{escape(self.tick(b))}</text>')
        bottom = _M_TOP + self.height
        for v in self.values:
            x = self.x(v)
            out.append(f'<line class="tickmark" x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" '
                       f'y2="{bottom + 5}"/><text class="tick" x="{x:.1f}" '
                       f'y="{bottom + 20}" text-anchor="middle">{v}</text>')
        out.append(f'<text class="axis-label" x="{_M_LEFT + self.width / 2}" y="{_CHART_H - 8}" '
                   f'text-anchor="middle">{escape(x_label)}</text>'
                   f'<text class="axis-label" transform="rotate(-90)" x="{-(_M_TOP + self.height / 2)}" '
                   f'y="14" text-anchor="middle">{escape(metric)}</text>')
        return "".join(out)

    def ideal(self, name: str, pts, shared: bool) -> tuple[str, tuple]:
        """A dashed ideal line (one for both series where they coincide), and its end label."""
        cls = "ideal ideal-shared" if shared else f"ideal ideal-{name}"
        svg = (f'<polyline class="line {cls}" data-series="{"ideal" if shared else "ideal-" + name}" '
               f'points="{self.points(pts)}"/>')
        (v, b) = pts[-1]
        return svg, (self.y(b), self.x(v), cls, f"{'ideal ' if shared else ''}1/N · {self.value(b)}")

    def series(self, name: str, pts, axis: str) -> tuple[str, tuple]:
        """A measured line with a point (and its tooltip) per value, and its end label."""
        out = [f'<polyline class="line {name}" points="{self.points(pts)}"/>']
        for v, b in pts:
            out.append(f'<circle class="point {name}" cx="{self.x(v):.1f}" cy="{self.y(b):.1f}" r="4.5" '
                       f'data-series="{name}" data-x="{v}" data-bytes="{int(b)}">'
                       f"<title>{escape(_LABELS[name])}: {escape(axis)}={v}, "
                       f"{escape(self.value(b))}</title></circle>")
        (v, b) = pts[-1]
        return "".join(out), (self.y(b), self.x(v), name, f"{_LABELS[name]} · {self.value(b)}")


def _end_labels(ends: list[tuple]) -> str:
    """The lines' end labels, top to bottom, nudged apart."""
    out, placed = [], []
    for y, x, cls, text in sorted(ends):
        y = max([y + 4] + [p + 15 for p in placed])
        placed.append(y)
        out.append(f'<text class="end-label {cls}" x="{x + 10:.1f}" y="{y:.1f}">{escape(text)}</text>')
    return "".join(out)
