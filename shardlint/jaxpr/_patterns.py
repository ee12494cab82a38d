"""What a grouped matmul and a routed layer's expert matmuls are in a jaxpr: asked by the
analyzer and by the rewrites alike.

XLA:CPU lowers `ragged_dot` to a masked dense dot that is indistinguishable from other
dots in HLO, so the analysis asks the traced program which equations are grouped matmuls
and matches them by source line (`grouped_matmul_sources`); the rewrites ask the same to
find routed regions (`is_expert_batched_eqn`, and `reads_expert_weights` for dense dispatch).
Reading a user frame goes through JAX's private `source_info_util`, behind
`shardlint._jax.user_frame`.
"""

from __future__ import annotations

from .. import _jax
from ._levels import equations
from .._ops import JAXPR_LAYOUT, SAME_DIMS


# Ops that take one layer's weights out of weights stacked over layers (`w[i]`, with a
# squeeze): they keep every dimension where it is.
_INDEXING = frozenset({"slice", "dynamic_slice"})
GROUPED_MATMUL_PRIMITIVES = ("ragged_dot_general", "ragged_dot", "gmm", "tgmm")


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


def grouped_matmul_sources(closed_jaxpr) -> frozenset[tuple[str, int]]:
    found = (_jax.user_frame(eqn) for eqn in equations(closed_jaxpr.jaxpr) if is_grouped_matmul_eqn(eqn))
    return frozenset(frame for frame in found if frame is not None)
