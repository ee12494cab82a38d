"""Which collectives each propagation drop caused.

XLA's own label on a collective changes across versions (JAX 0.12 labels a gather with
the op that made the value or with an argument's name, and joins merged op names with
';'), so a finding claims an all-gather by that label (the same op path and line), or by
what the gather is: over a lost axis, its per-device result is the operand with that axis
gathered, and it is labelled or read next to the op, by line and op path (the layers of a
Python loop share their lines). Each all-gather is one finding's. A collective a finding
caused is attributed to the finding's op: its line, stack and op path.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from ..._vocab import CollectiveKind
from ..parse import MeshInfo
from ..graph import around, dims_of, node_of, sharding_of, source_of
from .._model import Collective
from ..._op_paths import is_backward


@dataclasses.dataclass(frozen=True, kw_only=True)
class Drop:
    """An op of the propagated graph whose result drops mesh axes its operand had."""

    node: str                    # the op
    op: str                      # reshape, sort, top_k, cumsum, ...
    lost: tuple[str, ...]        # the mesh axes dropped
    operand: str                 # the producer of the operand that had them
    element: int                 # which of its results


def attribute(collectives, findings) -> tuple[Collective, ...]:
    """A collective a finding caused is attributed to the finding's op: its line, stack,
    op path and the op that needed it are the finding's, so that the finding and its
    collectives name one line everywhere (XLA's own label stays in
    `xla_op_path`/`xla_source`)."""
    cause = {cid: f for f in findings for cid in f.collectives}
    return tuple(
        dataclasses.replace(c, source=cause[c.id].source, op_path=cause[c.id].op_path,
                            stack=cause[c.id].stack, needed_by=cause[c.id].needed_by or c.needed_by)
        if c.id in cause else c
        for c in collectives)


def link(graph, drops: list[Drop], mesh: MeshInfo, collectives) -> dict[str, set[str]]:
    """Which all-gathers each finding caused; each all-gather is one finding's at most.

    A finding may claim an all-gather that XLA labelled with its op (the same op path and
    line), or one over a lost axis whose per-device result is the operand with some of the
    lost axes gathered (XLA may gather one axis at a time: the sequence, then the batch)
    and that is labelled or read next to the op: an op within two edges of it in
    the propagated graph, by line and op path (layers of one Python loop share lines, not
    their named scopes). Of several findings that fit, the one XLA labelled wins, then the
    one the gather's reader sits at or after, then the one in the same direction (forward
    or backward) as the reader, then the one whose op path shares the most with the
    reader's; findings that fit alike (identical layers) share the gathers out in turn.
    """
    links: dict[str, set[str]] = {d.node: set() for d in drops}
    wanted = {d.node: _gathered_shapes(graph, d.operand, d.element, d.lost, mesh) for d in drops}
    near = {d.node: _keys(graph, around(graph, d.node, 2)) for d in drops}
    after = {d.node: _keys(graph, _downstream(graph, d.node, 3)) for d in drops}
    order = {d.node: i for i, d in enumerate(drops)}
    for c in collectives:
        if c.kind != CollectiveKind.ALL_GATHER:
            continue
        label = _keys_of(c.xla_source, c.xla_op_path)
        reader = _keys_of(c.source, c.op_path)
        fits = [d.node for d in drops if _labelled_at(graph, d.node, c) or (
            set(c.axes) & set(d.lost) and _dims(c.shape) in wanted[d.node]
            and (c.xla_source is None or label & near[d.node] or reader & near[d.node]))]
        if not fits:
            continue

        def preference(node):
            op_path = node_of(graph, node).op_path
            return (not _labelled_at(graph, node, c), not reader & after[node],
                    is_backward(op_path) != is_backward(c.op_path),
                    -_common_prefix(op_path, c.op_path), len(links[node]), order[node])

        links[min(fits, key=preference)].add(c.id)
    return links


def _labelled_at(graph, node, c: Collective) -> bool:
    """XLA labelled the all-gather with this op: the same op path and line."""
    src = source_of(graph, node)
    return (c.kind == CollectiveKind.ALL_GATHER and src is not None and c.xla_source is not None
            and (c.xla_source.file, c.xla_source.line) == (src.file, src.line)
            and c.xla_op_path == node_of(graph, node).op_path)


def _keys(graph, nodes) -> set[tuple[str, int, str]]:
    """(file, line, op path) of these ops of the propagated graph."""
    return {k for n in nodes for k in _keys_of(source_of(graph, n), node_of(graph, n).op_path)}


def _keys_of(source, op_path: str) -> set[tuple[str, int, str]]:
    """An op's (file, line, op path), once per op XLA merged into it (JAX 0.12 joins their
    names with ';')."""
    if source is None:
        return set()
    return {(source.file, source.line, part) for part in op_path.split(";") if part}


def _downstream(graph, node, radius: int) -> set[str]:
    """The op and the ops within `radius` edges after it."""
    seen, frontier = {node}, [node]
    for _ in range(radius):
        frontier = [u for n in frontier for u in graph.successors(n) if u not in seen]
        seen.update(frontier)
    return seen


def _dims(shape: str) -> str:
    """`[2,64,16]` of `f32[2,64,16]`."""
    return shape[shape.find("["):]


def _common_prefix(a: str, b: str) -> int:
    """How many leading '/' parts two op paths share."""
    n = 0
    for x, y in zip(a.split("/"), b.split("/")):
        if x != y:
            break
        n += 1
    return n


def _gathered_shapes(graph, operand, element, lost, mesh: MeshInfo) -> set[str]:
    """The per-device dimensions of the operand with some of the lost axes gathered, one
    for each non-empty subset of them, e.g. `[2,64,16]`. Without the element type: XLA
    may gather a value before the convert that made the operand (bf16 layers on an f32
    residual stream)."""
    before = sharding_of(graph, operand, element)
    dims = dims_of(graph, operand, element)
    axes_of = before.dims + ((),) * (len(dims) - len(before.dims))
    sizes = mesh.as_dict()
    shapes = set()
    for n in range(1, len(lost) + 1):
        for gathered in itertools.combinations(lost, n):
            kept = (d // math.prod(sizes.get(a, 1) for a in axes if a not in gathered)
                    for d, axes in zip(dims, axes_of))
            shapes.add(f"[{','.join(map(str, kept))}]")
    return shapes
