"""Token permutation for the Pallas grouped matmul: rows to tile-aligned groups and back.

`padded_layout` puts row m (of group g = group_M[m]) at row `pos_M[m]` of a layout in which
every group starts on a tile of `tm` rows and owns at least one tile; rows no group fills
are padding (zero going in, never read coming out). It needs no sort: a row's rank within
its group is a cumulative count, taken block by block as a product with a triangular
matrix (the TPU's matrix unit does that at once; a cumsum or a sort over all rows is a
long serial pass), plus a cumsum over the blocks' totals. Row m's place and the row in
each padded slot (`src_P`, the inverse) are all the later steps need.

`permute_rows` moves rows by those indices with gathers only, in both directions: the
transpose of a gather is a scatter-add, slow on a TPU and serial over repeated indices;
here the backward pass is the gather by the inverse indices (a row that feeds K slots
sums the K gathered rows). Indices out of range read zeros. Rows are gathered in their
own dtype; the float32 sums and the masks of out-of-range indices come after.

`combine` is the unsort and the weighted sum of each token's K rows in one gather (the
reference the tests hold the layer's path to; that path reads the rows back with
`_gather` inside `_gmm.tiled_experts`, whose backward pass gathers the rows of g to the
slots with their weights by `rows_and_weights`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat

_RANK_BLOCK = 256  # rows per triangular product; counts below it are exact in bfloat16


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("pos_M", "src_P", "tile_group_I", "num_tiles"),
                   meta_fields=("rows",))
@dataclasses.dataclass(frozen=True)
class PaddedLayout:
    """pos_M: row m's padded row (`rows` when its group is the padding group); src_P:
    the row in each padded row (M for padding); tile_group_I: each tile's group;
    num_tiles: the tiles in use (0-d int32)."""
    pos_M: jax.Array
    src_P: jax.Array
    tile_group_I: jax.Array
    num_tiles: jax.Array
    rows: int


def padded_layout(group_M: jax.Array, num_groups: int, tm: int,
                  block: int | None = None) -> PaddedLayout:
    """The tile-aligned layout of rows grouped by `group_M` (values in [0, num_groups];
    `num_groups` marks a padding row, which gets no slot), its rows a whole number of
    `block`s (a multiple of tm; default tm). Stable: rows of a group keep their order."""
    M, G = group_M.shape[0], num_groups
    per_block = (block or tm) // tm
    tiles_max = -(-(-(-M // tm) + G) // per_block) * per_block
    rows = tiles_max * tm
    ids_G = jnp.arange(G, dtype=jnp.int32)
    onehot_MG = (group_M[:, None] == ids_G[None, :])
    sizes_G = jnp.sum(onehot_MG, axis=0, dtype=jnp.int32)
    tiles_G = jnp.maximum(1, (sizes_G + tm - 1) // tm)
    tile_end_G = jnp.cumsum(tiles_G)
    start_G = (tile_end_G - tiles_G) * tm
    tile_I = jnp.arange(tiles_max, dtype=jnp.int32)
    tile_group_I = jnp.minimum(jnp.sum(tile_I[:, None] >= tile_end_G[None, :], axis=1,
                                       dtype=jnp.int32), G - 1)
    rank_M = _rank_in_group(onehot_MG)
    start_M = jnp.sum(jnp.where(onehot_MG, start_G[None, :], 0), axis=1)
    pos_M = jnp.where(group_M < G, start_M + rank_M, rows).astype(jnp.int32)
    src_P = jnp.full((rows,), M, jnp.int32).at[pos_M].set(
        jnp.arange(M, dtype=jnp.int32), mode="drop", unique_indices=True)
    return PaddedLayout(pos_M, src_P, tile_group_I, tile_end_G[-1].astype(jnp.int32), rows)


def _rank_in_group(onehot_MG: jax.Array) -> jax.Array:
    """For each row, how many earlier rows share its group (one-hot rows; none: 0)."""
    M, G = onehot_MG.shape
    B = min(_RANK_BLOCK, M)
    blocks = -(-M // B)
    oh = jnp.pad(onehot_MG, ((0, blocks * B - M), (0, 0))).astype(jnp.float32)
    oh_NBG = oh.reshape(blocks, B, G)
    before_BB = (jnp.arange(B)[:, None] > jnp.arange(B)[None, :]).astype(jnp.float32)
    within_NBG = jnp.einsum("ij,njg->nig", before_BB.astype(jnp.bfloat16),
                            oh_NBG.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    totals_NG = jnp.sum(oh_NBG, axis=1)
    earlier_NG = jnp.cumsum(totals_NG, axis=0) - totals_NG
    count_NBG = within_NBG + earlier_NG[:, None, :]
    rank = jnp.sum(count_NBG * oh_NBG, axis=-1).reshape(blocks * B)[:M]
    return jnp.round(rank).astype(jnp.int32)


def permute_rows(x_ND: jax.Array, idx_P: jax.Array, inverse_NR: jax.Array) -> jax.Array:
    """out[p] = x_ND[idx_P[p]] (zero where idx_P[p] is out of range). `inverse_NR[n]`
    lists the slots that read row n (out of range: none), so that the gradient is
    dx[n] = sum over r of g[inverse_NR[n, r]].

    Inside `shard_map` the three are cast to vary alike first: where the indices vary over
    an axis that x does not (expert parallelism without tokens over the expert axis: each
    device picks its own experts' rows of the same tokens), the gradient varies over it
    too, and a custom VJP must return it typed as x; autodiff turns the cast into the sum
    of the gradient over that axis, which is x's gradient."""
    return _permute_rows(*_compat.vary_alike(x_ND, idx_P, inverse_NR))


@jax.custom_vjp
def _permute_rows(x_ND: jax.Array, idx_P: jax.Array, inverse_NR: jax.Array) -> jax.Array:
    return take_or_zero(x_ND, idx_P)


def _rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x[idx] along the first axis, idx clamped into range (callers mask what it read
    for an index out of range in the float32 math that follows)."""
    return jnp.take(x, idx, axis=0, mode="clip")


def take_or_zero(x_ND: jax.Array, idx: jax.Array) -> jax.Array:
    """x_ND[idx] with zero rows where idx is out of range: a gather from x_ND and one zero
    row. `jnp.take(mode="fill")` masks the gathered rows instead, a pass over all of them
    (1.02 ms of RoutedMoE's step on a v5e, `benchmarks/tpu_moe_profile.py`); the copy of
    x_ND with one more row costs a tenth of that."""
    N = x_ND.shape[0]
    x_ext = jnp.concatenate([x_ND, jnp.zeros((1, *x_ND.shape[1:]), x_ND.dtype)])
    return _rows(x_ext, jnp.where(_in_range(idx, N), idx, N))


def _permute_rows_fwd(x_ND, idx_P, inverse_NR):
    return take_or_zero(x_ND, idx_P), (idx_P, inverse_NR)


def _permute_rows_bwd(residuals, g_PD):
    idx_P, inverse_NR = residuals
    N, R = inverse_NR.shape
    valid_NR = _in_range(inverse_NR, g_PD.shape[0])
    g_NRD = _rows(g_PD, inverse_NR.reshape(N * R)).reshape(N, R, -1)
    if R > 1:
        dx_ND = jnp.sum(jnp.where(valid_NR[..., None], g_NRD.astype(jnp.float32), 0), axis=1)
    else:
        dx_ND = jnp.where(valid_NR, g_NRD[:, 0], 0)
    return (dx_ND.astype(g_PD.dtype), np.zeros(idx_P.shape, jax.dtypes.float0),
            np.zeros(inverse_NR.shape, jax.dtypes.float0))


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def combine(y_PD: jax.Array, pos_TK: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """y_TD[t] = sum over k of weights_TK[t, k] * y_PD[pos_TK[t, k]], summed in float32,
    in y's dtype (a choice whose pos is out of range adds nothing): the unsort and the
    combine in one gather, differentiated by JAX. The layer's Pallas path reads the rows
    back with `_gather.gather_sum` instead (`_gmm.tiled_experts`); tests compare the two."""
    T, K = pos_TK.shape
    y_TKD = _rows(y_PD, pos_TK.reshape(T * K)).reshape(T, K, -1)
    y32_TKD = jnp.where(_in_range(pos_TK, y_PD.shape[0])[..., None],
                        y_TKD.astype(jnp.float32), 0)
    return jnp.sum(y32_TKD * weights_TK[:, :, None], axis=1).astype(y_PD.dtype)


def rows_and_weights(g_TD: jax.Array, weights_TK: jax.Array,
                     src_P: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each slot p of a layout whose src_P[p] is the flat t * K + k of its row (T * K
    for padding): g_TD[t] as the first D columns of g_PX's row p (more columns follow;
    kernels read the D in place, where a slice would copy all P rows), and weights_TK[t, k]
    in float32 (zero for padding; the row of g is then any row). One gather: XLA:TPU's
    gathers cost about the same per index for a row of 2048 values as for one value (on a
    v5e, 0.52 ms for 81920 rows of g, 0.57 ms for 81920 weights), so each token's K
    weights ride along as extra columns of g, their float32 bits in g's dtype."""
    T, K = weights_TK.shape
    D = g_TD.shape[1]
    w32_TK = weights_TK.astype(jnp.float32)
    wide = g_TD.dtype.itemsize >= 4   # float32 and wider hold a float32 exactly
    bits_TKc = (w32_TK.astype(g_TD.dtype)[..., None] if wide
                else jax.lax.bitcast_convert_type(w32_TK, g_TD.dtype))
    c = bits_TKc.shape[-1]
    table = jnp.concatenate([g_TD, bits_TKc.reshape(T, K * c)], axis=1)
    rows_PX = _rows(table, src_P // K)
    bits_PKc = rows_PX[:, D:].reshape(-1, K, c)
    w_PK = (bits_PKc[..., 0].astype(jnp.float32) if wide
            else jax.lax.bitcast_convert_type(bits_PKc, jnp.float32))
    mine_PK = (src_P[:, None] % K == jnp.arange(K)) & _in_range(src_P, T * K)[:, None]
    return rows_PX, jnp.sum(jnp.where(mine_PK, w_PK, 0), axis=1)


def _in_range(idx: jax.Array, n: int) -> jax.Array:
    return (idx >= 0) & (idx < n)
