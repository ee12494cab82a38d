"""Why each collective of the partitioned program is there: one cause from a closed set.

The analysis starts from the collectives XLA emitted, not from a list of suspicious ops:
many gathers are placed by the SPMD partitioner for an op whose operand and result stay
sharded in the propagated module (a scatter, a gather, a reduce-window, a dynamic-slice,
a custom call), and only the partitioned module shows them. For each collective, in order:

- `lost`, at once, for what a propagation drop moves (`_detect.py`): XLA's propagated
  module says the op dropped the axis of that value; and for the partial sums of a routed
  dispatch that contracted sharded tokens (`_contracted.py`);
- `reduction`: any other all-reduce or reduce-scatter of partial sums;
- `weights`: it moves a step parameter that nothing computed from (FSDP, ZeRO), as the
  provenance of its value says (`_dataflow.py`), for an op that may want a weight whole
  (a contraction, an embedding's gather). An argument that the program treats as tokens,
  or that XLA's partitioner gathered for an op that orders or counts tokens (its label on
  the collective is in `_ops.TOKEN_PRIMITIVES`: sort, top_k, a cumulative sum, a scatter),
  is an input activation, and so is all that moves it;
- `requested` (gathers) or `layout` (all-to-all, permutes): the code wrote the collective
  inside a shard_map, or a constraint / reshard / shard_map spec at that op asked for a
  sharding without the axis. What the constraint asked is read, not assumed: a constraint
  that keeps an axis requests no gather over it;
- `lost`: a gather or all-to-all of an activation that nobody asked for. Each becomes (part
  of) a finding that names the op that needed it: a propagation drop found in the
  propagated module (`_detect.py`), or the op the partitioner could not split, from XLA's
  own label on the collective, which is the op it was partitioning when it emitted it;
- `layout` for the remaining collective-permutes (halo exchanges the partitioner chose).

XLA's "Involuntary full rematerialization" messages become findings of their own.
"""

from __future__ import annotations

import dataclasses

import networkx as nx

from ..._vocab import REDUCTIONS, Cause, CollectiveKind, FindingKind, present, verb_of, words
from ..graph import (dims_of, feeds_grouped_matmul, node_of, Provenance, sharding_of, source_of,
    stack_key)
from ._attribution import attribute
from ._detect import describe, neighbourhood
from ..parse import Asked, HloModule
from ..._op_paths import is_backward, primitive_of
from ..._ops import NEEDS_WHOLE, TOKEN_PRIMITIVES, WRITTEN_COLLECTIVES, lowered_to
from .._model import Collective, Finding, Requested
from ..._source import Source, user_sources, user_stack
from ._wayout import resharded_way_out, unsplit_way_out
from ..compile import Remat

@dataclasses.dataclass(frozen=True)
class _Ask:
    """A sharding the user asked for and the mesh axes it leaves out."""

    requested: Requested
    stacks: frozenset            # the ask's own stack and those of the ops right next to it
    listed_when_used: bool = False   # listed only when it explains a collective
    requested_shape: tuple[int, ...] = ()   # the global shape of the value asked for, if known


def explain(collectives: tuple[Collective, ...], module: HloModule, flow: Provenance,
            drops: tuple[Finding, ...], requested: tuple[Requested, ...], asked: tuple[Asked, ...],
            graph: nx.DiGraph | None, remats: tuple[Remat, ...], mesh_axes: dict[str, int]):
    """Returns (collectives with causes, findings, requested entries)."""
    by_name = {i.name: i for i in module.instructions()}
    stacks = _stack_index(graph) if graph is not None else {}
    asks = _asks(requested, asked, graph, stacks, mesh_axes)
    dropped_by = {cid: f for f in drops for cid in f.collectives}
    explained, used_asks = [], set()
    for c in collectives:
        instr = by_name.get(c.id)
        own = stack_key(user_stack(instr.stack)) if instr is not None else ()
        cause, ask = _cause(c, flow.is_weight(c.id), own, dropped_by, asks, _gathered_lengths(instr))
        if ask is not None:
            used_asks.add(ask)
        explained.append(dataclasses.replace(c, cause=cause))
    findings = list(drops)  # already lost, at their op, with per-step bytes (_detect.py)
    partitioned = _partitioner_findings(explained, dropped_by, graph, stacks)
    explained = list(attribute(explained, partitioned))   # each names its finding's line
    findings += partitioned
    findings += _remat_findings(remats, graph)
    requested = tuple(dict.fromkeys(
        a.requested for a in asks if not a.listed_when_used or a in used_asks))
    findings.sort(key=lambda f: (f.source.file if f.source else "", f.source.line if f.source else 0,
                                 f.op_path))
    return tuple(explained), tuple(findings), requested


def with_gathered_tokens(flow: Provenance, collectives: tuple[Collective, ...]) -> Provenance:
    """`flow`, with the arguments XLA's partitioner gathered for an op that orders or counts
    tokens (its own label on the collective) as token inputs."""
    for c in collectives:
        if primitive_of(c.xla_op_path) in TOKEN_PRIMITIVES:
            flow = flow.with_tokens(flow.moved_weights(flow.of(c.id)))
    return flow


def _cause(c: Collective, weight: bool, own: tuple, dropped_by, asks,
           gathered: frozenset[int] = frozenset()) -> tuple[str, _Ask | None]:
    if c.id in dropped_by:
        # XLA's propagation dropped the axis of what it moves (tokens), or it sums the
        # partial sums of a dispatch that contracted sharded tokens (`_contracted.py`)
        return Cause.LOST, None
    if c.kind in REDUCTIONS:
        return Cause.REDUCTION, None
    if weight:
        return Cause.WEIGHTS, None
    asked_kind = Cause.REQUESTED if c.kind == CollectiveKind.ALL_GATHER else Cause.LAYOUT
    if primitive_of(c.xla_op_path) in WRITTEN_COLLECTIVES:
        return asked_kind, None
    consumer = stack_key(c.stack)
    for ask in asks:
        if (set(c.axes) & set(ask.requested.axes) and (own in ask.stacks or consumer in ask.stacks)
                and _may_have_asked(ask, gathered)):
            return asked_kind, ask
    if c.kind == CollectiveKind.COLLECTIVE_PERMUTE:
        return Cause.LAYOUT, None
    return Cause.LOST, None


def _gathered_lengths(instr) -> frozenset[int]:
    """The lengths of the dimensions an all-gather gathers, in its per-device result."""
    if instr is None or instr.opcode not in ("all-gather", "all-gather-start") or not instr.result:
        return frozenset()
    dims = instr.result[-1].dims
    return frozenset(dims[d] for d in instr.dimensions or () if d < len(dims))


def _may_have_asked(ask: _Ask, gathered: frozenset[int]) -> bool:
    """An ask read from the lowered program (only matched by the stacks near it) asks for a
    gather only of a dimension its value has: one of the gathered lengths is one of its
    dimensions. A sharding asked of a layer's expert activations `[1024, 96]` asks for no
    gather of the sequence (128) that a stack shared through a scanned layer's weight
    slice put near it. A constraint the propagated module shows dropping an axis is matched
    by its stacks alone."""
    shape = ask.requested_shape
    return not (ask.listed_when_used and shape and gathered) or bool(gathered & set(shape))


def _stack_index(graph: nx.DiGraph) -> dict[tuple, list[str]]:
    """The propagated ops by their user stack (stack_key)."""
    index: dict[tuple, list[str]] = {}
    for node, data in graph.nodes(data="op"):
        key = _key_of(data)
        if key:
            index.setdefault(key, []).append(node)
    return index


def _key_of(data) -> tuple:
    return stack_key(user_stack(data.instr.stack))


def _asks(requested, asked, graph, stacks, mesh_axes) -> list[_Ask]:
    """Every ask that leaves axes out, with the stacks of the ops next to it.

    `requested` are constraints whose propagated result drops axes its operand had (read in
    the propagated module); `asked` are the shardings the lowered program asks for, whose
    left-out axes are those of the mesh (size > 1) that they do not name: they explain a
    gather only when one matches them, and are listed then."""
    asks = []
    for r in requested:
        asks.append(_Ask(r, _nearby(stack_key(r.stack), graph, stacks)))
    for a in asked:
        named = {axis for dim in a.dims for axis in dim}
        left_out = tuple(axis for axis, size in mesh_axes.items() if size > 1 and axis not in named)
        if not left_out or a.op == "shard_map":
            continue  # shard_map specs are per input; its gathers are matched by XLA's label
        stack = user_sources(tuple(Source(f, n) for f, n in a.stack))
        r = Requested(op=_ASK_OPS.get(a.op, a.op), axes=left_out, source=stack[0] if stack else None,
                      op_path=a.op, stack=stack, asked=a.dims)
        asks.append(_Ask(r, _nearby(stack_key(stack), graph, stacks), listed_when_used=True,
                         requested_shape=a.shape))
    return asks


_ASK_OPS = {"sharding_constraint": "sharding_constraint", "reshard": "reshard"}


def _nearby(key: tuple, graph, stacks, radius: int = 3) -> frozenset:
    """The ask's stack and the stacks of the ops within `radius` edges upstream of it: XLA
    may move the gather of a constrained value to the ops that made it. Gathering K and V
    over the sequence, it gathers their projections' input once instead, labelled at the
    projection (JAX 0.10) or, in the backward, at the norm before it, three ops above the
    constraint (reshape <- dot <- mul; JAX 0.12)."""
    found = {key} if key else set()
    if graph is None:
        return frozenset(found)
    frontier = list(stacks.get(key, ()))
    for _ in range(radius):  # upstream only: ops whose values flow into the ask
        frontier = [p for n in frontier for p in graph.predecessors(n)]
        found.update(_key_of(node_of(graph, p)) for p in frontier)
    found.discard(())
    return frozenset(found)


def _partitioner_findings(collectives, dropped_by, graph, stacks) -> list[Finding]:
    """One finding per op the partitioner could not split, for the lost collectives that no
    propagation drop explains: grouped by the op that needed them (its stack and op path:
    forward and backward apart, and the named scopes of layers that share their lines)."""
    groups: dict[tuple, list[Collective]] = {}
    for c in collectives:
        if c.cause == Cause.LOST and c.id not in dropped_by:
            groups.setdefault((c.needed_by, stack_key(c.stack), c.op_path), []).append(c)
    findings = []
    for (op, key, path), members in groups.items():
        node = _node_for(graph, stacks, key, op, path) if graph is not None else None
        op_path = node_of(graph, node).op_path if node is not None else members[0].op_path
        findings.append(_finding(op or members[0].kind, op_path, members, graph, node))
    return findings


def _node_for(graph, stacks, key, op, op_path: str) -> str | None:
    """The propagated op that needed the collectives: at their reader's stack, preferring
    the op whose JAX name is the one that needed them, of an opcode it lowers to (not a
    constant XLA labelled with it), of that op path, then in the same direction (forward
    or backward)."""
    candidates = list(stacks.get(key, ()))
    if not candidates:
        return None
    opcodes = lowered_to(op)

    def rank(n):
        data = node_of(graph, n)
        return (data.primitive != op, data.opcode not in opcodes, data.op_path != op_path,
                data.backward != is_backward(op_path), n)

    return min(candidates, key=rank)


def _finding(op: str, op_path: str, members: list[Collective], graph, node) -> Finding:
    """A finding for the lost collectives XLA's partitioner emitted for `op`: an op whose
    operand was moved to another sharding (`resharded-operand`: all it cost is all-to-alls,
    which move shards and gather nothing, or it could run sharded and its operands came
    sharded along different dimensions), else an op that needs a dimension whole
    (`unsplit-op`)."""
    axes = tuple(dict.fromkeys(a for c in members for a in c.axes))
    first = members[0]
    stack = _stack_of(members, graph, node)
    operand = result = first.shape
    spec: tuple = ()
    dims: tuple = ()
    sharded: list = []
    if node is not None:
        result = describe(graph, node, 0)
        sharded = [(p, e) for p, _, d in graph.in_edges(node, data=True)
                   for e in [d["element"] or 0] if (s := sharding_of(graph, p, e)) and s.axes()]
        if sharded:
            operand = describe(graph, *sharded[0])
            spec = sharding_of(graph, *sharded[0]).dims
            dims = tuple(dims_of(graph, *sharded[0]))
    nbytes = sum(c.step_bytes for c in members)
    loops = {c.trips for c in members if c.in_loop}
    per = f" x{loops.pop()} iterations" if len(loops) == 1 and None not in loops else ""
    did = "; ".join(f"{present(verb)} {_values(group)} over {', '.join(over)}"
                    for verb, over, group in _by_verb(members)) + per
    feeds = bool(node is not None and feeds_grouped_matmul(graph, node))
    differ = {sharding_of(graph, *pe).dims for pe in sharded}
    operands: tuple[str, ...] = ()
    could_run_sharded = op not in NEEDS_WHOLE and op != first.kind   # the kind: no op known
    moves_only = all(c.kind != CollectiveKind.ALL_GATHER for c in members)
    if moves_only or (could_run_sharded and len(differ) > 1):
        kind, way_out = FindingKind.RESHARDED, resharded_way_out(op, axes, feeds, spec)
        if could_run_sharded and len(differ) > 1:
            operands = tuple(dict.fromkeys(describe(graph, *pe) for pe in sharded))
            message = (f"{op}'s operands ({'; '.join(operands)}) are sharded differently: XLA's "
                       f"partitioner {did} to line them up")
        else:
            message = (f"XLA's partitioner {did} from one sharding to another to compute {op} "
                       "(all-to-all: each device still holds one shard)")
    else:
        kind, way_out = FindingKind.UNSPLIT, unsplit_way_out(op, axes, feeds, spec)
        message = (f"{op} needs its operands whole along a dimension sharded over {', '.join(axes)}: "
                   f"XLA's partitioner {did} for it")
    return Finding(
        kind=kind, op=op, axes=axes, feeds_grouped_matmul=feeds,
        source=stack[0] if stack else first.xla_source, op_path=op_path or first.op_path,
        operand_shape=operand, result_shape=result, collectives=tuple(c.id for c in members),
        bytes=nbytes, message=message, way_out=way_out,
        neighbourhood=neighbourhood(graph, node) if node is not None else None,
        operand_spec=spec, operand_dims=dims, operand_shapes=operands, cause=Cause.LOST, needed_by=op,
        stack=stack, backward=is_backward(op_path or first.op_path))


def _by_verb(members: list[Collective]) -> list[tuple[str, tuple[str, ...], list[Collective]]]:
    """(verb, axes, collectives) per verb of `_vocab.words`: gathered, then moved."""
    return [(verb, over, [c for c in members if verb_of(c.kind) == verb]) for verb, over in words(members)]


def _values(members: list[Collective]) -> str:
    return (f"{len(members)} value(s) ({', '.join(c.shape for c in members[:4])}"
            f"{', ...' if len(members) > 4 else ''} per device)")


def _stack_of(members, graph, node) -> tuple[Source, ...]:
    if node is not None:
        return user_sources(node_of(graph, node).instr.stack)
    return members[0].stack


def _remat_findings(remats: tuple[Remat, ...], graph) -> list[Finding]:
    found = []
    for remat in remats:
        node = _remat_node(remat, graph)
        data = node_of(graph, node) if node is not None else None
        stack = user_sources(data.instr.stack) if data else ()
        op = data.opcode if data else "op"
        found.append(Finding(
            kind=FindingKind.REMATERIALIZED, op=op, axes=(), feeds_grouped_matmul=False,
            source=stack[0] if stack else (source_of(graph, node) if node else None),
            op_path=data.op_path if data else remat.instruction,
            operand_shape=remat.source_sharding, result_shape=remat.target_sharding,
            collectives=(), bytes=0,
            message=(f"XLA's partitioner could not reshard {remat.instruction} from "
                     f"{remat.source_sharding} to {remat.target_sharding} without replicating "
                     "the whole tensor first (involuntary full rematerialization)"),
            way_out=("add a sharding constraint that the partitioner can reach from both sides "
                     "(shard the same dimensions in the same order), or reshape so the "
                     "sharded dimension stays a dimension of its own"),
            neighbourhood=neighbourhood(graph, node) if node is not None else None,
            cause=Cause.LOST, needed_by=op, stack=stack,
            backward=data.backward if data else False))
    return found


def _remat_node(remat: Remat, graph) -> str | None:
    """The propagated op the message names: by instruction name, else by its op path."""
    if graph is None:
        return None
    if remat.instruction in graph:
        return remat.instruction
    same = sorted(n for n, d in graph.nodes(data="op") if remat.op_name and d.op_path == remat.op_name)
    return same[0] if same else None
