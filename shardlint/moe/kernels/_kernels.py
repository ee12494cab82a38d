"""The grouped-matmul kernels of a SwiGLU on a TPU, in Pallas, over tile-aligned groups.

On a TPU `jax.lax.ragged_dot` runs at about half the FLOP/s of a dense product of the same
size, and megablox's `gmm` gains little at its best tiles (measured on a v5e, see
`benchmarks/README.md`): a tile whose rows straddle two groups is computed once per group
and masked. Here the rows come in a layout where every group starts on a tile boundary
(`_permute.padded_layout`: each group padded to whole tiles of `tm` rows, padding rows
zero), so every row tile belongs to one group, no tile is computed twice and no product
is masked. The grid runs over "visits" (`grid.visits`): the tiles of one block of `bm` rows
that belong to one group, so a group's rows go through the matrix unit in runs of up to
`bm` rows while a group pads to tiles of `tm` (on a v5e, 128-row tiles in 512-row blocks
made RoutedMoE's training step 26.69 -> 25.46 ms against 256-row tiles one per step; see
`_plan.plan`). Five kernels make the product and its gradients (`_gmm.tiled_swiglu` composes them):

  up          h0 = x @ wi_0[g], h1 = x @ wi_1[g], h = silu(h0) * h1, one pass over x
  gmm         y = h @ wo[g], tile by tile
  down_grad   dh = dy @ wo[g]^T, then dh0, dh1 through silu, one pass
  up_grad     dx = dh0 @ wi_0[g]^T + dh1 @ wi_1[g]^T, one pass
  tgmm        dw[g] = x[tiles of g]^T @ dy[tiles of g], accumulated over the consecutive
              visits of a group (every group owns at least one tile: every block written);
              its visits are runs of up to `nsub` tiles from each group's first tile
              (`grid.chunks`), so that a group has one short run, not two

(benchmarks/README.md names them as they were named before they had a module of their
own: `_up`, `_gmm`, `_down_grad`, `_up_grad`, `_tgmm`.) Fusing the SwiGLU's elementwise
work and the two input gradients into the products pays on the v5e: nine unfused products
at tm=256 took 24.3 ms one by one, the fused forward and backward 17.4 ms (142 TF/s); the
[rows, F] intermediates are written and read once fewer, and the two [rows, D] input
gradients are never written apart.

Only the tiles in use run (the grid's row dimension is the traced visit count). Rows of
the result past the last used tile hold whatever the kernels left there; callers never
read them. In interpret mode the kernels run on one device's values at a time
(`grid.launch`). The pallas_calls' names carry "gmm" so that the analyzer's
grouped-matmul pattern (`analyzer._patterns`) recognises them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import _compat
from . import _grid as grid
from ._plan import Plan


def silu_parts(h0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """silu(h0) and its derivative, in float32. The sigmoid as 0.5 tanh(h0 / 2) + 0.5, one
    transcendental and no division: on a v5e `up` 4.27 -> 4.21 ms and `down_grad` 2.98
    -> 2.89 ms alone against 1 / (1 + exp(-h0)) (`benchmarks/tpu_gmm_probe.py`, E=64)."""
    sig = 0.5 * jnp.tanh(0.5 * h0) + 0.5
    return h0 * sig, sig * (1.0 + h0 * (1.0 - sig))


def gmm(x_PK: jax.Array, w_GAB: jax.Array, tile_group_I: jax.Array,
         num_tiles: jax.Array, p: Plan, *, transpose_rhs: bool,
         lanes: int | None = None) -> jax.Array:
    """y_PN = x_PK @ w[g] (or @ w[g]^T with `transpose_rhs`) for the rows of each tile,
    g being the tile's group; with `lanes`, as [P, N / lanes, lanes] (`grid.store`)."""
    P, K = x_PK.shape
    N = w_GAB.shape[1] if transpose_rhs else w_GAB.shape[2]
    t = p.tiles(K, N, x_PK.dtype.itemsize, lanes=lanes)
    k_steps = K // t.k
    dims = grid.NT if transpose_rhs else grid.NN

    def kernel(meta_ref, x_ref, w_ref, o_ref, *acc, V):
        k = pl.program_id(2)

        def body(rows, lead, tail):
            prod = jax.lax.dot_general(x_ref[rows, :], w_ref[...], dims,
                                       preferred_element_type=jnp.float32)
            if k_steps == 1:
                grid.store(o_ref, rows, prod, lanes)
                return

            @pl.when(k == 0)
            def _():
                acc[0][rows, :] = prod

            @pl.when(k > 0)
            def _():
                acc[0][rows, :] += prod

            @pl.when(k == k_steps - 1)
            def _():
                grid.store(o_ref, rows, acc[0][rows, :], lanes)
        grid.each_visit(p, meta_ref, pl.program_id(1), V, body)

    specs = lambda V: grid.row_specs(t, 1, True) + grid.weight_specs(t, V, 1, transpose_rhs)
    return grid.call(kernel, "shardlint_gmm_t" if transpose_rhs else "shardlint_gmm", t, K,
                     N, p, tile_group_I, num_tiles, specs,
                     [grid.rows_struct(P, N, x_PK.dtype, lanes)], 1, [x_PK, w_GAB], lanes)[0]


def up(x_PD, wi_0_GDF, wi_1_GDF, tile_group_I, num_tiles, p: Plan):
    """h0 = x @ wi_0[g], h1 = x @ wi_1[g] and h = silu(h0) * h1 in one pass over x (each
    rounded to x's dtype as the unfused products would be)."""
    P, D = x_PD.shape
    F = wi_0_GDF.shape[2]
    t = p.tiles(D, F, x_PD.dtype.itemsize, rhs=2, outs=3, split_k=False)

    def kernel(meta_ref, x_ref, w0_ref, w1_ref, h0_ref, h1_ref, h_ref, V):
        def body(rows, lead, tail):
            x = x_ref[rows, :]
            h0 = jax.lax.dot_general(x, w0_ref[...], grid.NN, preferred_element_type=jnp.float32)
            h1 = jax.lax.dot_general(x, w1_ref[...], grid.NN, preferred_element_type=jnp.float32)
            h0 = h0.astype(h0_ref.dtype)
            h1 = h1.astype(h1_ref.dtype)
            h0_ref[rows, :], h1_ref[rows, :] = h0, h1
            silu, _ = silu_parts(h0.astype(jnp.float32))
            h_ref[rows, :] = (silu.astype(h_ref.dtype).astype(jnp.float32)
                              * h1.astype(jnp.float32)).astype(h_ref.dtype)
        grid.each_visit(p, meta_ref, pl.program_id(1), V, body)

    out = jax.ShapeDtypeStruct((P, F), x_PD.dtype)
    return grid.call(kernel, "shardlint_gmm_up", t, D, F, p, tile_group_I, num_tiles,
                     lambda V: grid.row_specs(t, 1, True) + grid.weight_specs(t, V, 2, False),
                     [out] * 3, 2, [x_PD, wi_0_GDF, wi_1_GDF])


def down_grad(dy_PD, wo_GFD, h0_PF, h1_PF, tile_group_I, num_tiles, p: Plan,
               scale_P1=None):
    """dh = dy @ wo[g]^T (times each row's `scale_P1` when given; rounded to dy's dtype),
    then through h = silu(h0) * h1: dh0 = dh * h1 * silu'(h0), dh1 = dh * silu(h0). Reads
    dy's first D columns (wo's D): dy may carry more."""
    P = dy_PD.shape[0]
    F, D = wo_GFD.shape[1:]
    t = p.tiles(D, F, dy_PD.dtype.itemsize, outs=4, split_k=False)
    scaled = scale_P1 is not None

    def kernel(meta_ref, dy_ref, w_ref, h0_ref, h1_ref, *refs, V):
        *scale_ref, dh0_ref, dh1_ref = refs

        def body(rows, lead, tail):
            dh = jax.lax.dot_general(dy_ref[rows, :], w_ref[...], grid.NT,
                                     preferred_element_type=jnp.float32)
            if scaled:
                dh = dh * scale_ref[0][rows, :]
            dh = dh.astype(dh0_ref.dtype).astype(jnp.float32)
            silu, dsilu = silu_parts(h0_ref[rows, :].astype(jnp.float32))
            silu = silu.astype(dh1_ref.dtype).astype(jnp.float32)
            dh1_ref[rows, :] = (dh * silu).astype(dh1_ref.dtype)
            dsilu_in = (dh * h1_ref[rows, :].astype(jnp.float32)).astype(dh0_ref.dtype)
            dh0_ref[rows, :] = (dsilu_in.astype(jnp.float32) * dsilu).astype(dh0_ref.dtype)
        grid.each_visit(p, meta_ref, pl.program_id(1), V, body)

    out = jax.ShapeDtypeStruct((P, F), dy_PD.dtype)
    return grid.call(kernel, "shardlint_gmm_down_grad", t, D, F, p, tile_group_I, num_tiles,
                     lambda V: grid.row_specs(t, 1, True) + grid.weight_specs(t, V, 1, True)
                     + grid.row_specs(t, 2, False) + grid.scale_specs(t, scaled), [out] * 2,
                     1, [dy_PD, wo_GFD, h0_PF, h1_PF] + ([scale_P1] if scaled else []))


def up_grad(dh0_PF, dh1_PF, wi_0_GDF, wi_1_GDF, tile_group_I, num_tiles, p: Plan,
             lanes: int | None = None):
    """dx = dh0 @ wi_0[g]^T + dh1 @ wi_1[g]^T (summed in float32); with `lanes`, as
    [P, D / lanes, lanes] (`grid.store`)."""
    P, F = dh0_PF.shape
    D = wi_0_GDF.shape[1]
    t = p.tiles(F, D, dh0_PF.dtype.itemsize, lhs=2, rhs=2, split_k=False, lanes=lanes)

    def kernel(meta_ref, a_ref, b_ref, w0_ref, w1_ref, dx_ref, V):
        def body(rows, lead, tail):
            dx = jax.lax.dot_general(a_ref[rows, :], w0_ref[...], grid.NT,
                                     preferred_element_type=jnp.float32)
            dx += jax.lax.dot_general(b_ref[rows, :], w1_ref[...], grid.NT,
                                      preferred_element_type=jnp.float32)
            grid.store(dx_ref, rows, dx, lanes)
        grid.each_visit(p, meta_ref, pl.program_id(1), V, body)

    out = grid.rows_struct(P, D, dh0_PF.dtype, lanes)
    return grid.call(kernel, "shardlint_gmm_up_grad", t, F, D, p, tile_group_I, num_tiles,
                     lambda V: grid.row_specs(t, 2, True) + grid.weight_specs(t, V, 2, True),
                     [out], 2, [dh0_PF, dh1_PF, wi_0_GDF, wi_1_GDF], lanes)[0]


def tgmm(x_PK: jax.Array, dy_PN: jax.Array, tile_group_I: jax.Array,
          num_tiles: jax.Array, num_groups: int, p: Plan, out_dtype,
          scale_P1: jax.Array | None = None, n: int | None = None) -> jax.Array:
    """dw_GKN[g] = sum over the tiles of group g of x_tile^T @ dy_tile (x's rows times
    `scale_P1`, rounded to x's dtype, when given), over dy's first `n` columns (all when
    None): accumulated over the consecutive visits of a group, its last product added as
    dw[g] is stored (not into the [K, N] float32 accumulator, read back to store it). On a
    v5e that made the SwiGLU forward+backward 17.06 / 17.19 -> 16.84 / 16.92 ms, two pairs
    of runs alternated in one call (`benchmarks/tpu_moe.py --part kernels`, E=64); each
    `tgmm` alone moved within the runs' spread (2.44 -> 2.42 and 2.48 -> 2.56 ms)."""
    P, K = x_PK.shape
    N = dy_PN.shape[1] if n is None else n
    V = tile_group_I.shape[0]
    chunked = p.tgmm_chunk > 0 and V >= p.tgmm_chunk
    if chunked:
        p = dataclasses.replace(p, nsub=p.tgmm_chunk)
    t = p.tgmm_tiles(K, N, x_PK.dtype.itemsize)
    scaled = scale_P1 is not None
    if chunked:   # rows from an element offset: tile meta[v] (`grid.chunks`)
        rows = lambda cols, c: pl.BlockSpec(
            (pl.Element(t.m), pl.Element(cols)),
            lambda kb, nb, v, meta: (meta[v] * p.tm, c(kb, nb) * cols))
    else:
        rows = lambda cols, c: pl.BlockSpec(
            (t.m, cols), lambda kb, nb, v, meta: (meta[v], c(kb, nb)))

    def kernel(meta_ref, x_ref, dy_ref, *refs):
        *scale_ref, o_ref, acc_ref = refs
        v, last = pl.program_id(2), pl.num_programs(2) - 1
        g = meta_ref[V + v]
        first = jnp.logical_or(v == 0, meta_ref[V + jnp.maximum(v - 1, 0)] != g)
        final = jnp.logical_or(v == last, meta_ref[V + jnp.minimum(v + 1, last)] != g)

        def body(rows, lead, tail):
            x = x_ref[rows, :]
            if scaled:
                x = (x.astype(jnp.float32) * scale_ref[0][rows, :]).astype(x.dtype)
            prod = jax.lax.dot_general(x, dy_ref[rows, :], (((0,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)
            start, end = first & lead, final & tail

            @pl.when(start & end)
            def _():
                o_ref[...] = prod.astype(o_ref.dtype)

            @pl.when(start & ~end)
            def _():
                acc_ref[...] = prod

            @pl.when(~start & end)
            def _():
                o_ref[...] = (acc_ref[...] + prod).astype(o_ref.dtype)

            @pl.when(~start & ~end)
            def _():
                acc_ref[...] += prod
        grid.each_visit(p, meta_ref, v, V, body)

    def call(meta, num_visits, x_PK, *operands):
        return pl.pallas_call(
            kernel,
            out_shape=_compat.out_struct((num_groups, K, N), out_dtype, x_PK, *operands),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(K // t.k, N // t.n, num_visits),
                in_specs=[rows(t.k, lambda kb, nb: kb), rows(t.n, lambda kb, nb: nb)]
                         + ([rows(1, lambda kb, nb: 0)] if scaled else []),
                out_specs=pl.BlockSpec((None, t.k, t.n),
                                       lambda kb, nb, v, meta: (meta[V + v], kb, nb)),
                scratch_shapes=[pltpu.VMEM((t.k, t.n), jnp.float32)]),
            compiler_params=grid.params(p, ("parallel", "parallel", "arbitrary")),
            interpret=p.interpret,
            cost_estimate=grid.cost(K, P, N, x_PK.dtype.itemsize),
            name="shardlint_tgmm",
        )(meta, x_PK, *operands)
    return grid.launch(p, call, tile_group_I, num_tiles,
                   [x_PK, dy_PN, *([scale_P1] if scaled else [])],
                   grid.chunks if chunked else grid.visits)
