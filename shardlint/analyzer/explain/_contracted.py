"""Tokens un-sharded by a contraction: a routed layer's dispatch that sums the sequence away.

A capacity dispatch (`BSM,BSEC -> EBCM`, GShard's and MaxText's dense path) contracts the
tokens' sequence dimension into capacity slots. With the sequence sharded over `context`,
each device holds partial sums: XLA all-reduces them over `context`, and the expert matmuls
that read the result compute every capacity slot of the whole sequence on every context
shard. Nothing is gathered and no propagation drops an axis, yet memory and FLOPs per device
grow with the context degree. (At MaxText's Mixtral-8x7B size on 64 v5p chips this is all
that shows of the routed layer's loss: XLA keeps its routing ops sharded there.)

Such a contraction is a finding of its own (`contracted-tokens`), on the contraction's line,
with the all-reduces of its partial sums and what it costs: the per-device bytes of its
result and of the expert matmuls' results (each holds every slot on every shard) and the
FLOPs those matmuls repeat on every shard beyond its share. Which dots are such a
dispatch is `_patterns.contracted_tokens`'s question.
"""

from __future__ import annotations

import math

import networkx as nx

from ..._op_paths import members_of
from ..._source import user_sources
from ..._vocab import REDUCTIONS, Cause, FindingKind
from ._detect import describe, neighbourhood
from ..parse import MeshInfo
from ..graph import (contracted_tokens, dims_of, matmuls_after_dispatch, node_of, operand_of,
    sharding_of, source_of)
from .._model import Collective, Finding
from ._wayout import contracted_way_out
from ..._format import human_bytes

def find_contracted_tokens(graph: nx.DiGraph, mesh: MeshInfo,
                           collectives: tuple[Collective, ...]) -> tuple[Finding, ...]:
    """One finding per dispatch that sums tokens over a sharded axis, each claiming the
    reductions XLA labelled with it: its op path, alone or among the names of several
    all-reduces XLA combined into one (that one is counted whole); each reduction is one
    finding's."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    claimed: set[str] = set()
    findings = []
    for node, data in graph.nodes(data="op"):
        axes = contracted_tokens(graph, node)
        if not axes:
            continue
        ids = tuple(c.id for c in collectives
                    if c.kind in REDUCTIONS and c.id not in claimed and set(c.axes) & set(axes)
                    and data.op_path in members_of(c.xla_op_path))
        claimed.update(ids)
        findings.append(_finding(graph, node, axes, sizes, [c for c in collectives if c.id in ids]))
    return tuple(findings)


def _finding(graph, node, axes, sizes, members) -> Finding:
    data = node_of(graph, node)
    # The tokens' own operand: the one of fewer dimensions (`BSM` beside the `BSEC` mask).
    operand = min((operand_of(graph, node, p) for p in (0, 1)), key=lambda o: len(dims_of(graph, *o)))
    replicas = math.prod(sizes.get(a, 1) for a in axes)
    matmuls = matmuls_after_dispatch(graph, node)
    held = _per_device_bytes(graph, node, sizes) + sum(_per_device_bytes(graph, m, sizes) for m in matmuls)
    flops = sum(_per_device_flops(graph, m, sizes) for m in matmuls)
    repeated = flops * (1 - 1 / replicas)
    over = ", ".join(axes)
    nbytes = sum(c.step_bytes for c in members)
    message = (f"dot_general {describe(graph, *operand)} contracts a token dimension sharded over "
               f"{over} into {describe(graph, node, 0)}: each device holds partial sums, XLA "
               f"reduces them over {over}"
               + (f" ({human_bytes(nbytes)} per device per step)" if members else "")
               + f", and the result and the {len(matmuls)} expert matmul(s) that read it are "
               f"replicated over {over}: {human_bytes(held)} of buffers per device, "
               f"{repeated:.3g} FLOPs per device computed on every shard beyond its share")
    stack = user_sources(data.instr.stack)
    return Finding(
        kind=FindingKind.CONTRACTED, op="dot_general", axes=axes, feeds_grouped_matmul=True,
        source=source_of(graph, node), op_path=data.op_path, operand_shape=describe(graph, *operand),
        result_shape=describe(graph, node, 0), collectives=tuple(c.id for c in members), bytes=nbytes,
        message=message, way_out=contracted_way_out(axes),
        neighbourhood=neighbourhood(graph, node), operand_spec=sharding_of(graph, *operand).dims,
        operand_dims=dims_of(graph, *operand), cause=Cause.LOST, needed_by="dot_general",
        stack=stack, backward=data.backward, replicated_bytes=held, repeated_flops=repeated)


def _shards(graph, node, sizes, extra_dims=()) -> int:
    """How many devices split the op's result (and the extra operand dimensions given, as
    (node, element, dims)): the product of the mesh axes that shard them."""
    axes = set(sharding_of(graph, node, 0).axes())
    for src, element, dims in extra_dims:
        sharding = sharding_of(graph, src, element)
        axes |= {a for d in dims if d < len(sharding.dims) for a in sharding.dims[d]}
    return math.prod(sizes.get(a, 1) for a in axes)


def _per_device_bytes(graph, node, sizes) -> int:
    return node_of(graph, node).result[0].nbytes // _shards(graph, node, sizes)


def _per_device_flops(graph, node, sizes) -> float:
    """2 x result elements x contracted elements of a dot, over the devices that split it
    (0 for a grouped matmul that is no dot: a custom call's work is not read here)."""
    data = node_of(graph, node)
    lhs = operand_of(graph, node, 0)
    if data.opcode != "dot" or lhs is None:
        return 0.0
    contracting = data.instr.lhs_contracting_dims
    lhs_dims = dims_of(graph, *lhs)
    work = 2 * math.prod(dims_of(graph, node, 0)) * math.prod(lhs_dims[d] for d in contracting)
    return work / _shards(graph, node, sizes, [(*lhs, contracting)])
