"""Which collectives each propagation drop caused.

XLA's own label on a collective changes across versions (JAX 0.12 labels a gathered
argument with its name and joins merged op names with ';'), so a finding claims an
all-gather first by that label (the same op path and line), then by what the gather is:
over a lost axis, its per-device result is the operand with that axis gathered, and it
is labelled (or read) next to the op. A collective a finding caused is attributed to the
finding's op.
"""

from __future__ import annotations

import dataclasses
import math

from .._vocab import CollectiveKind
from ._collectives import transform_of
from ._devices import MeshInfo
from ._graph import around, dims_of, node_of, sharding_of, source_of
from ._model import Collective


@dataclasses.dataclass(frozen=True, kw_only=True)
class Drop:
    """An op of the propagated graph whose result drops mesh axes its operand had."""

    node: str                    # the op
    op: str                      # reshape, sort, top_k, cumsum, ...
    lost: tuple[str, ...]        # the mesh axes dropped
    operand: str                 # the producer of the operand that had them
    element: int                 # which of its results


def attribute(collectives, findings) -> tuple[Collective, ...]:
    """A collective a finding caused is attributed to the finding's op (XLA's own label
    stays in `xla_op_path`/`xla_source`)."""
    cause = {cid: f for f in findings for cid in f.collectives}
    return tuple(
        dataclasses.replace(c, source=cause[c.id].source, op_path=cause[c.id].op_path)
        if c.id in cause else c
        for c in collectives)


def link(graph, drops: list[Drop], mesh: MeshInfo, collectives) -> dict[str, set[str]]:
    """Which all-gathers each finding caused.

    First by XLA's own label (the same op path and line as the finding's op); then, for
    the rest, by what the collective is: an all-gather over a lost axis whose per-device
    result is the operand with that axis gathered. When several findings fit, the one in
    the same transformation (forward `jvp()` or backward `transpose(...)`) as XLA's label
    wins, then the one on the line of the op that reads the gather.
    """
    links: dict[str, set[str]] = {d.node: set() for d in drops}
    claimed: set[str] = set()
    for node in links:
        data = node_of(graph, node)
        src = source_of(graph, node)
        for c in collectives:
            if (c.kind == CollectiveKind.ALL_GATHER and src is not None and c.xla_source is not None
                    and (c.xla_source.file, c.xla_source.line) == (src.file, src.line)
                    and c.xla_op_path == data.op_path):
                links[node].add(c.id)
                claimed.add(c.id)
    wanted = {d.node: _gathered_shape(graph, d.operand, d.element, d.lost, mesh) for d in drops}
    near = {node: nearby_lines(graph, node) for node in links}
    for c in collectives:
        if c.kind != CollectiveKind.ALL_GATHER or c.id in claimed:
            continue
        fits = [d.node for d in drops if set(c.axes) & set(d.lost) and c.shape == wanted[d.node]
                and _labelled_near(c, near[d.node])]
        if not fits:
            continue

        def preference(node):
            data = node_of(graph, node)
            same_transform = transform_of(data.op_path) == transform_of(c.xla_op_path)
            src = source_of(graph, node)
            same_line = src is not None and c.source is not None and src.line == c.source.line
            return (not same_transform, not same_line)

        links[min(fits, key=preference)].add(c.id)
    return links


def nearby_lines(graph, node, radius: int = 2) -> set[tuple[str, int]]:
    """Source lines of the ops within `radius` edges of `node` (producers and users)."""
    return {(s.file, s.line) for s in (source_of(graph, n) for n in around(graph, node, radius))
            if s is not None}


def _labelled_near(c: Collective, lines: set[tuple[str, int]]) -> bool:
    """XLA's label has no source (an argument's name), or it or the collective's reader
    sits next to the op: an all-gather labelled elsewhere belongs to someone else."""
    return c.xla_source is None or any(
        s is not None and (s.file, s.line) in lines for s in (c.xla_source, c.source))


def _gathered_shape(graph, operand, element, lost, mesh: MeshInfo) -> str:
    """The per-device operand with the lost axes gathered, e.g. `f32[2,64,16]`."""
    before = sharding_of(graph, operand, element)
    dims = dims_of(graph, operand, element)
    sizes = mesh.as_dict()
    expected = tuple(
        d // math.prod(sizes.get(a, 1) for a in axes if a not in lost)
        for d, axes in zip(dims, before.dims + ((),) * (len(dims) - len(before.dims))))
    dtype = node_of(graph, operand).result[element].dtype
    return f"{dtype}[{','.join(map(str, expected))}]"
