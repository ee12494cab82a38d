"""The Pallas grouped SwiGLU (`_gmm`) and its token permutation (`_permute`) against
today's path (argsort, `ragged_dot`, scatter), in Pallas interpret mode on the CPU.

On a TPU the layers pick these kernels for bfloat16; here `grouped_kernel("interpret")`
forces them at float32 so that outputs and gradients can be compared at float32
tolerances with the `ragged_dot` path (`grouped_kernel("xla")`, the CPU's own). Sizes
stay tiny: interpret mode runs each grid step as a loop iteration.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paths
from shardlint import moe
from shardlint.moe.layers import _experts
from shardlint.moe.kernels import _gather
from shardlint.moe.kernels import _gmm
from shardlint.moe.kernels import _grid as _gmm_grid
from shardlint.moe.kernels import _kernels as _gmm_kernels
from shardlint.moe.kernels import _plan as _gmm_plan
from shardlint.moe.kernels import _permute


def _groups(seed: int, M: int, G: int, padding: bool) -> jax.Array:
    """Uneven group ids, some groups empty; `padding`: some rows of group G (no group)."""
    key = jax.random.key(seed)
    probs = jnp.array([0.3, 0.0, 0.05] + [0.65 / (G - 3)] * (G - 3))
    g = jax.random.choice(key, G, (M,), p=probs).astype(jnp.int32)
    if padding:
        g = jnp.where(jax.random.bernoulli(jax.random.key(seed + 1), 0.2, (M,)), G, g)
    return g


@pytest.mark.parametrize("tm", [4, 8])
def test_padded_layout_is_tile_aligned_stable_and_inverted(tm):
    M, G = 96, 6
    group_M = _groups(0, M, G, padding=True)
    lay = _permute.padded_layout(group_M, G, tm)
    g, pos, src = map(np.asarray, (group_M, lay.pos_M, lay.src_P))
    tile_group, num_tiles = np.asarray(lay.tile_group_I), int(lay.num_tiles)
    valid = g < G
    assert lay.rows == (-(-M // tm) + G) * tm and src.shape == (lay.rows,)
    assert np.all(pos[~valid] == lay.rows)                       # padding rows: no slot
    assert len(set(pos[valid])) == valid.sum()                   # one slot per row
    assert np.all(tile_group[pos[valid] // tm] == g[valid])      # a tile holds one group
    assert np.all(pos[valid] < num_tiles * tm)
    for group in range(G):                                       # rows keep their order,
        slots = pos[g == group]                                  # packed from the group's
        assert np.all(np.diff(slots) == 1)                       # first tile
        assert len(slots) == 0 or slots[0] % tm == 0
        assert (tile_group[:num_tiles] == group).sum() == max(1, -(-len(slots) // tm))
    assert np.all(np.diff(tile_group[:num_tiles]) >= 0)
    np.testing.assert_array_equal(src[pos[valid]], np.nonzero(valid)[0])
    assert np.sum(src < M) == valid.sum() and np.all(src[src >= M] == M)


def _swiglu_case(dtype=jnp.float32):
    N, R, G, D, F = 24, 2, 5, 16, 32
    ks = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(ks[0], (N, D), dtype)
    w0 = (jax.random.normal(ks[1], (G, D, F)) * D ** -0.5).astype(dtype)
    w1 = (jax.random.normal(ks[2], (G, D, F)) * D ** -0.5).astype(dtype)
    wo = (jax.random.normal(ks[3], (G, F, D)) * F ** -0.5).astype(dtype)
    ct = jax.random.normal(ks[4], (N * R, D), dtype)
    return x, (w0, w1, wo), _groups(4, N * R, G, padding=True), G, R, ct


@pytest.mark.parametrize("source", ["repeat", "source_M"])
def test_grouped_swiglu_pallas_matches_ragged_dot(moe_testlib, source):
    x, w, group_M, G, R, ct = _swiglu_case()
    M = group_M.shape[0]
    kw = dict(repeat=R) if source == "repeat" else dict(source_M=(jnp.arange(M) * 7) % x.shape[0])

    def vjp(kernel):
        with _gmm_plan.grouped_kernel(kernel, row_tile=8):
            y, back = jax.vjp(lambda x, w: _experts.grouped_swiglu(x, group_M, G, *w, **kw), x, w)
            return y, back(ct)
    y, grads = vjp("interpret")
    y_ref, grads_ref = vjp("xla")
    moe_testlib.assert_tree_close((y, grads), (y_ref, grads_ref))
    assert np.all(np.asarray(y)[np.asarray(group_M) == G] == 0)   # padding rows: zero


def test_kernels_with_blocks_split_along_k_and_n(moe_testlib):
    """A VMEM limit that forces K and N into blocks: the accumulating path of `gmm`
    and `tgmm` give the same products."""
    x, (w0, _, _), group_M, G, R, _ = _swiglu_case()
    p = _gmm_plan.Plan(8, interpret=True, vmem_limit=400_000)
    assert p.tiles(256, 256, 4) == p.tgmm_tiles(256, 256, 4) == _gmm_plan.Tiles(8, 128, 128)
    K, N = 256, 256
    xk = jax.random.normal(jax.random.key(5), (x.shape[0] * R, K))
    wk = jax.random.normal(jax.random.key(6), (G, K, N)) / 16
    lay = _permute.padded_layout(group_M, G, 8)
    x_PK = _permute.permute_rows(xk, lay.src_P, lay.pos_M[:, None])
    meta = (lay.tile_group_I, lay.num_tiles)
    sizes = jnp.bincount(group_M, length=G + 1)[:G].astype(jnp.int32)
    order = jnp.argsort(group_M, stable=True)
    y_ref = jax.lax.ragged_dot(xk[order], wk, sizes)
    y = _gmm_kernels.gmm(x_PK, wk, *meta, p, transpose_rhs=False)
    valid = np.asarray(group_M)[np.asarray(order)] < G
    rows = np.asarray(lay.pos_M)[np.asarray(order)][valid]
    moe_testlib.assert_tree_close(np.asarray(y)[rows], np.asarray(y_ref)[valid], rtol=1e-4, atol=1e-4)
    dw = _gmm_kernels.tgmm(x_PK, y, *meta, G, p, jnp.float32)
    dw_ref = jax.vjp(lambda v: jax.lax.ragged_dot(xk[order], v, sizes), wk)[1](
        jnp.where(valid[:, None], y_ref, 0))[0]
    moe_testlib.assert_tree_close(dw, dw_ref, rtol=1e-4, atol=1e-3)


def test_an_output_stored_in_lanes_is_split_along_n_in_whole_tiles_of_lanes():
    """A block of a [P, N / 128, 128] output is whole along N or 8 rows of 128 lanes, a TPU
    tile: with a v4's 16 MiB of VMEM, dx's blocks at D=2048 are 1024 wide and the row block
    shrinks to one tile to fit, where a [P, N] output would take blocks 256 wide."""
    p = _gmm_plan.Plan(128, nsub=4, vmem_limit=16 * 2 ** 20)
    dx = dict(lhs=2, rhs=2, split_k=False)
    assert p.tiles(1024, 2048, 2, **dx) == _gmm_plan.Tiles(512, 1024, 256)
    assert p.tiles(1024, 2048, 2, **dx, lanes=128) is None and not p.fits((2048, 1024), 2)
    one_tile = dataclasses.replace(p, nsub=1)
    assert one_tile.tiles(1024, 2048, 2, **dx, lanes=128) == _gmm_plan.Tiles(128, 1024, 1024)
    assert one_tile.fits((2048, 1024), 2)


@pytest.mark.parametrize("padding", [False, True])
def test_sort_swiglu_and_combine_as_one_vjp_equal_the_three_apart(moe_testlib, padding):
    """`tiled_experts` (rows back out of the slots by `_gather.gather_sum`, written as
    [P, D / L, L]; the combine's backward scaling g's rows inside the kernels) equals
    `_permute.permute_rows`, `tiled_swiglu` and `_permute.combine` differentiated by JAX,
    in the output and in the gradients of x, every weight and the combine weights; with
    `padding`, some choices have no slot (expert parallelism's padding rows)."""
    x, w, _, G, K, _ = _swiglu_case()
    T = x.shape[0]
    group_M = _groups(7, T * K, G, padding=padding)
    p = _gmm_plan.Plan(8, interpret=True)
    lay = _permute.padded_layout(group_M, G, p.tm)
    pos_TK, meta = lay.pos_M.reshape(T, K), (lay.tile_group_I, lay.num_tiles)
    runs = _gather.runs(pos_TK, group_M.reshape(T, K), G, 8)
    assert runs.row_TK.shape[0] // (runs.tt * K) == 3   # three token tiles
    weights_TK = jax.nn.softmax(jax.random.normal(jax.random.key(8), (T, K)))
    ct = jax.random.normal(jax.random.key(9), (T, x.shape[1]))

    def one_vjp(x, w, weights_TK):
        return _gmm.tiled_experts(x, *w, lay, runs, weights_TK, p)

    def apart(x, w, weights_TK):
        x_PD = _permute.permute_rows(x, lay.src_P // K, pos_TK)
        return _permute.combine(_gmm.tiled_swiglu(x_PD, *w, *meta, p), pos_TK, weights_TK)

    (y, back), (y_want, back_want) = (jax.vjp(f, x, w, weights_TK) for f in (one_vjp, apart))
    moe_testlib.assert_tree_close((y, back(ct)), (y_want, back_want(ct)))


def test_gather_sum_reads_runs_of_any_length(moe_testlib):
    """`_gather.gather_sum` against a gather and a sum, with runs of slots from none to
    more than two copies of 16 rows (then copies of 8, 4, 2, 1), tokens not a whole number
    of tiles, some choices with no slot, and a table of [P, C, L] rows."""
    T, K, G, C, L = 40, 3, 4, 2, 8
    group_TK = jnp.asarray(np.random.default_rng(0).choice(G + 1, (T, K), p=[0.8, 0.1, 0.05,
                                                                           0.0, 0.05]))
    lay = _permute.padded_layout(group_TK.reshape(T * K), G, 4)
    pos_TK = lay.pos_M.reshape(T, K)
    table = jax.random.normal(jax.random.key(0), (lay.rows, C, L))
    weights_TK = jax.random.normal(jax.random.key(1), (T, K))
    r = _gather.runs(pos_TK, group_TK, G, 16)
    lengths = np.asarray(r.ranges).reshape(-1, 3, G)[:, 1]
    assert lengths.max() > 32 and (lengths == 0).any()
    out, rows = _gather.gather_sum(table, r, weights_TK, T, K, with_rows=True, interpret=True,
                                   vmem_limit=2 ** 26)
    live = np.asarray(group_TK < G)
    want_rows = np.asarray(table)[np.minimum(np.asarray(pos_TK), lay.rows - 1)]
    want = np.sum(np.where(live[..., None, None], want_rows, 0)
                  * np.asarray(weights_TK)[..., None, None], axis=1)
    moe_testlib.assert_tree_close(out, want)
    np.testing.assert_array_equal(np.asarray(rows).reshape(T, K, C, L)[live], want_rows[live])
    unweighted = _gather.gather_sum(table, r, None, T, K, with_rows=False, interpret=True,
                                    vmem_limit=2 ** 26)
    moe_testlib.assert_tree_close(unweighted, np.sum(np.where(live[..., None, None],
                                                              want_rows, 0), axis=1))


def _layer_vjp(moe_testlib, layer, params, kernel):
    """The layer's output and VJP on `kernel`, traced afresh (`pallas_paths.layer_vjp`)."""
    x, r = moe_testlib.activations()
    return pallas_paths.layer_vjp(layer, params, x, r, kernel, row_tile=8)


def test_routed_moe_with_pallas_kernels_matches_today(moe_testlib):
    cfg = moe_testlib.config()
    layer = moe.RoutedMoE(cfg)
    params = layer.init(jax.random.key(0))
    got = _layer_vjp(moe_testlib, layer, params, "interpret")
    moe_testlib.assert_tree_close(got, _layer_vjp(moe_testlib, layer, params, "xla"))


def test_sharded_moe_with_pallas_kernels_inside_shard_map_on_one_device(moe_testlib):
    """On a one-device mesh (the benchmark's) the kernels run inside shard_map, called in
    place (nothing varies over a mesh axis); several devices: test_sharded_pallas.py."""
    cfg = moe_testlib.config()
    params = moe.RoutedMoE(cfg).init(jax.random.key(0))
    want = _layer_vjp(moe_testlib, moe.RoutedMoE(cfg), params, "xla")
    mesh = moe_testlib.make_mesh((1, 1), ("data", "context"))
    sharded = moe.ShardedRoutedMoE(cfg, mesh, batch_axes=(), seq_axes=(), weight_axes=())
    moe_testlib.assert_tree_close(_layer_vjp(moe_testlib, sharded, params, "interpret"), want)
    with _gmm_plan.grouped_kernel("interpret", row_tile=8):
        text = str(jax.make_jaxpr(sharded)(params, moe_testlib.activations()[0]))
    assert "shardlint_gmm" in text and "ragged_dot" not in text


def test_a_layer_traces_each_kernel_scope_it_is_called_in(moe_testlib):
    """The layer's own jitted shard_map is keyed by the kernel scope: called under "xla"
    first, the same layer object still takes the Pallas path under "interpret" (jit's
    cache kept the first trace for both before). Each call is traced afresh (a new
    function), as a training step that builds its loss per run would."""
    cfg = moe_testlib.config()
    mesh = moe_testlib.make_mesh((1, 1), ("data", "context"))
    layer = moe.ShardedRoutedMoE(cfg, mesh, batch_axes=(), seq_axes=(), weight_axes=())
    params = layer.init(jax.random.key(0))
    x = moe_testlib.activations()[0]
    texts = {}
    for kernel in ("xla", "interpret"):
        with _gmm_plan.grouped_kernel(kernel, row_tile=8):
            texts[kernel] = str(jax.make_jaxpr(lambda p, x: layer(p, x))(params, x))
    assert "ragged_dot" in texts["xla"] and "shardlint_gmm" not in texts["xla"]
    assert "shardlint_gmm" in texts["interpret"] and "ragged_dot" not in texts["interpret"]


def test_plan_keeps_ragged_dot_off_the_tpu_and_for_odd_shapes():
    bf16 = jnp.bfloat16
    assert _gmm_plan.plan(65536, (2048, 1024), 64, bf16, weights_whole=True) is None  # CPU
    with _gmm_plan.grouped_kernel("pallas"):
        assert _gmm_plan.plan(65536, (2048, 1024), 64, bf16, weights_whole=True) is not None
        assert _gmm_plan.plan(4096, (2048, 100), 8, bf16, weights_whole=True) is None
        assert _gmm_plan.plan(65536, (2048, 1024), 64, bf16, weights_whole=False) is None
    with _gmm_plan.grouped_kernel("xla"):
        assert _gmm_plan.plan(65536, (2048, 1024), 64, bf16, weights_whole=True) is None
    with pytest.raises(ValueError, match="not one of"):
        with _gmm_plan.grouped_kernel("cuda"):
            pass


def test_plan_takes_tiles_of_128_rows_in_blocks_that_fit_vmem():
    """On a TPU: tiles of 128 rows, blocks of 512; a block whose operands would not fit
    the VMEM limit is halved until they do."""
    bf16 = jnp.bfloat16
    with _gmm_plan.grouped_kernel("pallas"):
        p = _gmm_plan.plan(65536, (2048, 1024), 64, bf16, weights_whole=True)
    assert (p.tm, p.bm) == (_gmm_plan.TPU_TILE, _gmm_plan.TPU_BLOCK) == (128, 512)
    with _gmm_plan.grouped_kernel("pallas", block_rows=8192):
        big = _gmm_plan.plan(65536, (2048, 1024), 64, bf16, weights_whole=True)
    assert big.tm == 128 and 128 <= big.bm < 8192
    assert big.fits((2048, 1024), 2) and not dataclasses.replace(
        big, nsub=2 * big.nsub).fits((2048, 1024), 2)
    with pytest.raises(ValueError, match="not a multiple"):
        with _gmm_plan.grouped_kernel("pallas", row_tile=128, block_rows=200):
            _gmm_plan.plan(65536, (2048, 1024), 64, bf16, weights_whole=True)


@pytest.mark.parametrize("nsub", [1, 2, 4])
def test_visits_take_each_tile_in_use_once_by_block_and_group(nsub):
    """A visit is a run of tiles in use of one group within one block of nsub tiles; the
    visits, in order, cover the tiles in use once each."""
    M, G, tm = 96, 6, 4
    group_M = _groups(0, M, G, padding=True)
    p = _gmm_plan.Plan(tm, interpret=True, nsub=nsub)
    lay = _permute.padded_layout(group_M, G, tm, p.bm)
    assert lay.rows % p.bm == 0 and lay.rows >= (-(-M // tm) + G) * tm
    meta, num_visits = _gmm_grid.visits(lay.tile_group_I, lay.num_tiles, p)
    V = lay.tile_group_I.shape[0]
    block, group, first, count = np.asarray(meta).reshape(4, V)[:, :int(num_visits)]
    tiles = [b * nsub + f + i for b, f, c in zip(block, first, count) for i in range(c)]
    assert tiles == list(range(int(lay.num_tiles)))
    tile_group = np.asarray(lay.tile_group_I)
    for b, g, f, c in zip(block, group, first, count):
        assert 1 <= c and f + c <= nsub
        assert np.all(tile_group[b * nsub + f:b * nsub + f + c] == g)
    assert np.all(np.diff(group) >= 0) and set(group) == set(range(G))


@pytest.mark.parametrize("block_rows", [16, 24, 32, 64])
def test_grouped_swiglu_pallas_in_blocks_of_several_tiles_matches_ragged_dot(moe_testlib,
                                                                             block_rows):
    """Blocks of 2, 3, 4 and 8 tiles: visits of every size (a short visit one product per
    power of two in its tile count; in blocks of 3 tiles, a loop of one product per tile),
    and the weight gradients' runs of as many tiles, each group's last product added to
    its accumulator as the gradient is stored."""
    x, w, group_M, G, R, ct = _swiglu_case()

    def vjp(kernel):
        with _gmm_plan.grouped_kernel(kernel, row_tile=8, block_rows=block_rows):
            y, back = jax.vjp(lambda x, w: _experts.grouped_swiglu(x, group_M, G, *w, repeat=R),
                              x, w)
            return y, back(ct)
    moe_testlib.assert_tree_close(vjp("interpret"), vjp("xla"))


@pytest.mark.parametrize("nsub", [2, 4, 8])
def test_chunks_run_from_each_groups_first_tile(nsub):
    """The weight gradient's visits (`_grid.chunks`): runs of up to nsub tiles of one
    group, counted from the group's first tile, covering the tiles in use once each, in
    order; each read as the block of nsub tiles from tile `at` (inside the layout)."""
    M, G, tm = 96, 6, 4
    group_M = _groups(0, M, G, padding=True)
    p = _gmm_plan.Plan(tm, interpret=True, nsub=nsub)
    lay = _permute.padded_layout(group_M, G, tm, p.bm)
    meta, num_visits = _gmm_grid.chunks(lay.tile_group_I, lay.num_tiles, p)
    V = lay.tile_group_I.shape[0]
    at, group, first, count = np.asarray(meta).reshape(4, V)[:, :int(num_visits)]
    tiles = [a + f + i for a, f, c in zip(at, first, count) for i in range(c)]
    assert tiles == list(range(int(lay.num_tiles)))
    tile_group = np.asarray(lay.tile_group_I)
    group_first = {g: int(np.argmax(tile_group == g)) for g in range(G)}
    for a, g, f, c in zip(at, group, first, count):
        assert 1 <= c <= nsub and f + c <= nsub and 0 <= a and a + nsub <= V
        assert np.all(tile_group[a + f:a + f + c] == g)
        assert (a + f - group_first[g]) % nsub == 0
    assert np.all(np.diff(group) >= 0) and set(group) == set(range(G))
