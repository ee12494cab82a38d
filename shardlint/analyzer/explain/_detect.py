"""Propagation drops: where XLA's propagated sharding drops a mesh axis, and what that costs.

A drop is an op whose operand dimension is sharded over mesh axis A while XLA's own
propagated result leaves the corresponding result dimension without A: a reshape that
merges `(batch, seq)` with `seq` sharded, or a sort, top_k or cumsum over a sharded
dimension. Dimension correspondence is shape algebra (which operand dims a reshape merges
or splits); the shardings are always XLA's. A drop that the user asked for (a sharding
constraint whose asked result lacks the axis) is listed as requested instead.

Which gathers each drop caused is decided in `_attribution.py`; why every other collective
is there, in `_causes.py`.
"""

from __future__ import annotations

import networkx as nx

from ..._vocab import FindingKind
from ..parse import MeshInfo, Sharding
from ._attribution import Drop, attribute, link
from ..graph import (around, dims_of, feeds_grouped_matmul, node_of, operand_of, sharding_of,
    source_of)
from ..._reshape import reshape_groups
from ..._source import user_sources
from .._model import Collective, Finding, GraphNode, Neighbourhood, Requested
from ._wayout import dropped_way_out

_CONSTRAINT_TARGETS = {"Sharding", "xla.sdy.ShardingConstraint"}
_CONSTRAINT_OP_NAMES = {"sharding_constraint", "reshard"}


def find_lost_sharding(graph: nx.DiGraph, mesh: MeshInfo, collectives: tuple[Collective, ...],
                       asked_lines: frozenset = frozenset(), moves_weights=lambda cid: False):
    """Returns (drop findings, requested reshardings, collectives attributed to the drops).

    `asked_lines` are the (file, line) pairs where the lowered program asks for a sharding:
    Shardy may export such a constraint as a plain copy. A squeeze whose every collective
    only moves a parameter (`moves_weights`, by a collective's id: an FSDP weight's slice
    out of its layer stack, gathered whole for a shard_map that takes it replicated) is no
    lost token sharding: those gathers are the weights'. (A reshape that folds dimensions
    stays a finding whatever it moves: a step's input that no token op reads looks like a
    parameter to the provenance.)"""
    findings, requested = [], []
    raw: list[Drop] = []
    for node, data in graph.nodes(data="op"):
        op = _op_label(data, asked_lines)
        if op is None:
            continue
        hit = _lost_axes(graph, node, op)
        if hit is None:
            continue
        lost, operand, element = hit
        if op == "sharding_constraint" or _constrained(graph, node, asked_lines):
            requested.append(Requested(op=op, axes=lost, source=source_of(graph, node), op_path=data.op_path,
                                       stack=user_sources(data.instr.stack), asked=sharding_of(graph, node).dims))
            continue
        raw.append(Drop(node=node, op=op, lost=lost, operand=operand, element=element))
    links = link(graph, raw, mesh, collectives)
    for drop in raw:
        node, op, lost, operand, element = drop.node, drop.op, drop.lost, drop.operand, drop.element
        linked = links.get(node, set())
        if linked and _squeezes(graph, drop) and all(moves_weights(cid) for cid in linked):
            continue
        nbytes = sum(c.step_bytes for c in collectives if c.id in linked)
        feeds = feeds_grouped_matmul(graph, node)
        findings.append(_finding(graph, node, op, lost, operand, element, feeds,
                                 tuple(sorted(linked)), nbytes))
    collectives = attribute(collectives, findings)
    findings.sort(key=lambda f: (f.source.file if f.source else "", f.source.line if f.source else 0, f.op_path))
    return tuple(findings), tuple(requested), collectives


def _squeezes(graph, drop: Drop) -> bool:
    """A reshape that only removes or adds dimensions of size 1."""
    sizes = lambda dims: [d for d in dims if d != 1]   # noqa: E731
    return drop.op == "reshape" and sizes(dims_of(graph, drop.operand, drop.element)) == sizes(dims_of(graph, drop.node))


def _op_label(data, asked_lines=()) -> str | None:
    opcode = data.opcode
    if opcode == "reshape":
        return "reshape"
    if opcode == "sort":
        return "sort"
    if opcode == "topk" or (opcode == "custom-call" and "TopK" in data.instr.custom_call_target):
        return "top_k"
    if opcode == "reduce-window":
        return "cumsum" if "cum" in data.op_path or "reduce_window" in data.op_path else "reduce-window"
    if opcode == "custom-call" and data.instr.custom_call_target in _CONSTRAINT_TARGETS:
        return "sharding_constraint"  # GSPMD keeps the constraint as a custom call
    if opcode == "copy" and data.op_path.rsplit("/", 1)[-1] in _CONSTRAINT_OP_NAMES:
        return "sharding_constraint"  # Shardy exports it as a copy named after the JAX op
    src = data.source
    if opcode in ("copy", "custom-call") and src is not None and (src.file, src.line) in asked_lines:
        return "sharding_constraint"  # a line where the lowered StableHLO asks for a sharding
    return None


def _lost_axes(graph, node, op):
    """(lost axes, operand node, element) when the op drops an axis of its operand."""
    src = operand_of(graph, node, 0)
    if src is None:
        return None
    operand, element = src
    before = sharding_of(graph, operand, element)
    after = sharding_of(graph, node, 0)
    if before is None or after is None or before.manual or after.manual:
        return None
    in_dims, out_dims = dims_of(graph, operand, element), dims_of(graph, node, 0)
    if op == "reshape":
        pairs = reshape_groups(in_dims, out_dims)
    elif op == "sort":
        dims = node_of(graph, node).instr.dimensions or (0,)
        pairs = [([d], [d]) for d in dims]
    elif op == "top_k":
        pairs = [([len(in_dims) - 1], [len(in_dims) - 1])]
    elif op in ("cumsum", "reduce-window"):
        sizes = node_of(graph, node).instr.window_sizes
        pairs = [([d], [d]) for d, s in enumerate(sizes) if s > 1]
    else:  # sharding_constraint: every dimension
        pairs = [([d], [d]) for d in range(len(in_dims))]
    lost: list[str] = []
    for ins, outs in pairs:
        had = [a for d in ins if d < len(before.dims) for a in before.dims[d]]
        kept = {a for d in outs if d < len(after.dims) for a in after.dims[d]}
        lost += [a for a in had if a not in kept and not a.startswith("?")]
    if op != "sharding_constraint":
        # An axis the result still carries on another dimension was moved there (by an
        # all-to-all, which `_causes` finds at the op), not dropped. A constraint that moves
        # one asked for the move, and is listed as asked.
        carried = {a for axes in after.dims for a in axes}
        lost = [a for a in lost if a not in carried]
    if not lost:
        return None
    return tuple(dict.fromkeys(lost)), operand, element


def _constrained(graph, node, asked_lines) -> bool:
    """True when a sharding constraint right after the op asked for its sharding."""
    mine = sharding_of(graph, node)
    frontier = [node]
    for _ in range(3):
        nxt = []
        for n in frontier:
            for user in graph.successors(n):
                data = node_of(graph, user)
                if _op_label(data, asked_lines) == "sharding_constraint":
                    if sharding_of(graph, user) == mine:
                        return True
                elif data.opcode in ("copy", "convert", "bitcast"):
                    nxt.append(user)
        frontier = nxt
    return False


def _finding(graph, node, op, lost, operand, element, feeds, ids, nbytes) -> Finding:
    data = node_of(graph, node)
    before = describe(graph, operand, element)
    after = describe(graph, node, 0)
    axes = ", ".join(lost)
    message = (f"{op} {before} -> {after} drops mesh axis {axes}: XLA's propagated result "
               f"no longer carries it, so the operand is gathered over {axes}"
               + (" and the value flows into a grouped matmul" if feeds else ""))
    spec = sharding_of(graph, operand, element).dims
    way_out = dropped_way_out(op, lost, feeds, spec)
    return Finding(kind=FindingKind.DROPPED, op=op, axes=lost, feeds_grouped_matmul=feeds,
                   source=source_of(graph, node), op_path=data.op_path, operand_shape=before,
                   result_shape=after, collectives=ids, bytes=nbytes, message=message, way_out=way_out,
                   neighbourhood=neighbourhood(graph, node), operand_spec=spec,
                   operand_dims=dims_of(graph, operand, element), needed_by=op,
                   stack=user_sources(data.instr.stack), backward=data.backward)


def neighbourhood(graph, node, radius: int = 2, limit: int = 14) -> Neighbourhood:
    """Ops within `radius` edges of `node` (producers and users), at most `limit`."""
    distance = around(graph, node, radius)
    keep = sorted(distance, key=lambda n: (distance[n], n))[:limit]
    nodes = tuple(GraphNode(id=n, op=node_of(graph, n).opcode,
                            shape=describe(graph, n, 0) if node_of(graph, n).result else "",
                            source=source_of(graph, n), focus=n == node) for n in keep)
    kept = set(keep)
    edges = tuple((a, b) for a in keep for b in graph.successors(a) if b in kept)
    return Neighbourhood(nodes=nodes, edges=edges)


def describe(graph, node, element: int) -> str:
    """`f32[4,64,16] P('data', 'context', None)`: global shape with its propagated sharding."""
    array = node_of(graph, node).result[element]
    sharding: Sharding | None = sharding_of(graph, node, element)
    if sharding is None:
        return str(array)
    specs = []
    for axes in sharding.dims:
        specs.append("None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(tuple(axes)))
    return f"{array} P({', '.join(specs)})"
