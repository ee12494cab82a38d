"""What a grouped matmul and a routed layer's dispatch are in the propagated HLO graph.

The analyzer asks whether a lost value flows into a grouped matmul (`is_grouped_matmul`,
`feeds_grouped_matmul`) and whether a dot sums tokens away before one (`contracted_tokens`).
The same questions asked of a jaxpr are `shardlint.jaxpr`'s (`is_grouped_matmul_eqn`,
`is_expert_batched_eqn`, `reads_expert_weights`), which the rewrites ask too. Which ops need
a whole dimension, move values or route tokens is the op table's (`_ops.py`).
"""

from __future__ import annotations

import collections

import networkx as nx

from ._dataflow import MOVES
from ._graph import dims_of, node_of, operand_of, sharding_of
from ..._reshape import reshape_groups
from ..._ops import WEIGHT_PATH_OPCODES

_GMM_TARGET_WORDS = ("gmm", "ragged", "grouped", "megablox", "tgmm")


def feeds_grouped_matmul(graph: nx.DiGraph, start: str) -> bool:
    """Whether the op's result reaches a grouped matmul along the routed layer's own path:
    on through the ops that route, order, count or re-lay tokens; through a contraction only
    where it is a dispatch, whose result reaches the expert matmul by layout ops alone (the
    capacity dispatch `bsd,bsec->ebcd`); never past a reshape that splits the tokens back
    into (batch, seq); within the op's own pass (a forward value reaches the backward's
    matmuls through the loss and the whole network's backward, not through the routed
    layer). Attention's K and V reach the next layer's experts only through its own
    contractions and the residual stream: they feed none."""
    operand = operand_of(graph, start, 0)
    dims = dims_of(graph, operand[0], operand[1]) if operand else ()
    batch_seq = tuple(dims[:2]) if len(dims) >= 3 else None   # flattened tokens: not known
    backward = node_of(graph, start).backward
    seen, queue = {(start, None)}, collections.deque([(start, None)])
    while queue:
        for user, element in _readers(graph, *queue.popleft()):
            if (user, element) in seen or node_of(graph, user).backward != backward:
                continue
            seen.add((user, element))
            if is_grouped_matmul(graph, user):
                return True
            opcode = node_of(graph, user).opcode
            if opcode == "reshape" and _unflattens(graph, user, batch_seq):
                continue  # reshaped back to (batch, seq, ...): the token region ends here
            if _contracts(graph, user) and not _dispatches(graph, user):
                continue
            queue.append((user, element))
    return False


def contracted_tokens(graph: nx.DiGraph, node: str) -> tuple[str, ...]:
    """The mesh axes a routed layer's dispatch sums its tokens over: a dot that contracts
    tokens against tokens (a dimension sharded over the same mesh axes in both operands),
    whose result carries none of those axes and reaches a grouped matmul through ops that
    only move it. That is the capacity dispatch `BSM,BSEC -> EBCM` with the sequence
    sharded, and in the backward the combine's transpose (`BSM,BSEC -> EBCM` again). () for
    any other op: an expert matmul contracts the embedding against a weight, a weight's
    gradient contracts tokens against tokens but feeds no expert matmul."""
    data = node_of(graph, node)
    if data.opcode != "dot" or not data.shardings or data.shardings[0].manual:
        return ()
    carried = data.shardings[0].axes()
    summed = []   # per operand, the axes its contracted dimensions are sharded over, in order
    for position, contracting in ((0, data.instr.lhs_contracting_dims), (1, data.instr.rhs_contracting_dims)):
        operand = operand_of(graph, node, position)
        sharding = sharding_of(graph, *operand) if operand is not None else None
        if sharding is None:
            return ()
        summed.append([a for d in contracting if d < len(sharding.dims) for a in sharding.dims[d]
                       if a not in carried and not a.startswith("?")])
    axes = tuple(dict.fromkeys(a for a in summed[0] if a in summed[1]))
    return axes if axes and _dispatches(graph, node) else ()


def matmuls_after_dispatch(graph: nx.DiGraph, dispatch: str, most: int = 256) -> list[str]:
    """The grouped matmuls that compute on a dispatch's result, within its pass: on through
    them and what re-lays or scales their values, up to the contraction that combines the
    experts' outputs (a dot that is no grouped matmul), which ends the walk."""
    backward = node_of(graph, dispatch).backward
    found, seen = [], {(dispatch, None)}
    queue = collections.deque([(dispatch, None)])
    while queue and len(seen) < most:
        for user, element in _readers(graph, *queue.popleft()):
            if (user, element) in seen or node_of(graph, user).backward != backward:
                continue
            seen.add((user, element))
            if is_grouped_matmul(graph, user):
                found.append(user)
            elif _contracts(graph, user):
                continue
            queue.append((user, element))
    return found


def _readers(graph, node: str, element: int | None):
    """The ops reading `element` of the op's result (None: all of it), each with the element
    of its own result that carries the value on: a tuple carries it as one of its elements,
    an optimization barrier (`jax.checkpoint` saves a layer's inputs through one) as the same,
    a get-tuple-element only where it takes that element. A tuple is not its elements: the
    embedding saved beside an expert weight does not feed that weight's matmul."""
    for user in graph.successors(node):
        edge = graph.edges[node, user]
        if element is not None and edge["element"] is not None and edge["element"] != element:
            continue
        data = node_of(graph, user)
        if element is not None and data.opcode == "get-tuple-element" and edge["element"] is None:
            if (data.instr.tuple_index or 0) != element:
                continue
            yield user, None
        elif data.opcode == "tuple":
            yield user, edge["position"]
        elif data.opcode in ("opt-barrier", "optimization-barrier"):
            yield user, element
        else:
            yield user, None


def _contracts(graph, node: str) -> bool:
    """A dot that sums over a dimension, or a convolution (a dot that contracts nothing is
    a broadcast product: the backward of a combine `tkd,tk->td`)."""
    data = node_of(graph, node)
    if data.opcode == "convolution":
        return True
    return data.opcode == "dot" and bool(data.instr.lhs_contracting_dims or data.instr.rhs_contracting_dims)


def _unflattens(graph, reshape: str, batch_seq: tuple[int, int] | None) -> bool:
    """The reshape splits a dimension of batch x seq elements back into (batch, seq)."""
    operand = operand_of(graph, reshape, 0)
    if operand is None or batch_seq is None:
        return False
    before, after = dims_of(graph, *operand), dims_of(graph, reshape, 0)
    return any(len(ins) == 1 and before[ins[0]] == batch_seq[0] * batch_seq[1]
               and tuple(after[j] for j in outs if after[j] > 1)[:2] == batch_seq
               for ins, outs in reshape_groups(before, after))


def _dispatches(graph, dot: str, hops: int = 4) -> bool:
    """The contraction's result reaches a grouped matmul through ops that only move it."""
    frontier, seen = [dot], {dot}
    for _ in range(hops):
        frontier = [u for n in frontier for u in graph.successors(n) if u not in seen]
        seen.update(frontier)
        if any(is_grouped_matmul(graph, u) for u in frontier):
            return True
        frontier = [u for u in frontier if node_of(graph, u).opcode in MOVES]
    return False


def is_grouped_matmul(graph: nx.DiGraph, node: str) -> bool:
    """ragged-dot, a gmm-like custom call, a dot that JAX traced from a grouped-matmul
    primitive, or a dispatch einsum batched over the expert dim of stacked weights.

    On XLA:CPU `jax.lax.ragged_dot` lowers to a masked dense `dot`, which the HLO alone
    cannot tell from any other dot; the jaxpr can, so `build_graph` marks the dots at the
    source lines of `ragged_dot_general` equations `grouped_matmul`.
    """
    data = node_of(graph, node)
    opcode = data.opcode
    if opcode in ("ragged-dot", "ragged_dot"):
        return True
    if opcode == "custom-call":
        target = data.instr.custom_call_target.lower()
        return any(w in target for w in _GMM_TARGET_WORDS)
    if opcode != "dot":
        return False
    if data.grouped_matmul:
        return True
    instr = data.instr
    for position, batch_dims in ((0, instr.lhs_batch_dims), (1, instr.rhs_batch_dims)):
        operand = operand_of(graph, node, position)
        if (operand is not None and len(dims_of(graph, *operand)) == 3 and 0 in batch_dims
                and _from_parameter(graph, *operand)):
            return True
    return False


def _from_parameter(graph, node, element: int = 0, depth: int = 8) -> bool:
    """The value (`element` of the op's result) is a parameter, moved: through layout ops,
    and through the tuples, get-tuple-elements and optimization barriers (`jax.checkpoint`
    puts the weights its backward reads through one) that carry it, element by element."""
    for _ in range(depth):
        data = node_of(graph, node)
        if data.opcode == "parameter":
            return True
        if data.opcode == "tuple":
            src = operand_of(graph, node, element)
        elif data.opcode == "get-tuple-element":
            src = operand_of(graph, node, 0)
            src = (src[0], data.instr.tuple_index or 0) if src else None
        elif data.opcode in ("opt-barrier", "optimization-barrier"):
            src = operand_of(graph, node, 0)
            src = (src[0], element) if src else None
        elif data.opcode in WEIGHT_PATH_OPCODES:
            src = operand_of(graph, node, 0)
        else:
            return False
        if src is None:
            return False
        node, element = src
    return False
