"""Grouped matmul on a TPU: a SwiGLU's Pallas kernels (`_kernels`) as custom VJPs.

`tiled_swiglu` is the SwiGLU over rows laid out in tile-aligned groups (`_permute`), rows in
and out in [P, D], for `grouped_swiglu`'s callers. `tiled_experts` is the layer's sort,
this SwiGLU and each token's weighted sum of its K rows, one VJP: the down projection and
the input gradient write the slots' rows as whole tiles of the chip's memory ([P, D / 128,
128], `_grid.store`), which `_gather` copies back to the tokens by DMA (XLA's gathers
of them took 2.6 ms each, gather and reduce, in ShardedRoutedMoE's step on a v5e; the
kernel 0.96 and 0.87 ms); its backward pass hands `down_grad` and the output's `tgmm` the
rows of g with each row's weight, and they scale the rows as they load them.

Inside `shard_map` the kernels take values that vary over its axes (cast alike first, so
that the custom VJPs return each gradient typed as its input). Which kernel runs, and at
which tiles, is chosen per call (`_plan`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from . import _gather, _kernels as kernels, _permute
from ._plan import Plan


# ---------------------------------------------------------------- the SwiGLU


def tiled_swiglu(x_PD: jax.Array, wi_0_GDF: jax.Array, wi_1_GDF: jax.Array,
                 wo_GFD: jax.Array, tile_group_I: jax.Array, num_tiles: jax.Array,
                 p: Plan) -> jax.Array:
    """Each row tile's group's SwiGLU, silu(x @ wi_0[g]) * (x @ wi_1[g]) @ wo[g], for the
    first `num_tiles` tiles of `p.tm` rows (a 0-d int32); later rows are unwritten.

    Five kernels: the two up-projections and silu in one pass (`up`), the down
    projection; backward, the down projection's input gradient through silu in one pass
    (`down_grad`), both up-projections' input gradients summed in one pass (`up_grad`),
    and the three weight gradients (`tgmm`)."""
    return _swiglu(*_compat.vary_alike(x_PD, wi_0_GDF, wi_1_GDF, wo_GFD, tile_group_I,
                                       num_tiles), p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _swiglu(x_PD, wi_0_GDF, wi_1_GDF, wo_GFD, tile_group_I, num_tiles, p):
    return _swiglu_fwd(x_PD, wi_0_GDF, wi_1_GDF, wo_GFD, tile_group_I, num_tiles, p)[0]


def _swiglu_fwd(x_PD, wi_0_GDF, wi_1_GDF, wo_GFD, tile_group_I, num_tiles, p, lanes=None):
    h0_PF, h1_PF, h_PF = kernels.up(x_PD, wi_0_GDF, wi_1_GDF, tile_group_I, num_tiles, p)
    y_PD = kernels.gmm(h_PF, wo_GFD, tile_group_I, num_tiles, p, transpose_rhs=False, lanes=lanes)
    return y_PD, (x_PD, wi_0_GDF, wi_1_GDF, wo_GFD, h0_PF, h1_PF, h_PF, tile_group_I,
                  num_tiles)


def _swiglu_grads(p, residuals, dy_PX, scale_P1=None, lanes=None):
    """The SwiGLU's gradients for output cotangent dy (the first D columns of dy_PX; the
    kernels read them in place), or for dy's rows times `scale_P1` ([P, 1] float32),
    applied inside the kernels that read dy; with `lanes`, x's as [P, D / lanes, lanes]."""
    x_PD, wi_0_GDF, wi_1_GDF, wo_GFD, h0_PF, h1_PF, h_PF, tile_group_I, num_tiles = residuals
    meta = (tile_group_I, num_tiles)
    G, _, D = wo_GFD.shape
    dy_PX = dy_PX.astype(x_PD.dtype)
    dwo = kernels.tgmm(h_PF, dy_PX, *meta, G, p, wo_GFD.dtype, scale_P1, n=D)
    dh0_PF, dh1_PF = kernels.down_grad(dy_PX, wo_GFD, h0_PF, h1_PF, *meta, p, scale_P1)
    dx_PD = kernels.up_grad(dh0_PF, dh1_PF, wi_0_GDF, wi_1_GDF, *meta, p, lanes)
    dwi_0 = kernels.tgmm(x_PD, dh0_PF, *meta, G, p, wi_0_GDF.dtype)
    dwi_1 = kernels.tgmm(x_PD, dh1_PF, *meta, G, p, wi_1_GDF.dtype)
    return (dx_PD, dwi_0, dwi_1, dwo, np.zeros(tile_group_I.shape, jax.dtypes.float0),
            np.zeros(num_tiles.shape, jax.dtypes.float0))


_swiglu.defvjp(_swiglu_fwd, _swiglu_grads)


# ---------------------------------------------------------------- sort, SwiGLU, combine


def tiled_experts(x_TD: jax.Array, wi_0_GDF: jax.Array, wi_1_GDF: jax.Array,
                  wo_GFD: jax.Array, layout: _permute.PaddedLayout, runs: _gather.Runs,
                  weights_TK: jax.Array, p: Plan) -> jax.Array:
    """Each token's K choices through their experts' SwiGLU, combined by weight:
    y_TD[t] = sum over k of weights_TK[t, k] * swiglu_g(x_TD[t]), g its k-th expert, the
    rows in `layout` (`_permute.padded_layout` of the T * K choices, token-major) and
    `runs` (`_gather.runs` of its slots).

    One VJP for the sort, the SwiGLU and the combine, so that the rows of the P slots are
    read back by `_gather.gather_sum` both ways: the kernels that write them (the down
    projection forward, the input gradient backward) write each row as whole tiles of
    the chip's memory, [P, D / L, L], which only this VJP's own parts read. The rows of x
    reach the slots by a gather out of the T tokens (fast: `_permute`), and the backward
    pass needs no [P, D] pass of its own: the rows of g reach the slots by one gather
    with their weights (`_permute.rows_and_weights`), and the kernels that read them
    (`down_grad`, `tgmm`) scale each row by its weight as they load it; scaling them in
    a pass over all P slots took 1.03 ms of RoutedMoE's training step on a v5e
    (`benchmarks/tpu_moe_profile.py`). The weights' gradient comes from the rows the
    forward pass gathered. Its parts carry the layer's scopes, moe/sort, moe/experts and
    moe/combine."""
    return _experts_vjp(*_compat.vary_alike(x_TD, wi_0_GDF, wi_1_GDF, wo_GFD,
                                            layout.tile_group_I, layout.num_tiles,
                                            layout.src_P, runs.ranges, runs.row_TK,
                                            weights_TK),
                        (p, runs.tt))


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _experts_vjp(x_TD, wi_0_GDF, wi_1_GDF, wo_GFD, tile_group_I, num_tiles, src_P, ranges,
                 row_TK, weights_TK, static):
    return _experts_fwd(x_TD, wi_0_GDF, wi_1_GDF, wo_GFD, tile_group_I, num_tiles, src_P,
                        ranges, row_TK, weights_TK, static)[0]


def _experts_fwd(x_TD, wi_0_GDF, wi_1_GDF, wo_GFD, tile_group_I, num_tiles, src_P, ranges,
                 row_TK, weights_TK, static):
    p, tt = static
    T, K = weights_TK.shape
    D = x_TD.shape[1]
    runs = _gather.Runs(ranges, row_TK, tt)
    with jax.named_scope("moe/sort"):
        x_PD = _permute.take_or_zero(x_TD, src_P // K)
    with jax.named_scope("moe/experts"):
        y_PCL, swiglu_res = _swiglu_fwd(x_PD, wi_0_GDF, wi_1_GDF, wo_GFD, tile_group_I,
                                        num_tiles, p, lanes=_gather.lanes(D))
    with jax.named_scope("moe/combine"):
        y_TCL, y_TKCL = _gather.gather_sum(y_PCL, runs, weights_TK, T, K, with_rows=True,
                                           interpret=p.interpret, vmem_limit=p.vmem_limit)
        y_TD = y_TCL.reshape(T, D)
    return y_TD, (swiglu_res, y_TKCL, src_P, ranges, row_TK, weights_TK)


def _experts_bwd(static, residuals, g_TD):
    p, tt = static
    swiglu_res, y_TKCL, src_P, ranges, row_TK, weights_TK = residuals
    T, K = weights_TK.shape
    D = g_TD.shape[1]
    runs = _gather.Runs(ranges, row_TK, tt)
    with jax.named_scope("moe/combine"):
        g_PX, w_P = _permute.rows_and_weights(g_TD, weights_TK, src_P)
        dots_TK = _gather.rows_dot(y_TKCL, g_TD.reshape(T, *y_TKCL.shape[1:]), K,
                                   interpret=p.interpret, vmem_limit=p.vmem_limit)
        dw_TK = jnp.where((row_TK[:T * K] >= 0).reshape(T, K), dots_TK, 0)
    with jax.named_scope("moe/experts"):
        dx_PCL, dwi_0, dwi_1, dwo, *zeros = _swiglu_grads(p, swiglu_res, g_PX, w_P[:, None],
                                                          lanes=_gather.lanes(D))
    with jax.named_scope("moe/sort"):
        dx_TD = _gather.gather_sum(dx_PCL, runs, None, T, K, with_rows=False,
                                   interpret=p.interpret,
                                   vmem_limit=p.vmem_limit).reshape(T, D)
    ints = (swiglu_res[7], swiglu_res[8], src_P, ranges, row_TK)
    return (dx_TD, dwi_0, dwi_1, dwo, *(np.zeros(a.shape, jax.dtypes.float0) for a in ints),
            dw_TK.astype(weights_TK.dtype))


_experts_vjp.defvjp(_experts_fwd, _experts_bwd)
