"""The choice of grouped-matmul kernel for a call, and its tiles (the kernels are `_kernels`).

Which kernel runs is chosen per call (`plan`): the Pallas kernels on a TPU for bfloat16
whose D and F tile by 128 and whose weights are whole on the device (inside `shard_map`
too, rows varying over its axes), `ragged_dot` (today's path, and the only one on CPU)
otherwise. `grouped_kernel(...)` forces a choice for a scope: "xla" (ragged_dot),
"pallas", or "interpret" (the Pallas kernels in interpret mode, any backend and dtype;
what the CPU tests use, on several simulated devices too: `_compat.per_device`). The scope
is read when a function is traced: a jitted function keeps the kernel it was traced with
(`ShardedRoutedMoE` keys its own jitted `shard_map` by `scope()`).

Rows are laid out in tiles of `tm` rows (each group padded to whole tiles, `_permute`) and
the kernels take them in blocks of `bm = tm * nsub` rows: a grid step ("visit") runs the
sub-tiles of one block that belong to one group, so a group's rows go through the matrix
unit in long runs (each weight block pushed into it once per visit) while a group wastes
less than a tile of padding. On a TPU: tm = 128, bm = 512 (`TPU_TILE`, `TPU_BLOCK`; why in
`plan`). The blocks along K and N are the largest whose double-buffered operands fit the
VMEM limit (`Plan.tiles`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from . import _gather

KERNELS = ("auto", "xla", "pallas", "interpret")

# VMEM a kernel may use: the default scoped limit (16-32 MiB) is too small for a whole
# 2048 x 1024 weight block double-buffered. A chip with less VMEM per core gets all of it
# (`vmem_limit_of`; JAX's `pltpu.get_tpu_info`: 128 MiB on a v5e or v6e, 64 on a v5p, 16 on a
# v4, where 28, the limit before, did not compile).
VMEM_LIMIT = 64 * 2 ** 20
# The layout's row tile and the kernels' row block on a TPU (measured on a v5e: see
# `plan`).
TPU_TILE = 128
TPU_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class Scope:
    """What `grouped_kernel` set: the kernel, and the row tile, row block and VMEM limit
    forced (benchmarks and tests; None: the defaults)."""
    kernel: str = "auto"
    row_tile: int | None = None
    block_rows: int | None = None
    vmem_limit: int | None = None


_scope: contextvars.ContextVar[Scope] = contextvars.ContextVar("shardlint_gmm_scope",
                                                               default=Scope())


@contextlib.contextmanager
def grouped_kernel(name: str, *, row_tile: int | None = None, block_rows: int | None = None,
                   vmem_limit: int | None = None) -> Iterator[None]:
    """Inside, grouped matmuls use kernel `name` ("auto", "xla", "pallas", "interpret")
    and, when given, row tiles of `row_tile` rows, row blocks of `block_rows` (a multiple
    of the tile; default: one tile in interpret mode, `TPU_BLOCK` on a TPU) and a VMEM
    limit of `vmem_limit` bytes (default: this TPU's, `vmem_limit_of`; with no TPU attached,
    `VMEM_LIMIT`, and a compile for a chip with less VMEM passes that chip's): in what is
    traced inside (a function jitted and traced before keeps its kernel)."""
    if name not in KERNELS:
        raise ValueError(f"grouped kernel {name!r} is not one of {KERNELS}")
    token = _scope.set(Scope(name, row_tile, block_rows, vmem_limit))
    try:
        yield
    finally:
        _scope.reset(token)


def scope() -> Scope:
    """What `grouped_kernel` set for this scope (a cache key for code that jits a function
    calling `plan`)."""
    return _scope.get()


def vmem_limit_of(capacity: int) -> int:
    """The VMEM limit of a TPU with `capacity` bytes of VMEM per core (`VMEM_LIMIT`)."""
    return min(VMEM_LIMIT, capacity)


def _this_tpus_vmem_limit() -> int:
    try:
        return vmem_limit_of(pltpu.get_tpu_info().vmem_capacity_bytes)
    except ValueError:   # a TPU that JAX's table does not list
        return VMEM_LIMIT


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Block sizes of one kernel: rows, contracted, output columns."""
    m: int
    k: int
    n: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the grouped matmuls of one SwiGLU run: rows in tiles of `tm`, taken by the
    kernels in blocks of `nsub` tiles, and interpret mode (tests on CPU)."""
    tm: int
    interpret: bool = False
    vmem_limit: int = VMEM_LIMIT
    nsub: int = 1
    # a visit of fewer than nsub tiles: one product per power of two in its tile count
    # (True) or one per tile (False)
    pow2: bool = False
    # the weight-gradient kernel's visits: runs of up to `tgmm_chunk` tiles from each
    # group's first tile (0: the blocks of nsub tiles the other kernels visit)
    tgmm_chunk: int = 0

    @property
    def bm(self) -> int:
        """Rows of a kernel's row block."""
        return self.tm * self.nsub

    def tiles(self, k: int, n: int, itemsize: int, *, lhs: int = 1, rhs: int = 1,
              outs: int = 1, split_k: bool = True, lanes: int | None = None) -> Tiles | None:
        """The largest blocks along K and N (whole, then halved, K only when `split_k`)
        whose double-buffered operands (`lhs` row blocks, `rhs` weight blocks, `outs`
        row blocks of output or epilogue input) and float32 products fit the VMEM limit;
        None if none does. With `lanes`, the output is stored as [P, N / lanes, lanes]
        (`_grid.store`), and an N block is all of N or a multiple of 8 rows of lanes:
        the TPU's tile of a block's last two dimensions is 8 x 128."""
        tk, tn = k, n
        n_unit = 128 if lanes is None else 8 * lanes
        while _vmem(self.bm, tk, tn, itemsize, lhs, rhs, outs) > self.vmem_limit * 0.75:
            if split_k and tk >= tn and tk % 256 == 0:
                tk //= 2
            elif tn % (2 * n_unit) == 0:
                tn //= 2
            elif split_k and tk % 256 == 0:
                tk //= 2
            else:
                return None
        return Tiles(self.bm, tk, tn)

    def tgmm_tiles(self, k: int, n: int, itemsize: int) -> Tiles | None:
        """Blocks of the weight-gradient kernel: a [tk, tn] float32 accumulator."""
        tk, tn = k, n
        while 2 * (self.bm * tk + self.bm * tn + tk * tn) * itemsize + 2 * tk * tn * 4 \
                + self.bm * tk * itemsize > self.vmem_limit * 0.75:
            if tk >= tn and tk % 256 == 0:
                tk //= 2
            elif tn % 256 == 0:
                tn //= 2
            else:
                return None
        return Tiles(self.bm, tk, tn)

    def fits(self, dims: tuple[int, int], itemsize: int) -> bool:
        """Whether every kernel of a SwiGLU with D x F = `dims` has blocks that fit (the
        two with [P, D] results stored in lanes, `_gather.lanes`, as `_gmm.tiled_experts`
        stores them)."""
        D, F = dims
        lanes = _gather.lanes(D)
        return None not in (self.tiles(D, F, itemsize, rhs=2, outs=3, split_k=False),
                            self.tiles(F, D, itemsize, lanes=lanes),
                            self.tiles(D, F, itemsize, outs=4, split_k=False),
                            self.tiles(F, D, itemsize, lhs=2, rhs=2, split_k=False,
                                       lanes=lanes),
                            self.tgmm_tiles(D, F, itemsize), self.tgmm_tiles(F, D, itemsize))


def _vmem(tm: int, tk: int, tn: int, itemsize: int, lhs: int, rhs: int, outs: int) -> int:
    """Bytes of VMEM for double-buffered blocks and float32 products/accumulators."""
    return (2 * (lhs * tm * tk + rhs * tk * tn + outs * tm * tn) * itemsize
            + 2 * max(rhs, 1) * tm * tn * 4)


def plan(rows: int, dims: tuple[int, int], num_groups: int, dtype, *,
         weights_whole: bool) -> Plan | None:
    """The Pallas plan for a grouped SwiGLU of `rows` rows, D x F = `dims`, or None for
    `ragged_dot`. `weights_whole`: the weights are whole on the device (the products'
    custom VJP cannot be transposed by `_ring`'s schedules).

    On a TPU, rows in tiles of 128 and blocks of 512 (`TPU_TILE`, `TPU_BLOCK`), blocks
    halved until the kernels' operands fit VMEM. ShardedRoutedMoE's training step on a
    v5e (T=8192, E=64, top-8, D=2048, F=1024; `benchmarks/tpu_moe.py --part tilings:...`)
    took 26.69 ms at (tile, block) = (256, 256) (issue 34's kernels), 26.35 at (128, 256),
    25.54 at (256, 512), 25.46 at (128, 512) and 25.91 at (256, 1024); at E=128 30.91 /
    28.77 / 28.82 ms at (256, 256) / (256, 512) / (128, 512), the last with 0.19 GiB less
    temp memory (less padding)."""
    s = _scope.get()
    if s.kernel == "xla" or not weights_whole:
        return None
    if s.kernel == "interpret":
        tm = s.row_tile or 8
        return _visiting(Plan(tm, interpret=True, nsub=_nsub(tm, s.block_rows or tm)))
    on_tpu = jax.default_backend() == "tpu"
    if s.kernel == "auto" and not (on_tpu and jnp.dtype(dtype) == jnp.bfloat16):
        return None
    if any(d % 128 for d in dims):
        return None
    tm = s.row_tile or TPU_TILE
    bm = s.block_rows or max(tm, TPU_BLOCK)
    limit = s.vmem_limit or (_this_tpus_vmem_limit() if on_tpu else VMEM_LIMIT)
    p = Plan(tm, vmem_limit=limit, nsub=_nsub(tm, bm))
    while not p.fits(dims, jnp.dtype(dtype).itemsize) and p.nsub > 1:
        p = dataclasses.replace(p, nsub=p.nsub // 2)
    return _visiting(p) if p.fits(dims, jnp.dtype(dtype).itemsize) else None


def _visiting(p: Plan) -> Plan:
    """p with short visits as power-of-two runs of tiles and the weight gradient's visits
    counted from each group's first tile, where blocks hold several tiles. On a v5e (E=64,
    top-8, T=8192, D=2048, F=1024; `benchmarks/tpu_gmm_probe.py`) each `tgmm` alone took
    2.79 ms over blocks of 4 tiles (a short visit a loop of 128-row products, each a
    read-modify-write of the [K, N] float32 accumulator), 2.77 with power-of-two runs,
    2.51 with runs of 4 from each group's first tile (one short run per group), 4.33 with
    runs of 8; E=128: 3.33, 3.26 and 2.68 ms. The whole SwiGLU forward+backward 17.91,
    17.70 and 17.05 ms."""
    if p.nsub == 1:
        return p
    return dataclasses.replace(p, pow2=p.nsub & (p.nsub - 1) == 0, tgmm_chunk=p.nsub)


def _nsub(tm: int, bm: int) -> int:
    if bm % tm:
        raise ValueError(f"block_rows={bm} is not a multiple of row_tile={tm}")
    return bm // tm
