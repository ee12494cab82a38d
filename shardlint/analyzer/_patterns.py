"""What a grouped matmul and a routed-expert computation are: defined once, for all.

The analyzer asks whether a lost value flows into a grouped matmul (in the propagated HLO,
`is_grouped_matmul` / `feeds_grouped_matmul`) and which jaxpr equations are grouped matmuls
(`is_grouped_matmul_eqn`, matched back to HLO by source line because XLA:CPU lowers
`ragged_dot` to a masked dense dot); the rewrites ask the same of the jaxpr to find routed
regions (`is_expert_batched_eqn`, and `reads_expert_weights` for dense dispatch).
Which ops need a whole dimension, move values or route tokens is the op table's
(`_ops.py`).
"""

from __future__ import annotations

import collections

import networkx as nx

from ._dataflow import MOVES
from ._graph import dims_of, node_of, operand_of, reshape_groups, sharding_of
from .._op_paths import is_backward
from .._ops import JAXPR_LAYOUT, SAME_DIMS, WEIGHT_PATH_OPCODES

# Ops that take one layer's weights out of weights stacked over layers (`w[i]`, with a
# squeeze): they keep every dimension where it is.
_INDEXING = frozenset({"slice", "dynamic_slice"})
GROUPED_MATMUL_PRIMITIVES = ("ragged_dot_general", "ragged_dot", "gmm", "tgmm")
_GMM_TARGET_WORDS = ("gmm", "ragged", "grouped", "megablox", "tgmm")

def is_grouped_matmul_eqn(eqn) -> bool:
    """A jaxpr equation that is a grouped matmul: `ragged_dot_general`, or a megablox-style
    Pallas kernel named for it."""
    name = eqn.primitive.name
    return name in GROUPED_MATMUL_PRIMITIVES or (
        name == "pallas_call" and any(w in str(eqn.params.get("name", "")) for w in ("gmm", "grouped")))


def is_expert_batched_eqn(eqn, producer: dict) -> bool:
    """A jaxpr dispatch einsum: dot_general batched over the leading (expert) dim of a
    rank-3 weight that is an input of the jaxpr (`producer`: Var -> equation index).
    The jaxpr side of `is_grouped_matmul`'s expert-batched dot."""
    if eqn.primitive.name != "dot_general":
        return False
    (_, _), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    for operand, batch in zip(eqn.invars, (lhs_batch, rhs_batch)):
        if (not hasattr(operand, "val") and producer.get(operand) is None
                and len(getattr(operand.aval, "shape", ())) == 3 and 0 in tuple(batch)):
            return True
    return False


def reads_expert_weights(eqn, eqns, producer: dict, tokens=frozenset()) -> bool:
    """A jaxpr matmul with a stacked expert weight: an input of the jaxpr of rank 3 or
    more, maybe through a layout op or a sharding annotation, whose leading (expert)
    dimension the matmul does not contract: an einsum with `[E, D, F]` weights, as dense
    dispatch computes every expert. Attention's `[D, heads, head_dim]` and
    `[heads, head_dim, D]` kernels contract their leading dimension and are not experts;
    nor are inputs in `tokens` (activations, which a scan body takes as inputs too). A layer's
    weight indexed out of a stack over layers (`w[i]`: a slice and a squeeze of the layer
    dimension) is that layer's weight, its expert dimension the one after the layer's."""
    name = eqn.primitive.name
    if name not in ("dot_general", "ragged_dot_general"):
        return False
    contracting = eqn.params["dimension_numbers"][0] if name == "dot_general" else ((), ())
    for side, operand in enumerate(eqn.invars[:2]):
        if len(getattr(operand.aval, "shape", ())) < 3:
            continue
        chain = []   # layout ops from the weight down to the matmul's operand, last first
        for _ in range(6):
            if hasattr(operand, "val"):   # a Literal
                break
            p = producer.get(operand)
            if p is None:
                if operand not in tokens:
                    leading = _leading_dim_after(reversed(chain))
                    if leading is not None and leading not in contracting[side]:
                        return True
                break
            if eqns[p].primitive.name not in JAXPR_LAYOUT | _INDEXING or not eqns[p].invars:
                break
            chain.append(eqns[p])
            operand = eqns[p].invars[0]
    return False


def _leading_dim_after(layout_eqns) -> int | None:
    """Where a weight's leading dimension is after these layout ops (None: reshaped). Where
    a squeeze drops it (a layer index into weights stacked over layers), the leading
    dimension is the next one kept."""
    position = 0
    for layout in layout_eqns:
        name = layout.primitive.name
        if name == "transpose":
            position = tuple(layout.params["permutation"]).index(position)
        elif name == "squeeze":
            dropped = set(layout.params["dimensions"])
            kept = [d for d in range(len(layout.invars[0].aval.shape)) if d not in dropped]
            position = next((k for k, d in enumerate(kept) if d >= position), None)
            if position is None:
                return None
        elif name not in SAME_DIMS | _INDEXING:
            return None
    return position


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
    backward = is_backward(node_of(graph, start).op_path)
    seen, queue = {(start, None)}, collections.deque([(start, None)])
    while queue:
        for user, element in _readers(graph, *queue.popleft()):
            if (user, element) in seen or is_backward(node_of(graph, user).op_path) != backward:
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
    backward = is_backward(node_of(graph, dispatch).op_path)
    found, seen = [], {(dispatch, None)}
    queue = collections.deque([(dispatch, None)])
    while queue and len(seen) < most:
        for user, element in _readers(graph, *queue.popleft()):
            if (user, element) in seen or is_backward(node_of(graph, user).op_path) != backward:
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
