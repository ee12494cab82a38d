"""The op table: each op's roles, in its JAX primitive and its HLO opcode spellings.

The analyzer reads ops under two names: JAX's (a jaxpr equation's primitive, the last part
of an op path XLA kept) and XLA's (an HLO instruction's opcode). Every question about what
kind of op something is (does it need a whole dimension, does it only move a value, does it
route tokens) is answered from this one table, so a new op is added once. A role holds for
the spellings it is listed under: `roles` for the JAX names, `hlo_roles` for the opcodes;
each consumer asks for the spelling it reads (`primitives(role)` or `opcodes(role)`).

The roles keep what each consumer asked before the table existed, member for member, and
those sets disagree in places (the routing sets name different cumulative ops; the HLO
parameter walk counts slices and gathers as layout, the jaxpr walk does not); the
disagreements stay visible here as separate roles rather than being merged.

A leaf beside `_vocab` (it imports nothing of shardlint's): the analyzer, the rewrites and
the gate read it alike.
"""

from __future__ import annotations

import dataclasses
import enum


class Role(enum.Enum):
    WHOLE = "needs a whole dimension: a propagation drop or an op the partitioner cannot split"
    TOKENS = "orders, counts or scatters tokens: nothing gathers a weight for it"
    LAYOUT = "moves or re-lays a value without computing (a jaxpr weight's way to its matmul)"
    SAME_DIMS = "a layout op that keeps every dimension where it is"
    WEIGHT_PATH = "an HLO op a parameter passes through and is still the weight (to a dot)"
    ROUTING = "a routing op the partitioner may not split along batch or sequence (the rewrite runs it per shard)"
    ROUTING_FINDING = "a finding's op where a routed layer loses the sharding without a flatten"
    WRITTEN = "a collective the code writes by name (inside shard_map): it was asked for"
    CUMULATIVE = "a running total over tokens: per shard only where each shard may count its own (per-shard capacity)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Op:
    jax: tuple[str, ...] = ()                 # primitive names (as in jaxprs and op paths)
    hlo: tuple[str, ...] = ()                 # HLO opcodes it lowers to
    roles: frozenset[Role] = frozenset()      # roles under its JAX names
    hlo_roles: frozenset[Role] = frozenset()  # roles under its opcodes


def _op(jax=(), hlo=(), roles=(), hlo_roles=()) -> Op:
    return Op(jax=tuple(jax), hlo=tuple(hlo), roles=frozenset(roles), hlo_roles=frozenset(hlo_roles))


W, T, L, S, P, R, F, C, U = (Role.WHOLE, Role.TOKENS, Role.LAYOUT, Role.SAME_DIMS, Role.WEIGHT_PATH,
                             Role.ROUTING, Role.ROUTING_FINDING, Role.WRITTEN, Role.CUMULATIVE)

OPS: tuple[Op, ...] = (
    # ops that need a whole dimension
    _op(["reshape"], ["reshape"], [W, L], [P]),
    _op(["sort"], ["sort"], [W, T, R, F], [T]),
    _op(["argsort"], ["sort"], [W, T], [T]),
    _op(["top_k"], ["topk"], [W, T, R, F]),
    _op(["cumsum"], ["reduce-window"], [W, T, R, F, U], [T]),
    _op(["cumprod"], ["reduce-window"], [W, T, R, U], [T]),
    _op(["cummax"], ["reduce-window"], [W, T, R, U], [T]),
    _op(["cummin"], ["reduce-window"], [W, T, R, U], [T]),
    _op(["cumlogsumexp"], ["reduce-window"], [W, T, U], [T]),
    _op(["reduce_window", "reduce_window_sum", "reduce_window_max"], ["reduce-window"], [W, T, U], [T, F, U]),
    _op(["scatter"], ["scatter"], [W, T, R, F], [T]),
    _op(["scatter-add"], ["scatter"], [W, T, R, F], [T]),
    _op(["scatter_add"], ["scatter"], [W, T, R], [T]),
    _op(["scatter-mul", "scatter-min", "scatter-max"], ["scatter"], [W, T], [T]),
    _op(["segment_sum"], ["scatter"], [W, T], [T]),
    _op(["gather"], ["gather"], [W, R, F]),
    _op(["dynamic_slice"], ["dynamic-slice"], [W], [P]),
    _op(["dynamic_update_slice"], ["dynamic-update-slice"], [W]),
    _op(["custom_call", "pallas_call"], ["custom-call"], [W]),
    _op(["ragged_dot", "ragged_dot_general"], ["ragged-dot"], [W]),
    # other routing ops and the matmul a routed finding may name
    _op(["argmax", "argmin"], ["reduce"], [R]),
    _op(["dot_general"], ["dot"], [F]),
    # ops that move or re-lay a value
    _op(["convert_element_type"], ["convert"], [L, S], [P]),
    _op(["copy", "copy_p"], ["copy"], [L, S], [P]),
    _op(["sharding_constraint", "reshard", "mesh_cast"], [], [L, S]),
    _op(["transpose"], ["transpose"], [L], [P]),
    _op(["squeeze", "expand_dims"], ["reshape"], [L]),
    _op(["broadcast_in_dim"], ["broadcast"], [], [P]),
    _op(["slice"], ["slice"], [], [P]),
    _op(["all_gather"], ["all-gather"], [C], [P]),
    _op([], ["bitcast", "get-tuple-element", "parameter"], [], [P]),
    # the other collectives JAX code writes, as XLA labels them (op_name's last part)
    _op(["all_gather_invariant", "pgather"], ["all-gather"], [C]),
    _op(["all_to_all"], ["all-to-all"], [C]),
    _op(["ragged_all_to_all"], ["ragged-all-to-all"], [C]),
    _op(["ppermute"], ["collective-permute"], [C]),
    _op(["psum", "pmax", "pmin"], ["all-reduce"], [C]),
    _op(["psum_scatter", "reduce_scatter"], ["reduce-scatter"], [C]),
    _op(["pbroadcast"], ["collective-broadcast"], [C]),
)


def primitives(role: Role) -> frozenset[str]:
    """The JAX names of the ops that have `role` under them."""
    return frozenset(name for op in OPS if role in op.roles for name in op.jax)


def opcodes(role: Role) -> frozenset[str]:
    """The HLO opcodes of the ops that have `role` under them."""
    return frozenset(name for op in OPS if role in op.hlo_roles for name in op.hlo)


def lowered_to(primitive: str) -> frozenset[str]:
    """The HLO opcodes a JAX primitive lowers to (`scatter-add` -> `scatter`), as listed here;
    for a primitive not listed, its name with '-' for '_' (`reduce_precision`)."""
    found = frozenset(name for op in OPS if primitive in op.jax for name in op.hlo)
    return found or frozenset({primitive.replace("_", "-")})


NEEDS_WHOLE = primitives(Role.WHOLE)
TOKEN_PRIMITIVES = primitives(Role.TOKENS)
TOKEN_OPCODES = opcodes(Role.TOKENS)
JAXPR_LAYOUT = primitives(Role.LAYOUT)
SAME_DIMS = primitives(Role.SAME_DIMS)
WEIGHT_PATH_OPCODES = opcodes(Role.WEIGHT_PATH)
# For the rewrites: the jaxpr routing ops (run per shard where XLA would gather their
# inputs, `rewrites/plan/_grow.py`) and the ops a routed finding names (`rewrites/trace/_lost.py`, in
# the spelling findings use: a cumulative op detected in HLO without a JAX name is
# "reduce-window"; JAX 0.12 often names the matmul that feeds top_k instead of top_k).
ROUTING_PRIMITIVES = primitives(Role.ROUTING)
ROUTING_FINDING_OPS = primitives(Role.ROUTING_FINDING) | opcodes(Role.ROUTING_FINDING)
WRITTEN_COLLECTIVES = primitives(Role.WRITTEN)
# What a finding may name for a running total over tokens (XLA:CPU lowers a cumsum to a
# reduce-window and JAX 0.10 labels it `reduce_window_sum`), and the ops the rewrite runs per
# shard where a finding names them (`analyzer/explain/_wayout.py`'s `rewrite_reaches`).
CUMULATIVE = primitives(Role.CUMULATIVE) | opcodes(Role.CUMULATIVE)
# The running totals `jax.lax.cum*` bind in a jaxpr (not `reduce_window`, which pools).
CUMULATIVE_PRIMITIVES = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
PER_SHARD_OPS = ROUTING_PRIMITIVES | CUMULATIVE
