"""Each token's K rows out of the P slots, summed: a Pallas kernel of DMA copies (TPU).

The combine's forward pass (y_TD[t] = sum over k of w[t, k] * y_P[pos[t, k]]) and the
sort's backward pass (dx_TD[t] = sum over k of dx_P[pos[t, k]]) read a token's K rows out
of the P slots of the grouped layout. XLA:TPU's gather did each in 2.25 ms of
ShardedRoutedMoE's training step on a v5e, and a reduce pass over the [T, K, D] rows it
wrote 0.36 ms more (`benchmarks/tpu_moe_profile.py`), 4x per index the cost of a gather
out of the T tokens. A kernel cannot copy single rows out of a [P, D] array either: the
chip's memory holds it in tiles of 16 bf16 rows (Mosaic refuses a copy of one row). Here
the table is [P, C, L] with C * L = D (L = 128 lanes on a TPU): each of its rows is whole
tiles, and the kernels that write the P slots write them so (`_kernels`, `lanes`).

The rows one tile of `tt` tokens needs are few contiguous runs: the layout keeps each
group's rows in token order (`_permute.padded_layout` is stable), so the choices of
tokens [t0, t0 + tt) that went to group g sit in one run of g's slots. `runs` finds, per
token tile and group, the run's first slot, its length and its place in a VMEM buffer
(runs in group order, packed), and for each choice its row in that buffer. The kernel
copies each run with a few DMAs of static sizes (16-row copies, then the length's low
binary digits), the next tile's while it sums this one's, and sums each token's rows in
float32 (times its weight, when given), in order k = 0..K-1. With `with_rows` it also
writes the K rows themselves ([T * K, C, L]), from which the combine's weights get their
gradient (`rows_dot`). On a v5e, in ShardedRoutedMoE's step (T=8192, K=8, D=2048): 0.96 ms
for the combine (rows written too) and 0.87 ms for the sort's backward.

In interpret mode (the CPU tests) the kernels run in Pallas's own interpreter, inside
`shard_map` one device's values at a time (`_compat.per_device`); its TPU interpret mode
(`pltpu.InterpretParams`) aborted the process there, on 8 simulated CPU devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import _compat

_CHUNK = 16           # rows per DMA of a run's bulk; the rest by its binary digits
_BUFFER_BYTES = 4 * 2 ** 20   # a token tile's rows in VMEM (two tiles are held at once)


def lanes(d: int) -> int:
    """L of a [P, C, L] table with C * L = d: 128 where d tiles by it, else d."""
    return 128 if d % 128 == 0 else d


def token_tile(tokens: int, k: int, row_bytes: int, interpret: bool,
               vmem_limit: int) -> int:
    """Tokens per grid step: the most (a power of two, 8 to 512) whose K rows fit
    `_BUFFER_BYTES` and whose `gather_sum` fits 3/4 of `vmem_limit` (its buffer holds two
    tiles' rows; the rows and the sums are written double-buffered: on a v4, 16 MiB of
    VMEM, 128 tokens of 8 rows of 4 KiB took 17); 8 in interpret mode (tests: several
    steps at tiny sizes)."""
    if interpret:
        return 8

    def fits(tt: int) -> bool:
        return (tt * k * row_bytes <= _BUFFER_BYTES
                and (4 * tt * k + 2 * tt) * row_bytes <= 0.75 * vmem_limit)
    tt = 8
    while tt < 512 and fits(2 * tt):
        tt *= 2
    return min(tt, max(8, 1 << (tokens - 1).bit_length()))


@functools.partial(jax.tree_util.register_dataclass, data_fields=("ranges", "row_TK"),
                   meta_fields=("tt",))
@dataclasses.dataclass(frozen=True)
class Runs:
    """ranges: per token tile i, [start_G, len_G, offset_G] flattened (I * 3 * G int32):
    the run of group g's slots tile i reads, and where it goes in the buffer; row_TK: each
    choice's row in its tile's buffer (T_pad * K int32, -1: none), T_pad = I * tt."""
    ranges: jax.Array
    row_TK: jax.Array
    tt: int


def runs(pos_TK: jax.Array, group_TK: jax.Array, num_groups: int, tt: int) -> Runs:
    """The runs of slots `pos_TK` (choice (t, k) of group `group_TK[t, k]`; a group id of
    `num_groups` marks a choice with no slot) read by tiles of `tt` tokens. The slots of
    one group must hold its choices in token order (the layout's)."""
    T, K = pos_TK.shape
    G = num_groups
    I = -(-T // tt)
    pad = ((0, I * tt - T), (0, 0))
    group = jnp.pad(group_TK, pad, constant_values=G).reshape(I, tt * K)
    pos = jnp.pad(pos_TK, pad).reshape(I, tt * K)
    mine_IRG = group[:, :, None] == jnp.arange(G, dtype=group.dtype)
    len_IG = jnp.sum(mine_IRG, axis=1, dtype=jnp.int32)
    start_IG = jnp.min(jnp.where(mine_IRG, pos[:, :, None], jnp.iinfo(jnp.int32).max), axis=1)
    start_IG = jnp.where(len_IG > 0, start_IG, 0).astype(jnp.int32)
    offset_IG = jnp.cumsum(len_IG, axis=1, dtype=jnp.int32) - len_IG
    base_IR = jnp.sum(jnp.where(mine_IRG, (offset_IG - start_IG)[:, None, :], 0), axis=2)
    row = jnp.where(group < G, base_IR + pos, -1).astype(jnp.int32)
    ranges = jnp.stack([start_IG, len_IG, offset_IG], axis=1).reshape(I * 3 * G)
    return Runs(ranges, row.reshape(I * tt * K), tt)


def gather_sum(table_PCL: jax.Array, r: Runs, weights_TK: jax.Array | None, T: int,
               K: int, *, with_rows: bool, interpret: bool, vmem_limit: int):
    """out_TCL[t] = sum over k of weights_TK[t, k] * table_PCL[slot of (t, k)] (no weight:
    1), summed in float32 in order k = 0..K-1, in the table's dtype; a choice with no slot
    adds nothing. With `with_rows` also returns the rows, rows_TKCL[t * K + k] (a choice
    with no slot: any row). Inside `shard_map` the operands must vary alike."""
    P, C, L = table_PCL.shape
    tt = r.tt
    R = tt * K
    I = r.row_TK.shape[0] // R
    G = r.ranges.shape[0] // (3 * I)
    weighted = weights_TK is not None
    kernel = functools.partial(_kernel, G=G, R=R, K=K, tt=tt, I=I, weighted=weighted,
                               with_rows=with_rows)
    smem = pltpu.SMEM
    # SMEM blocks: one tile's [1, n] of an [I, 1, n] array (Mosaic takes blocks of a 1-D
    # array only in powers of two of at least 128 entries, of a 2-D one in whole tiles)
    ranges, row = r.ranges.reshape(I, 1, 3 * G), r.row_TK.reshape(I, 1, R)

    def tile_row(n: int, step: int = 0) -> pl.BlockSpec:
        return pl.BlockSpec((None, 1, n), lambda i: (jnp.minimum(i + step, I - 1), 0, 0),
                            memory_space=smem)
    in_specs = [tile_row(3 * G), tile_row(3 * G, 1), tile_row(R)]
    operands = [ranges, ranges, row]
    if weighted:
        w = jnp.pad(weights_TK.astype(jnp.float32), ((0, I * tt - T), (0, 0)))
        in_specs.append(tile_row(R))
        operands.append(w.reshape(I, 1, R))
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    operands.append(table_PCL)
    out_shapes = [((I * tt, C, L), pl.BlockSpec((tt, C, L), lambda i: (i, 0, 0)))]
    if with_rows:
        out_shapes.append(((I * R, C, L), pl.BlockSpec((R, C, L), lambda i: (i, 0, 0))))

    def call(*operands):
        return pl.pallas_call(
            kernel,
            out_shape=[_compat.out_struct(s, table_PCL.dtype, *operands)
                       for s, _ in out_shapes],
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=0, grid=(I,), in_specs=in_specs,
                out_specs=[spec for _, spec in out_shapes],
                scratch_shapes=[pltpu.VMEM((2, R, C, L), table_PCL.dtype),
                                pltpu.SemaphoreType.DMA((2,))]),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                                 vmem_limit_bytes=vmem_limit),
            interpret=interpret,
            name="shardlint_gather_sum",
        )(*operands)

    outs = (_compat.per_device(call, *operands) if interpret else call(*operands))
    out = outs[0][:T] if I * tt != T else outs[0]
    if not with_rows:
        return out
    return out, (outs[1][:T * K] if I * tt != T else outs[1])


def _kernel(cur_ref, next_ref, row_ref, *refs, G, R, K, tt, I, weighted, with_rows):
    if weighted:
        w_ref, *refs = refs
    table_hbm, out_ref, *refs = refs
    if with_rows:
        rows_ref, *refs = refs
    buf, sem = refs
    i = pl.program_id(0)

    def copies(ranges_ref, slot, wait: bool):
        """Start (or wait for) the copies of one tile's runs into buffer `slot`."""
        def copy(src, dst, n):
            cp = pltpu.make_async_copy(table_hbm.at[pl.ds(src, n)],
                                       buf.at[slot, pl.ds(dst, n)], sem.at[slot])
            cp.wait() if wait else cp.start()

        def run(g, carry):
            start, length, offset = (ranges_ref[0, g], ranges_ref[0, G + g],
                                     ranges_ref[0, 2 * G + g])

            def bulk(c, carry):
                copy(start + c * _CHUNK, offset + c * _CHUNK, _CHUNK)
                return carry
            jax.lax.fori_loop(0, length // _CHUNK, bulk, 0)
            b = _CHUNK // 2
            while b >= 1:
                done = length & ~(2 * b - 1)   # the rows the larger copies took
                pl.when((length & b) != 0)(functools.partial(copy, start + done,
                                                             offset + done, b))
                b //= 2
            return carry
        jax.lax.fori_loop(0, G, run, 0)

    @pl.when(i == 0)
    def _():
        copies(cur_ref, 0, wait=False)

    @pl.when(i + 1 < I)
    def _():
        copies(next_ref, (i + 1) % 2, wait=False)

    slot = i % 2
    copies(cur_ref, slot, wait=True)

    def token(t, carry):
        acc = None
        for k in range(K):
            j = t * K + k
            row = row_ref[0, j]
            x = buf[slot, jnp.maximum(row, 0)]
            if with_rows:
                rows_ref[j] = x
            x32 = x.astype(jnp.float32)
            if weighted:
                x32 = x32 * w_ref[0, j]
            x32 = jnp.where(row >= 0, x32, 0.0)
            acc = x32 if acc is None else acc + x32
        out_ref[t] = acc.astype(out_ref.dtype)
        return carry
    jax.lax.fori_loop(0, tt, token, 0)


def rows_dot(rows_NCL: jax.Array, g_TCL: jax.Array, K: int, *, interpret: bool,
             vmem_limit: int) -> jax.Array:
    """dots_TK[t, k] = rows_NCL[t * K + k] . g_TCL[t] in float32 (rows and g whole
    [C, L] tiles: `gather_sum`'s rows): the combine's weights' gradient. XLA:TPU
    broadcast g over K into a [T, K, C, L] buffer of its own first (0.82 ms of
    ShardedRoutedMoE's step on a v5e, then 1.07 ms of multiply and reduce)."""
    T, C, L = g_TCL.shape
    tt = 8
    while tt < 128 and T % (2 * tt) == 0 and 2 * tt * K * C * L * rows_NCL.dtype.itemsize \
            <= _BUFFER_BYTES:
        tt *= 2
    I = -(-T // tt)
    if I * tt != T:
        rows_NCL = jnp.pad(rows_NCL, ((0, (I * tt - T) * K), (0, 0), (0, 0)))
        g_TCL = jnp.pad(g_TCL, ((0, I * tt - T), (0, 0), (0, 0)))

    def kernel(y_ref, g_ref, o_ref):
        def token(t, carry):
            g = g_ref[t].astype(jnp.float32)
            o_ref[t] = jnp.concatenate(
                [jnp.sum(y_ref[t * K + k].astype(jnp.float32) * g, axis=0, keepdims=True)
                 for k in range(K)], axis=0)
            return carry
        jax.lax.fori_loop(0, tt, token, 0)

    def call(rows_NCL, g_TCL):
        return pl.pallas_call(
            kernel,
            out_shape=_compat.out_struct((I * tt, K, L), jnp.float32, rows_NCL, g_TCL),
            grid=(I,),
            in_specs=[pl.BlockSpec((tt * K, C, L), lambda i: (i, 0, 0)),
                      pl.BlockSpec((tt, C, L), lambda i: (i, 0, 0))],
            out_specs=pl.BlockSpec((tt, K, L), lambda i: (i, 0, 0)),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                                 vmem_limit_bytes=vmem_limit),
            interpret=interpret,
            name="shardlint_rows_dot",
        )(rows_NCL, g_TCL)

    out = _compat.per_device(call, rows_NCL, g_TCL) if interpret else call(rows_NCL, g_TCL)
    return jnp.sum(out[:T], axis=-1)
