"""Expert computation shared by the reference and the sharded layer.

Everything here works on one block of tokens `x_TD` (the whole flattened batch in the
reference, one shard's block inside `shard_map` in the sharded layer):

  sparse (dropless)  `grouped_swiglu`: sort rows by expert, three `jax.lax.ragged_dot`
                     grouped matmuls, unsort. Rows whose group id equals `num_groups`
                     are padding: they sort last, belong to no group and come out zero,
                     which is how expert parallelism hands in fixed-size buckets. On a
                     TPU (bfloat16, weights whole on the device) the rows go instead to
                     tile-aligned groups without a sort and through the Pallas kernels of
                     `_gmm`, moved by gathers both ways (`_permute`): `ragged_dot` ran at
                     half a dense product's FLOP/s there, and the transposes of the sort's
                     gather and of the unsort's scatter were scatters.
  dense (capacity)   `dense_dispatch` -> `batched_swiglu` -> `dense_combine`: one-hot
                     dispatch/combine masks and expert-batched einsums, split in three so
                     the sharded layer can put an all-to-all between them.

`moe_tokens` strings route + experts + combine together for the cases that need no
communication in the middle; the reference calls it on all tokens, the sharded layer on
its local block.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat, kernels
from ._config import MoeConfig
from ._ring import IN_PLACE, WeightSlices, matmul
from ._routing import route

Params = dict[str, Any]


@functools.partial(jax.jit, static_argnums=1)
def init_moe_params(key: jax.Array, cfg: MoeConfig) -> Params:
    """Router kernel `gate` [D, E] and SwiGLU experts `wi_0`, `wi_1` [E, D, F], `wo` [E, F, D].

    Normal, scaled by 1/sqrt(fan-in). Jitted: eager random numbers cost seconds per shape.
    """
    D, F, E = cfg.emb_dim, cfg.mlp_dim, cfg.num_experts
    return normal_params(key, {"gate": ((D, E), D), "wi_0": ((E, D, F), D),
                               "wi_1": ((E, D, F), D), "wo": ((E, F, D), F)}, cfg.dtype)


def normal_params(key: jax.Array, shapes: dict[str, tuple[tuple[int, ...], int]],
                  dtype: Any) -> Params:
    """{name: normal(shape) / sqrt(fan_in)} drawn as one flat vector (one random kernel
    to compile instead of one per shape, which is most of an init's time on CPU)."""
    sizes = [math.prod(shape) for shape, _ in shapes.values()]
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    out, start = {}, 0
    for (name, (shape, fan_in)), size in zip(shapes.items(), sizes):
        out[name] = (flat[start:start + size].reshape(shape) * fan_in ** -0.5).astype(dtype)
        start += size
    return out


def swiglu(x_TD: jax.Array, wi_0_DF: jax.Array, wi_1_DF: jax.Array,
           wo_FD: jax.Array, *, slices: WeightSlices = IN_PLACE) -> jax.Array:
    """A dense SwiGLU MLP over the last dimension (any leading dimensions); `slices`: as
    in `grouped_swiglu`."""
    h0, h1 = slices.contract(matmul, x_TD, (wi_0_DF, wi_1_DF))
    return slices.expand(matmul, jax.nn.silu(h0) * h1, wo_FD)


def grouped_swiglu(x_ND: jax.Array, group_M: jax.Array, num_groups: int,
                   wi_0_GDF: jax.Array, wi_1_GDF: jax.Array, wo_GFD: jax.Array, *,
                   source_M: jax.Array | None = None, repeat: int = 1,
                   slices: WeightSlices = IN_PLACE) -> jax.Array:
    """Row m of the result is expert `group_M[m]`'s SwiGLU of x_ND[source_M[m]].

    source_M defaults to row m // repeat of x_ND (each row of x_ND feeding `repeat`
    consecutive rows: a token's K choices). A group id of `num_groups` marks a padding
    row; its result is zero. Returns y_MD in the original row order. `slices`: the
    weights hold this device's slice of D, and come whole as it says (`_ring`).
    """
    M = group_M.shape[0]
    plan = kernels.plan(M, (wi_0_GDF.shape[-2], wi_0_GDF.shape[-1]), num_groups,
                          x_ND.dtype, weights_whole=slices.size == 1)
    if plan is not None:
        return _tiled_swiglu(x_ND, group_M, num_groups, wi_0_GDF, wi_1_GDF, wo_GFD,
                             source_M, repeat, plan)
    if source_M is None and repeat > 1:
        source_M = jnp.arange(M) // repeat
    with jax.named_scope("moe/sort"):
        order_M = _compat.argsort(group_M)
        src_M = order_M if source_M is None else source_M[order_M]
        x_MD = x_ND[src_M]
        sizes_G = jnp.zeros((num_groups,), jnp.int32).at[group_M].add(1, mode="drop")
    with jax.named_scope("moe/experts"):
        h0_MF, h1_MF = slices.contract(_grouped, x_MD, (wi_0_GDF, wi_1_GDF), (sizes_G,))
        y_MD = slices.expand(_grouped, jax.nn.silu(h0_MF) * h1_MF, wo_GFD, (sizes_G,))
        valid_M = jnp.arange(M) < jnp.sum(sizes_G)
        y_MD = jnp.where(valid_M[:, None], y_MD, jnp.zeros_like(y_MD))
    with jax.named_scope("moe/unsort"):
        return jnp.zeros_like(y_MD).at[order_M].set(y_MD, unique_indices=True)


def _tiled_swiglu(x_ND, group_M, num_groups, wi_0_GDF, wi_1_GDF, wo_GFD, source_M,
                  repeat, plan: kernels.Plan) -> jax.Array:
    """`grouped_swiglu` through the Pallas kernels: rows to tile-aligned groups by gathers
    (`_permute`), the grouped SwiGLU (`_gmm`), rows back by a gather."""
    if source_M is not None:   # any map of rows: gathered first (its transpose scatters)
        x_ND, repeat = x_ND[source_M], 1
    layout, x_PD = _tiled_layout(x_ND, group_M, num_groups, repeat, plan)
    with jax.named_scope("moe/experts"):
        y_PD = kernels.tiled_swiglu(x_PD, wi_0_GDF, wi_1_GDF, wo_GFD, layout.tile_group_I,
                                 layout.num_tiles, plan)
    with jax.named_scope("moe/unsort"):
        return kernels.permute_rows(y_PD, layout.pos_M, layout.src_P[:, None])


def _tiled_layout(x_ND, group_M, num_groups, repeat, plan: kernels.Plan):
    """The layout of rows `group_M` and its slots' rows of x (row m reading x_ND's row
    m // repeat)."""
    M = group_M.shape[0]
    with jax.named_scope("moe/sort"):
        layout = kernels.padded_layout(group_M, num_groups, plan.tm, plan.bm)
        x_PD = kernels.permute_rows(x_ND, layout.src_P // repeat,
                                     layout.pos_M.reshape(M // repeat, repeat))
    return layout, x_PD


def _grouped(x_MK: jax.Array, w: Any, aux: tuple) -> Any:
    """Rows grouped by expert (`aux`: the group sizes) times each group's matrix, for one
    matrix or a tuple of them."""
    (sizes_G,) = aux
    return jax.tree.map(lambda w_GKN: jax.lax.ragged_dot(x_MK, w_GKN, sizes_G), w)


def combine_rows(y_MD: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """Weighted sum of each token's K expert outputs (rows token-major, K per token)."""
    T, K = weights_TK.shape
    with jax.named_scope("moe/combine"):
        y_TKD = y_MD.reshape(T, K, y_MD.shape[-1])
        y_TD = jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weights_TK)
        return y_TD.astype(y_MD.dtype)


def sparse_experts(x_TD: jax.Array, weights_TK: jax.Array, experts_TK: jax.Array,
                   params: Params, num_experts: int, *,
                   slices: WeightSlices = IN_PLACE) -> jax.Array:
    """Dropless routed experts on one token block: sort, grouped matmuls, unsort, combine."""
    T, K = experts_TK.shape
    weights = (params["wi_0"], params["wi_1"], params["wo"])
    plan = kernels.plan(T * K, weights[0].shape[-2:], num_experts, x_TD.dtype,
                          weights_whole=slices.size == 1)
    if plan is not None:
        group_M = experts_TK.reshape(T * K)
        with jax.named_scope("moe/sort"):
            layout = kernels.padded_layout(group_M, num_experts, plan.tm, plan.bm)
            runs = kernels.runs(layout.pos_M.reshape(T, K), experts_TK, num_experts,
                                kernels.token_tile(T, K, x_TD.shape[1] * x_TD.dtype.itemsize,
                                                   plan.interpret, plan.vmem_limit))
        # the sort, the experts and the combine: one VJP (its doc says why), scoped inside
        return kernels.tiled_experts(x_TD, *weights, layout, runs, weights_TK, plan)
    y_MD = grouped_swiglu(x_TD, experts_TK.reshape(T * K), num_experts, *weights,
                          repeat=K, slices=slices)
    return combine_rows(y_MD, weights_TK)


def dense_dispatch(x_TD: jax.Array, weights_TK: jax.Array, experts_TK: jax.Array,
                   num_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """One-hot dispatch into [E, C, D] expert slots and the matching combine mask [T, E, C].

    A token's k-th choice takes the next free slot of its expert; slots are handed out in
    token order, then choice order (MaxText's priority). Choices past `capacity` are
    dropped: no slot, zero weight.
    """
    T, K = experts_TK.shape
    with jax.named_scope("moe/dispatch"):
        mask_TKE = jax.nn.one_hot(experts_TK, num_experts, dtype=jnp.int32)
        slot_ME = jnp.cumsum(mask_TKE.reshape(T * K, num_experts), axis=0) - 1
        slot_TK = jnp.sum(slot_ME.reshape(T, K, num_experts) * mask_TKE, axis=-1)
        slot_TKC = jax.nn.one_hot(slot_TK, capacity, dtype=jnp.float32)  # past C: all zero
        dispatch_TKEC = mask_TKE.astype(jnp.float32)[..., None] * slot_TKC[:, :, None, :]
        dispatch_TEC = jnp.sum(dispatch_TKEC, axis=1)
        combine_TEC = jnp.einsum("tkec,tk->tec", dispatch_TKEC, weights_TK)
        x_ECD = jnp.einsum("tec,td->ecd", dispatch_TEC.astype(x_TD.dtype), x_TD)
        return x_ECD, combine_TEC


def batched_swiglu(x_ECD: jax.Array, wi_0_EDF: jax.Array, wi_1_EDF: jax.Array,
                   wo_EFD: jax.Array, *, slices: WeightSlices = IN_PLACE) -> jax.Array:
    """Every expert's SwiGLU on its own slots (`slices`: as in `grouped_swiglu`)."""
    with jax.named_scope("moe/experts"):
        h0, h1 = slices.contract(_batched, x_ECD, (wi_0_EDF, wi_1_EDF))
        return slices.expand(_batched, jax.nn.silu(h0) * h1, wo_EFD)


def _batched(x_ECK: jax.Array, w: Any, aux: tuple = ()) -> Any:
    """Each expert's slots times its matrix, for one matrix or a tuple of them."""
    return jax.tree.map(lambda w_EKN: jnp.einsum("eck,ekn->ecn", x_ECK, w_EKN), w)


def dense_combine(y_ECD: jax.Array, combine_TEC: jax.Array) -> jax.Array:
    with jax.named_scope("moe/combine"):
        y_TD = jnp.einsum("ecd,tec->td", y_ECD.astype(jnp.float32), combine_TEC)
        return y_TD.astype(y_ECD.dtype)


def dense_experts(x_TD: jax.Array, weights_TK: jax.Array, experts_TK: jax.Array,
                  params: Params, num_experts: int, capacity: int, *,
                  slices: WeightSlices = IN_PLACE) -> jax.Array:
    x_ECD, combine_TEC = dense_dispatch(x_TD, weights_TK, experts_TK, num_experts, capacity)
    y_ECD = batched_swiglu(x_ECD, params["wi_0"], params["wi_1"], params["wo"], slices=slices)
    return dense_combine(y_ECD, combine_TEC)


def moe_tokens(x_TD: jax.Array, params: Params, cfg: MoeConfig, *,
               slices: WeightSlices = IN_PLACE) -> jax.Array:
    """Route one token block and run its experts (no communication but for `slices`).

    With tensor parallelism the expert weights hold a slice of F and the result is this
    slice's partial sum, which the caller reduces.
    """
    weights_TK, experts_TK = route(x_TD, params["gate"], cfg, slices=slices)
    if cfg.strategy == "sparse":
        return sparse_experts(x_TD, weights_TK, experts_TK, params, cfg.num_experts,
                              slices=slices)
    return dense_experts(x_TD, weights_TK, experts_TK, params, cfg.num_experts,
                         cfg.capacity(x_TD.shape[0]), slices=slices)
