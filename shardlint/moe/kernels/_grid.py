"""The grid of `_kernels`' kernels: visits, blocks and the pallas_call around a kernel body.

A kernel's grid runs over "visits" (`visits`): the tiles of one block of `p.bm` rows that
belong to one group, in order, read by the kernel through scalar prefetch as one int32
array of 4 x V (each visit's block, group, first tile within its block and tile count);
the weight gradient's visits are runs counted from each group's first tile instead
(`chunks`). `each_visit` calls a kernel's body for a visit's rows; `row_specs`,
`weight_specs`, `out_spec` and `scale_specs` are the blocks at visit v; `call` and
`launch` make the pallas_call (one device's values at a time in interpret mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import _compat
from ._plan import Plan, Tiles


def cost(m: int, k: int, n: int, itemsize: int, products: int = 1) -> pl.CostEstimate:
    return pl.CostEstimate(flops=2 * m * k * n * products, transcendentals=0,
                           bytes_accessed=(m * k + k * n + m * n) * itemsize * products)


def params(p: Plan, semantics: tuple[str, ...]):
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=p.vmem_limit)


def visits(tile_group_I: jax.Array, num_tiles: jax.Array, p: Plan):
    """The grid's visits: each a run of consecutive tiles in use that share a group and a
    block of `p.nsub` tiles, in order. Returns one int32 array of 4 x V (V tiles: at most
    V visits), each visit's block, group, first tile within its block and tile count, and
    the number of visits (0-d)."""
    V = tile_group_I.shape[0]
    if V % p.nsub:
        raise ValueError(f"{V} tiles do not make whole blocks of {p.nsub}")
    t_I, used_I, opens_I = _tiles(tile_group_I, num_tiles)
    first_V, count_V, num = _runs(used_I & ((t_I % p.nsub == 0) | opens_I), used_I)
    return jnp.concatenate([first_V // p.nsub, tile_group_I[first_V], first_V % p.nsub, count_V]), num


def chunks(tile_group_I: jax.Array, num_tiles: jax.Array, p: Plan):
    """Visits as `visits` returns them, but each a run of up to `p.nsub` tiles counted
    from its group's first tile (not from a block boundary), and its first entry the
    tile its block of `p.nsub` tiles starts at (an element offset / tm), not a block:
    the run's first tile, or, near the end, the last whole block's."""
    V = tile_group_I.shape[0]
    if V < p.nsub:
        raise ValueError(f"{V} tiles are fewer than a chunk of {p.nsub}")
    t_I, used_I, opens_I = _tiles(tile_group_I, num_tiles)
    group_start_I = jax.lax.cummax(jnp.where(opens_I, t_I, 0))
    first_V, count_V, num = _runs(used_I & ((t_I - group_start_I) % p.nsub == 0), used_I)
    at_V = jnp.minimum(first_V, V - p.nsub)
    return jnp.concatenate([at_V, tile_group_I[first_V], first_V - at_V, count_V]), num


def _tiles(tile_group_I: jax.Array, num_tiles: jax.Array):
    """Each tile's index, whether it is in use, and whether it opens its group."""
    t_I = jnp.arange(tile_group_I.shape[0], dtype=jnp.int32)
    before_I = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile_group_I[:-1]])
    return t_I, t_I < num_tiles, tile_group_I != before_I


def _runs(start_I: jax.Array, used_I: jax.Array):
    """The runs of tiles in use, one starting at each tile of `start_I`: each run's first
    tile and tile count (V entries, the ones past the last run unused), and their number."""
    V = start_I.shape[0]
    t_I = jnp.arange(V, dtype=jnp.int32)
    c_I = jnp.cumsum(start_I.astype(jnp.int32))      # 1 + the run of each tile in use
    first_V = jnp.minimum(jnp.sum(c_I[None, :] <= t_I[:, None], axis=1, dtype=jnp.int32), V - 1)
    count_V = jnp.sum((c_I[None, :] == t_I[:, None] + 1) & used_I[None, :], axis=1, dtype=jnp.int32)
    return first_V, count_V, c_I[-1]


def each_visit(p: Plan, meta_ref, v, V: int, body) -> None:
    """body(rows, lead, tail) for visit v: `rows` a pl.ds of its rows within the block,
    of static size; `lead` and `tail`: whether they are the visit's first and its last (a
    kernel that accumulates over a visit starts at the first and stores at the last). A
    visit of the whole block is one call; a shorter one
    is one call per power of two in its tile count with `p.pow2` (two bodies more at
    blocks of 4 tiles: runs of 2 and of 1), else one call for its tile count with blocks
    of two tiles, else a loop of one call per tile: Mosaic unrolls each call's products,
    and a copy of the body per tile count (four at 128-row tiles in 512-row blocks) made
    the kernels with two products 44% slower on a v5e."""
    if p.nsub == 1:
        body(pl.ds(0, p.tm), True, True)
        return
    first, count = meta_ref[2 * V + v], meta_ref[3 * V + v]
    pl.when(count == p.nsub)(functools.partial(body, pl.ds(0, p.bm), True, True))
    if p.pow2 and p.nsub & (p.nsub - 1) == 0:
        size = p.nsub // 2
        while size:
            done = count & ~(2 * size - 1)     # the tiles of the larger powers, first
            pl.when((count < p.nsub) & (count & size != 0))(functools.partial(
                body, pl.ds(pl.multiple_of((first + done) * p.tm, p.tm), size * p.tm),
                done == 0, count & (size - 1) == 0))
            size //= 2
        return
    if p.nsub == 2:
        pl.when(count == 1)(functools.partial(
            body, pl.ds(pl.multiple_of(first * p.tm, p.tm), p.tm), True, True))
        return

    @pl.when(count < p.nsub)
    def _():
        def tile(i, carry):
            body(pl.ds(pl.multiple_of((first + i) * p.tm, p.tm), p.tm), i == 0,
                 i == count - 1)
            return carry
        jax.lax.fori_loop(0, count, tile, 0)


def row_specs(t: Tiles, count: int, k_dim: bool) -> list:
    """Blocks of `count` [P, *] row arrays at visit v's block: along K (k_dim) or along N."""
    if k_dim:
        return [pl.BlockSpec((t.m, t.k), lambda n, v, k, meta: (meta[v], k))] * count
    return [pl.BlockSpec((t.m, t.n), lambda n, v, k, meta: (meta[v], n))] * count


def weight_specs(t: Tiles, V: int, count: int, transpose: bool) -> list:
    """Blocks of `count` [G, K, N] (or [G, N, K] with `transpose`) weight arrays at visit
    v's group."""
    if transpose:
        return [pl.BlockSpec((None, t.n, t.k),
                             lambda n, v, k, meta: (meta[V + v], n, k))] * count
    return [pl.BlockSpec((None, t.k, t.n), lambda n, v, k, meta: (meta[V + v], k, n))] * count


def launch(p: Plan, call, tile_group_I, num_tiles, operands: list, visits=visits):
    """call(meta, num_visits, *operands), a pallas_call's, the visits made by `visits` (the
    function `visits` or `chunks`); in interpret mode one device's values at a time
    (`_compat.per_device`: JAX's interpreters fail inside `shard_map` on values that vary
    over its axes)."""
    def run(tile_group_I, num_tiles, *operands):
        return call(*visits(tile_group_I, num_tiles, p), *operands)
    if p.interpret:
        return _compat.per_device(run, tile_group_I, num_tiles, *operands)
    return run(tile_group_I, num_tiles, *operands)


def call(kernel, name: str, t: Tiles, K: int, N: int, p: Plan, tile_group_I, num_tiles,
          in_specs, out_shapes: list, products: int, operands: list, lanes: int | None = None):
    """A pallas_call over (N blocks, visits, K blocks); scalar prefetch: the visits
    (`visits`). `in_specs(V)`: the operands' blocks for V tiles. Its outputs
    (`out_shapes`) are declared to vary as the operands do; with `lanes`, each is
    [P, N / lanes, lanes] (`store`)."""
    P = out_shapes[0].shape[0]
    V = tile_group_I.shape[0]
    k_steps = K // t.k

    def call(meta, num_visits, *operands):
        return pl.pallas_call(
            functools.partial(kernel, V=V),
            out_shape=[_compat.out_struct(s.shape, s.dtype, *operands) for s in out_shapes],
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(N // t.n, num_visits, k_steps),
                in_specs=in_specs(V),
                out_specs=[out_spec(t, lanes)] * len(out_shapes),
                scratch_shapes=[pltpu.VMEM((t.m, t.n), jnp.float32)] if k_steps > 1 else []),
            compiler_params=params(p, ("parallel", "arbitrary", "arbitrary")),
            interpret=p.interpret,
            cost_estimate=cost(P, K, N, out_shapes[0].dtype.itemsize, products),
            name=name,
        )(meta, *operands)
    return launch(p, call, tile_group_I, num_tiles, operands)


def rows_struct(P: int, N: int, dtype, lanes: int | None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((P, N) if lanes is None else (P, N // lanes, lanes), dtype)


def out_spec(t: Tiles, lanes: int | None) -> pl.BlockSpec:
    """The output block at visit v's block and N block n ([P, N / lanes, lanes] with
    `lanes`)."""
    if lanes is None:
        return pl.BlockSpec((t.m, t.n), lambda n, v, k, meta: (meta[v], n))
    return pl.BlockSpec((t.m, t.n // lanes, lanes), lambda n, v, k, meta: (meta[v], n, 0))


def store(o_ref, rows, value: jax.Array, lanes: int | None) -> None:
    """o_ref[rows] = value, rounded to o_ref's dtype; with `lanes`, each row of value
    stored as [N / lanes, lanes], whole tiles of the chip's memory: the layout `_gather`
    copies rows out of (a copy of one row of a [P, N] array is not possible there)."""
    if lanes is not None:
        value = value.reshape(value.shape[0], value.shape[1] // lanes, lanes)
        o_ref[rows] = value.astype(o_ref.dtype)
    else:
        o_ref[rows, :] = value.astype(o_ref.dtype)


NN = (((1,), (0,)), ((), ()))
NT = (((1,), (1,)), ((), ()))


def scale_specs(t: Tiles, scaled: bool) -> list:
    """The block of a [P, 1] float32 row scale at visit v's block (none when unscaled)."""
    return [pl.BlockSpec((t.m, 1), lambda n, v, k, meta: (meta[v], 0))] if scaled else []
