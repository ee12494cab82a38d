"""The propagated program as a `networkx.DiGraph`: ops are nodes, values are edges.

Each node carries one `OpNode` (attribute "op", read with `node_of`): what the detectors
need and nothing they would have to re-parse: opcode, per-result global shapes, XLA's
propagated sharding per result (decoded to mesh axes), the source location and JAX's op
path. Edges run from producer to user and are labelled with the operand position and, for
tuple-shaped producers, the element read.
"""

from __future__ import annotations

import dataclasses

import networkx as nx

from ..parse import ArrayType, HloModule, Instruction, MeshInfo, parse_tuple_sharding, Sharding
from ..._source import Source, display_path, shown, user_sources


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpNode:
    """One op of the propagated program, as a graph node."""

    instr: Instruction
    opcode: str
    computation: str
    result: tuple[ArrayType, ...]           # global shapes, one per result element
    shardings: tuple[Sharding, ...]         # XLA's propagated sharding per result element
    source: Source | None                   # the innermost frame, as XLA recorded it
    op_path: str                            # JAX's op path (the op_name XLA kept)
    grouped_matmul: bool                    # a dot at a grouped-matmul equation's line

    @property
    def backward(self) -> bool:
        return self.instr.backward

    @property
    def primitive(self) -> str:
        return self.instr.primitive


def node_of(graph: nx.DiGraph, node: str) -> OpNode:
    return graph.nodes[node]["op"]


def build_graph(module: HloModule, mesh: MeshInfo,
                grouped_matmul_sources: frozenset = frozenset()) -> nx.DiGraph:
    """`grouped_matmul_sources`: (file, line) of the jaxpr's grouped-matmul equations; the
    dots at those lines are marked `grouped_matmul` (XLA:CPU lowers `ragged_dot` to a
    masked dense dot that the HLO alone cannot tell from any other)."""
    graph = nx.DiGraph()
    for instr in module.instructions():
        ranks = [len(a.dims) for a in instr.result]
        # After propagation an op printed without a sharding is replicated (Shardy
        # exports only non-trivial shardings; GSPMD annotates every op).
        shardings = (parse_tuple_sharding(instr.sharding, mesh, ranks) if instr.sharding
                     else [Sharding(((),) * r) for r in ranks])
        graph.add_node(instr.name, op=OpNode(
            instr=instr,
            opcode=instr.opcode,
            computation=instr.computation,
            result=tuple(instr.result),
            shardings=tuple(shardings),
            source=instr.source,
            op_path=instr.op_name,
            grouped_matmul=instr.opcode == "dot" and instr.source is not None
            and (instr.source.file, instr.source.line) in grouped_matmul_sources,
        ))
    for instr in module.instructions():
        for position, name in enumerate(instr.operands):
            # JAX 0.12 can name a tuple element directly as `%value#1`.
            if name in graph:
                graph.add_edge(name, instr.name, position=position,
                               element=_element(instr, position))
    return graph


def _element(instr: Instruction, position: int) -> int | None:
    return instr.operand_indices[position] if position < len(instr.operand_indices) else None


def operand_of(graph: nx.DiGraph, node: str, position: int = 0) -> tuple[str, int] | None:
    """The producer feeding operand `position` of `node` and which result element it is."""
    for src, _, data in graph.in_edges(node, data=True):
        if data["position"] == position:
            element = data["element"]
            if element is None and node_of(graph, src).opcode == "get-tuple-element":
                element = 0
            return src, element or 0
    return None


def sharding_of(graph: nx.DiGraph, node: str, element: int = 0) -> Sharding | None:
    shardings = node_of(graph, node).shardings
    return shardings[element] if element < len(shardings) else None


def dims_of(graph: nx.DiGraph, node: str, element: int = 0) -> tuple[int, ...]:
    result = node_of(graph, node).result
    return result[element].dims if element < len(result) else ()


def source_of(graph: nx.DiGraph, node: str) -> Source | None:
    """The innermost of the op's user frames (its own frame when all are library frames)."""
    op = node_of(graph, node)
    stack = user_sources(op.instr.stack)
    if stack:
        return stack[0]
    src = op.source
    return shown(src) if src else None


def stack_key(stack) -> tuple[tuple[str, int], ...]:
    """A stack as comparable (display path, line) pairs, its frames raw or `shown`."""
    return tuple((display_path(f.file), f.line) for f in stack)


def around(graph: nx.DiGraph, node: str, radius: int) -> dict[str, int]:
    """Distance of every op within `radius` edges of `node`, following edges both ways.

    (A breadth-first walk: networkx's undirected ego graph would copy the whole graph.)"""
    distance = {node: 0}
    frontier = [node]
    for step in range(1, radius + 1):
        nxt = []
        for n in frontier:
            for m in (*graph.predecessors(n), *graph.successors(n)):
                if m not in distance:
                    distance[m] = step
                    nxt.append(m)
        frontier = nxt
    return distance
