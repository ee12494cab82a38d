"""The routed-MoE layers on a TPU chip: grouped matmul kernels, layers and training steps.

Measured side by side in one run, bf16, T tokens (--batch x --seq, 8192), E=64 experts,
top-8, D=2048, F=1024 by default; MFU against the chip's dense bf16 peak by `device_kind`
(v4 275, v5e 197, v5p 459, v6e 918 TFLOP/s), counting the expert matmuls only (and the
shared expert for Qwen3-Next). Times are medians of --repeats (>= 10) calls after two
warm-up calls, each to `jax.block_until_ready`.

Kernel rows (forward, and forward+backward: the output and its VJP w.r.t. weights and input), the rows
already grouped by expert: the grouped SwiGLU through `jax.lax.ragged_dot` (today's path),
through shardlint's Pallas kernels (`shardlint.moe.kernels._gmm`, rows in tile-aligned groups),
as expert-batched einsums at capacity, and a dense SwiGLU of the same FLOPs; then
RoutedMoE end to end (route, permute, experts, unpermute, combine), today's path and the
Pallas one.

Training steps (value_and_grad of a scalar loss w.r.t. params and x, one chip):
RoutedMoE, ShardedRoutedMoE (a one-chip mesh) and the Qwen3-Next block (sharded), each
with today's grouped matmul (`grouped_kernel("xla")`: argsort, ragged_dot, scatter), the
one the layer picks now, and the Pallas kernels as issue 34 left them (256-row tiles, a
grid step each); then E=8 (top-2) and E=128 (top-8); then a dense SwiGLU MLP of hidden
K * F, the routed layer's expert FLOPs (MaxText's MlpBlock, the workaround a user compared
against: both MFUs on one line). Beside each step: XLA's
temp and peak from `memory_analysis()` and the chip's `memory_stats()` peak. JAX cannot
reset that peak in a process, so with --isolate every step row runs in a process of its
own (the chip's peak is then that row's); without it the column is the process's peak so
far (issue 34's kernels and today's path run after now's, in now's process). The goals of issues 34 and 43
end the run as PASS / FAIL lines (exit status 1 on a FAIL).

    python benchmarks/tpu_moe.py [--isolate] [--sweep] [--seq 8192 --experts 64 ...]

--sweep adds the single kernels at each row tile (forward NN, input-gradient NT and
weight-gradient TN products, against ragged_dot and megablox gmm), the permutation's
pieces (what the tile choice in `_plan` was measured from) and gathers of rows by the
layout's indices out of tables of several sizes. Where the backend is not a TPU
it prints one skip line and exits 0 (--allow-cpu runs it anyway with small sizes in
Pallas interpret mode, to check the script; those numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from jax.experimental.pallas.ops.tpu import megablox  # noqa: E402

from shardlint import moe  # noqa: E402
from shardlint.moe.layers import _experts  # noqa: E402
from shardlint.moe.kernels import _gmm
from shardlint.moe.kernels import _kernels as _gmm_kernels
from shardlint.moe.kernels import _plan as _gmm_plan
from shardlint.moe.kernels import _permute

PEAKS = (("v4", 275e12), ("v5 lite", 197e12), ("v5e", 197e12), ("v5p", 459e12),
         ("v5", 459e12), ("v6 lite", 918e12), ("v6e", 918e12))
STEP_ROWS = ("RoutedMoE", "ShardedRoutedMoE", "Qwen3-Next (sharded)", "RoutedMoE E=8 top-2",
             "RoutedMoE E=128 top-8")
# path: (grouped kernel, row tile, row block). "today": ragged_dot; "issue 34": the Pallas
# kernels as issue 34 left them (tiles of 256 rows, a grid step per tile); "now": the
# layer's own choice.
PATHS = (("today", ("xla", None, None)), ("issue 34", ("auto", 256, 256)),
         ("now", ("auto", None, None)))
DENSE_ROW = "dense MLP (MlpBlock, same FLOPs)"
# RoutedMoE's step at these (row tile, row block) with --row-tiles
TILINGS = ((256, 256), (256, 512), (128, 512), (256, 1024), (128, 1024))


# MaxText 0.2.5's configs/base.yml: wi_tile_{fwd,dlhs,drhs}_* and wo_tile_*, (rows, k, n).
MAXTEXT_TILING = (512, 1024, 1024)


def megablox_gmm(lhs, rhs, sizes, tiling=MAXTEXT_TILING, interpret=False):
    """JAX's megablox gmm at `tiling`, each tile cut to the product's own size (small shapes)."""
    tiles = tuple(min(t, n) for t, n in zip(tiling, (lhs.shape[0], *rhs.shape[1:])))
    return megablox.gmm(lhs, rhs, sizes, lhs.dtype, tiles, interpret=interpret)


def row_sizes(row: str, args: argparse.Namespace) -> tuple[int, int]:
    """(experts, top-k) a row names ("... E=8 top-2"), else the command line's."""
    m = re.search(r"E=(\d+) top-(\d+)", row)
    return (int(m[1]), int(m[2])) if m else (args.experts, args.top_k)


def peak_flops(kind: str) -> float | None:
    kind = kind.lower()
    return next((p for name, p in PEAKS if name in kind), None)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in dict(batch=1, seq=8192, experts=64, top_k=8, emb=2048, mlp=1024,
                            repeats=10).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    p.add_argument("--isolate", action="store_true", help="each step row in its own process")
    p.add_argument("--sweep", action="store_true", help="single kernels at each row tile")
    p.add_argument("--row-tiles", action="store_true",
                   help="RoutedMoE's step again at each row tile of _gmm_plan.ROW_TILES")
    p.add_argument("--tilings", default=None,
                   help="with --row-tiles: TMxBM,... instead of TILINGS (e.g. 256x512,128x512)")
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.repeats = max(args.repeats, 10)
    args.tilings = (tuple(tuple(int(n) for n in t.split("x")) for t in args.tilings.split(","))
                    if args.tilings else TILINGS)
    return args


def median_s(fn: Callable, *args, repeats: int, keep: list | None = None) -> float:
    """Median seconds of fn(*args) after two warm-up calls (its last result in `keep`)."""
    for _ in range(2):
        out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    if keep is not None:
        keep.append(out)
    return statistics.median(times)


def loop_s(fn: Callable, *args, calls: int) -> float:
    """Seconds per call of fn(*args) in a loop: after two warm-up calls, `calls` calls
    dispatched back to back and one wait for the last, as a training loop runs its steps
    (the host dispatches the next call while the chip runs this one, so the per-call wait
    of `median_s` is not in it). Each call's result is dropped as the next is dispatched,
    so at most two are held."""
    for _ in range(2):
        out = jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / calls


def rel_err(a: Any, b: Any) -> float:
    """max |a - b| / max |b| over a pytree's leaves (in float32)."""
    errs = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
                  / jnp.maximum(jnp.max(jnp.abs(y.astype(jnp.float32))), 1e-30))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return max(errs)


def cell(s: float, flops: float, peak: float | None) -> str:
    rate = flops / s
    mfu = f"{100 * rate / peak:5.1f}%" if peak else "   ? "
    return f"{s * 1e3:8.2f} ms {rate / 1e12:6.1f} TF/s {mfu}"


def vjp_of(f: Callable) -> Callable:
    """f's output and its VJP w.r.t. (w, x): a training step uses both, and a program that
    returned only the gradients would let XLA drop forward work they do not need (the
    last product, or the combine's gather)."""
    def run(w, x, *rest_ct):
        *rest, ct = rest_ct
        y, back = jax.vjp(lambda w, x: f(w, x, *rest), w, x)
        return y, back(ct)
    return jax.jit(run)


class Bench:
    def __init__(self, args):
        self.args = args
        self.dev = jax.devices()[0]
        self.peak = peak_flops(self.dev.device_kind)
        self.interpret = jax.default_backend() != "tpu"
        self._data: dict = {}

    def kernel(self, name: str, row_tile: int | None = None,
               block_rows: int | None = None) -> Any:
        """Today's path ("xla") or the layer's own choice ("auto"; interpret mode off a
        TPU), at a forced row tile and block if given (off a TPU: the interpret mode's)."""
        if name == "xla" or self.interpret:
            row_tile = block_rows = None
        return _gmm_plan.grouped_kernel("interpret" if self.interpret and name != "xla" else name,
                                        row_tile=row_tile, block_rows=block_rows)

    def data(self, E: int, K: int, init: Callable | None = None):
        """Config, params and x. With `init` (a layer's init) the params are drawn on the
        host and placed in bf16: drawn on the chip (one float32 vector for all of them)
        they would set its peak memory above the step's own."""
        key = (E, K, init is not None and getattr(init, "__self__", init).__class__.__name__)
        if key not in self._data:   # a step row's paths share them (drawing takes seconds)
            self._data[key] = self._draw(E, K, init)
        return self._data[key]

    def forget_data(self) -> None:
        """Let the chip free the params drawn so far (E=128's take 1.5 GiB)."""
        self._data.clear()

    def _draw(self, E: int, K: int, init: Callable | None):
        a, D, F = self.args, self.args.emb, self.args.mlp
        cfg = moe.MoeConfig(num_experts=E, top_k=K, emb_dim=D, mlp_dim=F, dtype=jnp.bfloat16)
        x_BSD = jax.random.normal(jax.random.key(1), (a.batch, a.seq, D), jnp.bfloat16)
        if init is None:
            return cfg, moe.init_moe_params(jax.random.key(0), cfg), x_BSD
        rng = np.random.default_rng(0)
        draw = lambda s: jax.device_put((rng.standard_normal(s.shape, np.float32)
                                         * s.shape[-2] ** -0.5).astype(s.dtype))
        return cfg, jax.tree.map(draw, jax.eval_shape(init, jax.random.key(0))), x_BSD

    # ---- kernel rows ----

    def kernel_rows(self) -> dict[str, float]:
        a, peak = self.args, self.peak
        T, E, K, D, F = a.batch * a.seq, a.experts, a.top_k, a.emb, a.mlp
        M = T * K
        cfg, params, x_BSD = self.data(E, K)
        x_TD = x_BSD.reshape(T, D)
        w = {k: params[k] for k in ("wi_0", "wi_1", "wo")}
        _, experts_TK = jax.jit(moe.route, static_argnums=2)(x_TD, params["gate"], cfg)
        group_M = experts_TK.reshape(M)
        order = jnp.argsort(group_M)
        x_MD = jnp.repeat(x_TD, K, axis=0)[order]
        sizes = jnp.bincount(group_M, length=E).astype(jnp.int32)
        plan = _gmm_plan.plan(M, (D, F), E, jnp.bfloat16, weights_whole=True) \
            if not self.interpret else _gmm_plan.Plan(8, interpret=True)
        layout = jax.jit(_permute.padded_layout, static_argnums=(1, 2, 3))(group_M, E, plan.tm,
                                                                         plan.bm)
        x_PD = _permute.permute_rows(x_TD, layout.src_P // K, layout.pos_M.reshape(T, K))
        # issue 34's kernels: tiles of 256 rows, one grid step each
        old = _gmm_plan.Plan(256 if not self.interpret else 8, interpret=self.interpret)
        old_layout = jax.jit(_permute.padded_layout, static_argnums=(1, 2))(group_M, E, old.tm)
        old_x_PD = _permute.permute_rows(x_TD, old_layout.src_P // K,
                                         old_layout.pos_M.reshape(T, K))
        C = int(sizes.max())
        slot = jnp.arange(M) - (jnp.cumsum(sizes) - sizes)[group_M[order]]
        x_ECD = jnp.zeros((E, C, D), jnp.bfloat16).at[group_M[order], slot].set(x_MD)
        H = K * F
        kd = jax.random.split(jax.random.key(2), 3)
        dense = {"wi_0": jax.random.normal(kd[0], (D, H), jnp.bfloat16) * D ** -0.5,
                 "wi_1": jax.random.normal(kd[1], (D, H), jnp.bfloat16) * D ** -0.5,
                 "wo": jax.random.normal(kd[2], (H, D), jnp.bfloat16) * H ** -0.5}

        def ragged(w, x, sizes):
            h = jax.nn.silu(jax.lax.ragged_dot(x, w["wi_0"], sizes)) * \
                jax.lax.ragged_dot(x, w["wi_1"], sizes)
            return jax.lax.ragged_dot(h, w["wo"], sizes)

        def megablox_swiglu(w, x, sizes):   # MaxText's TPU default: its tiles, JAX's kernels
            gmm = lambda lhs, rhs: megablox_gmm(lhs, rhs, sizes, interpret=self.interpret)
            return gmm(jax.nn.silu(gmm(x, w["wi_0"])) * gmm(x, w["wi_1"]), w["wo"])

        def pallas(w, x, tg, nt, p=plan):
            return _gmm.tiled_swiglu(x, w["wi_0"], w["wi_1"], w["wo"], tg, nt, p)

        def layer_fn(kernel):
            def f(w, x):
                with self.kernel(kernel):
                    return moe.RoutedMoE(cfg)(w, x)
            return f

        flops = 3 * 2 * M * D * F
        P = x_PD.shape[0]
        rows = [("grouped SwiGLU (ragged_dot)", ragged, w, x_MD, (sizes,), (M, D)),
                ("grouped SwiGLU (megablox, MaxText tiles)", megablox_swiglu, w,
                 x_MD, (sizes,), (M, D)),
                (f"grouped SwiGLU (Pallas, tm={plan.tm} bm={plan.bm})", pallas, w, x_PD,
                 (layout.tile_group_I, layout.num_tiles), (P, D)),
                (f"grouped SwiGLU (Pallas issue 34, tm={old.tm})",
                 lambda w, x, tg, nt: pallas(w, x, tg, nt, old), w, old_x_PD,
                 (old_layout.tile_group_I, old_layout.num_tiles), (old_x_PD.shape[0], D)),
                (f"capacity SwiGLU (C={C}, einsum)", lambda w, x: _experts.batched_swiglu(
                    x, w["wi_0"], w["wi_1"], w["wo"]), w, x_ECD, (), (E, C, D)),
                (f"dense SwiGLU (hidden {H})", lambda w, x: _experts.swiglu(
                    x, w["wi_0"], w["wi_1"], w["wo"]), dense, x_TD, (), (T, D)),
                ("RoutedMoE layer (today)", layer_fn("xla"), params, x_BSD, (), x_BSD.shape),
                ("RoutedMoE layer (now)", layer_fn("auto"), params, x_BSD, (), x_BSD.shape)]
        print(f"\n{'kernel rows (rows grouped by expert)':<42}{'forward':>30}"
              f"{'forward+backward':>30}")
        out, results = {}, {}
        for name, f, ww, x, rest, ct_shape in rows:
            keep = results.setdefault(name, [])
            fwd = median_s(jax.jit(f), ww, x, *rest, repeats=a.repeats, keep=keep)
            ct = jax.random.normal(jax.random.key(3), ct_shape, jnp.bfloat16)
            both = median_s(vjp_of(f), ww, x, *rest, ct, repeats=a.repeats, keep=keep)
            out[name.split(" (")[0] + " " + name.split("(")[1].split(",")[0].rstrip(")")] = \
                (flops / fwd, 3 * flops / both)
            print(f"{name:<42}{cell(fwd, flops, peak):>30}{cell(both, 3 * flops, peak):>30}",
                  flush=True)
        today, now = results["RoutedMoE layer (today)"], results["RoutedMoE layer (now)"]
        print(f"RoutedMoE now vs today (bf16), max |diff| / max |today|: output "
              f"{rel_err(now[0], today[0]):.2e}, gradients {rel_err(now[1][1], today[1][1]):.2e}")
        if a.sweep:
            self.sweep(x_TD, group_M, x_MD, sizes, w, M, E, K)
        return out

    def sweep(self, x_TD, group_M, x_MD, sizes, w, M, E, K) -> None:
        """Each kernel alone at each row tile, and the permutation's pieces."""
        a, peak = self.args, self.peak
        D, F, T = a.emb, a.mlp, x_TD.shape[0]
        fl = 2 * M * D * F
        print(f"\nsweep: one product of {M} rows, {D} x {F} (FLOPs {fl / 1e9:.0f} G)")
        ragged_dx = jax.jit(lambda dy, w, s: jax.vjp(
            lambda x: jax.lax.ragged_dot(x, w, s), x_MD)[1](dy)[0])
        ragged_dw = jax.jit(lambda x, dy, s: jax.vjp(
            lambda v: jax.lax.ragged_dot(x, v, s), w["wi_0"])[1](dy)[0])
        h_MF = jnp.ones((M, F), jnp.bfloat16)
        for name, f, args in [
                ("ragged_dot x@W up", jax.jit(jax.lax.ragged_dot), (x_MD, w["wi_0"], sizes)),
                ("ragged_dot h@W down", jax.jit(jax.lax.ragged_dot), (h_MF, w["wo"], sizes)),
                ("ragged_dot dx (NT)", ragged_dx, (h_MF, w["wi_0"], sizes)),
                ("ragged_dot dW (TN)", ragged_dw, (x_MD, h_MF, sizes))]:
            print(f"  {name:<34}{cell(median_s(f, *args, repeats=a.repeats), fl, peak)}",
                  flush=True)
        if not self.interpret:
            import importlib  # the package's `gmm` is the function; the module has tgmm
            mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
            for tiles in ((256, 2048, 1024), (512, 1024, 1024)):
                try:
                    f = jax.jit(lambda x, v, s, t=tiles: mb.gmm(x, v, s, jnp.bfloat16, t))
                    print(f"  {f'megablox gmm up {tiles}':<34}"
                          f"{cell(median_s(f, x_MD, w['wi_0'], sizes, repeats=a.repeats), fl, peak)}")
                except Exception as e:  # noqa: BLE001 (a tile that does not compile)
                    print(f"  megablox gmm {tiles}: {type(e).__name__} {str(e)[:100]}")
        for tm in (_gmm_plan.ROW_TILES if not self.interpret else (8,)):
            p = _gmm_plan.Plan(tm, interpret=self.interpret)
            lay = jax.jit(_permute.padded_layout, static_argnums=(1, 2))(group_M, E, tm)
            x_PD = _permute.permute_rows(x_TD, lay.src_P // K, lay.pos_M.reshape(T, K))
            h_PF = jnp.ones((x_PD.shape[0], F), jnp.bfloat16)
            tg, nt = lay.tile_group_I, lay.num_tiles
            kernels = [
                ("up NN", lambda x, v: _gmm_kernels.gmm(x, v, tg, nt, p, transpose_rhs=False),
                 (x_PD, w["wi_0"])),
                ("down NN", lambda x, v: _gmm_kernels.gmm(x, v, tg, nt, p, transpose_rhs=False),
                 (h_PF, w["wo"])),
                ("dx NT", lambda x, v: _gmm_kernels.gmm(x, v, tg, nt, p, transpose_rhs=True),
                 (h_PF, w["wi_0"])),
                ("dW TN", lambda x, y: _gmm_kernels.tgmm(x, y, tg, nt, E, p, jnp.bfloat16),
                 (x_PD, h_PF))]
            for name, f, args in kernels:
                try:
                    t = median_s(jax.jit(f), *args, repeats=a.repeats)
                    print(f"  {f'Pallas tm={tm} {name}':<34}"
                          f"{cell(t, fl, peak)}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  Pallas tm={tm} {name}: {type(e).__name__} {str(e)[:160]}")
        perm = [("layout (no sort)", jax.jit(_permute.padded_layout, static_argnums=(1, 2)),
                 (group_M, E, 256)),
                ("argsort", jax.jit(lambda g: jnp.argsort(g, stable=True)), (group_M,)),
                ("gather rows x[idx]", jax.jit(lambda x, i: x[i]), (x_TD, jnp.argsort(group_M) // K))]
        for name, f, args in perm:
            t = median_s(f, *args, repeats=a.repeats)
            print(f"  {name:<34}{t * 1e3:8.3f} ms", flush=True)
        self.gathers(group_M, E, K, T, D)

    def gathers(self, group_M, E, K, T, D) -> None:
        """Gathers of rows by the layout's indices out of tables of several sizes: what
        XLA:TPU charges per index (the sort's gather reads T tokens, the combine's the P
        slots), timed alone (each median holds a call's dispatch too)."""
        a = self.args
        lay = jax.jit(_permute.padded_layout, static_argnums=(1, 2))(group_M, E, 256)
        pos, src, P = lay.pos_M, lay.src_P, lay.rows
        take = jax.jit(lambda t, i: jnp.take(t, i, axis=0, mode="clip"))
        print(f"\ngathers of rows (bf16, by the layout's indices; P = {P} slots)")
        for rows, cols, idx, what in ((T + 1, D, src // K, "tokens to slots"),
                                      (P, D, pos, "slots to choices"),
                                      (P, D // 2, pos, "slots to choices"),
                                      (P, D // 8, pos, "slots to choices"),
                                      (P // 2, D, pos % (P // 2), "smaller table"),
                                      (P // 5, D, pos % (P // 5), "smaller table"),
                                      (T, D, pos % T, "smaller table")):
            table = jax.random.normal(jax.random.key(5), (rows, cols), jnp.bfloat16)
            t = median_s(take, table, idx, repeats=a.repeats)
            print(f"  {f'{idx.shape[0]} rows of {rows} x {cols} ({what})':<50}{t * 1e3:8.3f} ms",
                  flush=True)

    # ---- training steps ----

    def step_program(self, row: str, path: str, tiling: tuple[int, int] | None = None):
        """The compiled training step of `row` on `path` (at `tiling`, a row tile and block,
        when given), its arguments, the FLOPs counted for MFU and its compile seconds."""
        a = self.args
        if row == DENSE_ROW:
            return self.dense_step_program()
        E, K = row_sizes(row, a)
        D, F, T = a.emb, a.mlp, a.batch * a.seq
        flops = 3 * 3 * 2 * T * K * D * F
        mesh = jax.make_mesh((1, 1), ("data", "context"), axis_types=(AxisType.Auto,) * 2,
                             devices=jax.devices()[:1])
        cfg = moe.MoeConfig(num_experts=E, top_k=K, emb_dim=D, mlp_dim=F, dtype=jnp.bfloat16)
        if row.startswith("Qwen3-Next"):
            cfg = dataclasses.replace(cfg, softmax_before_topk=True, norm_topk_prob=True)
            layer = moe.Qwen3NextSparseMoeBlock(cfg, mesh, batch_axes=(), seq_axes=())
            flops += 3 * 3 * 2 * T * D * cfg.shared_dim
        elif row.startswith("ShardedRoutedMoE"):
            layer = moe.ShardedRoutedMoE(cfg, mesh, batch_axes=(), seq_axes=())
        else:
            layer = moe.RoutedMoE(cfg)
        _, params, x_BSD = self.data(E, K, init=layer.init)

        kernel, tm, bm = dict(PATHS)[path]
        tm, bm = tiling or (tm, bm)

        def loss(p, x):
            with self.kernel(kernel, tm, bm):
                return jnp.mean(jnp.square(layer(p, x).astype(jnp.float32)))
        t0 = time.perf_counter()
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x_BSD).compile()
        return compiled, (params, x_BSD), flops, time.perf_counter() - t0

    def dense_step_program(self):
        """The training step of a dense SwiGLU MLP with hidden K * F (MaxText's MlpBlock,
        what that user ran instead of the routed layer): the expert FLOPs of the routed
        layer, all of them useful."""
        a = self.args
        D, H, T = a.emb, a.top_k * a.mlp, a.batch * a.seq
        rng = np.random.default_rng(0)
        draw = lambda shape: jax.device_put((rng.standard_normal(shape, np.float32)
                                             * shape[0] ** -0.5).astype(jnp.bfloat16))
        params = {"wi_0": draw((D, H)), "wi_1": draw((D, H)), "wo": draw((H, D))}
        x_BSD = jax.random.normal(jax.random.key(1), (a.batch, a.seq, D), jnp.bfloat16)

        def loss(p, x):
            y = _experts.swiglu(x, p["wi_0"], p["wi_1"], p["wo"])
            return jnp.mean(jnp.square(y.astype(jnp.float32)))
        t0 = time.perf_counter()
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x_BSD).compile()
        return compiled, (params, x_BSD), 3 * 3 * 2 * T * D * H, time.perf_counter() - t0

    def step_row(self, row: str, path: str,
                 tiling: tuple[int, int] | None = None) -> dict[str, Any]:
        before = (self.dev.memory_stats() or {}).get("peak_bytes_in_use", 0)
        compiled, args, flops, compile_s = self.step_program(row, path, tiling)
        ma = compiled.memory_analysis()
        s = median_s(compiled, *args, repeats=self.args.repeats)
        chip_peak = (self.dev.memory_stats() or {}).get("peak_bytes_in_use", 0)
        if tiling:
            row = f"{row} tm={tiling[0]} bm={tiling[1]}"
        return {"row": row, "path": path, "s": s, "flops": flops, "compile_s": compile_s,
                "temp": ma.temp_size_in_bytes, "xla_peak": getattr(ma, "peak_memory_in_bytes", 0),
                "chip_peak": chip_peak, "chip_peak_set_before": chip_peak <= before,
                "peak": self.peak}


def print_step(r: dict[str, Any]) -> None:
    gib = lambda b: f"{b / 2 ** 30:7.2f}"
    print(f"{r['row'] + ' (' + r['path'] + ')':<42}{cell(r['s'], r['flops'], r['peak']):>30}"
          f"{gib(r['temp'])}{gib(r['xla_peak'])}{gib(r['chip_peak'])}"
          f"{'*' if r.get('chip_peak_set_before') else ' '}{r['compile_s']:7.1f}", flush=True)


def goals(kern: dict[str, tuple[float, float]], steps: dict[tuple[str, str], dict],
          peak: float | None) -> int:
    """The goals of issues 34 and 43, from this run's figures."""
    fails = 0

    def check(ok: bool, text: str) -> None:
        nonlocal fails
        fails += not ok
        print(f"{'PASS' if ok else 'FAIL'}: {text}")

    def mfu(row: str, path: str = "now") -> float:
        r = steps[(row, path)]
        return r["flops"] / r["s"] / peak
    print()
    if ("ShardedRoutedMoE", "now") in steps and peak:
        others = ", ".join(f"{p} {100 * mfu('ShardedRoutedMoE', p):.1f}%" for p, _ in PATHS
                           if p != "now" and ("ShardedRoutedMoE", p) in steps)
        check(mfu("ShardedRoutedMoE") >= 0.55, f"ShardedRoutedMoE training step "
              f"{100 * mfu('ShardedRoutedMoE'):.1f}% expert MFU (>= 55%; {others})")
    for row in ("RoutedMoE E=8 top-2", "RoutedMoE E=128 top-8"):
        if (row, "now") in steps and peak:
            check(mfu(row) >= 0.50, f"{row} training step {100 * mfu(row):.1f}% expert MFU "
                  f"(>= 50%)")
    grouped = next((v for k, v in kern.items() if k.startswith("grouped SwiGLU Pallas")), None)
    dense = next((v for k, v in kern.items() if k.startswith("dense SwiGLU")), None)
    if grouped and dense:
        for i, (what, goal) in enumerate((("forward", 0.70), ("forward+backward", 0.85))):
            ratio = grouped[i] / dense[i]
            check(ratio >= goal, f"grouped SwiGLU (Pallas) / dense SwiGLU FLOP/s, {what}: "
                  f"{ratio:.3f} (>= {goal:.2f}; ragged_dot "
                  f"{kern['grouped SwiGLU ragged_dot'][i] / dense[i]:.3f})")
    r, s = steps.get(("RoutedMoE", "now")), steps.get(("ShardedRoutedMoE", "now"))
    if r and s:
        check(s["s"] / r["s"] <= 1.02, f"ShardedRoutedMoE / RoutedMoE step time "
              f"{s['s'] / r['s']:.3f} (<= 1.02)")
    for row in STEP_ROWS:
        for before in ("today", "issue 34"):
            if (row, before) in steps and (row, "now") in steps:
                ratio = steps[(row, "now")]["s"] / steps[(row, before)]["s"]
                check(ratio <= 1.0, f"{row}: now / {before}'s step time {ratio:.3f} (<= 1)")
    if ("ShardedRoutedMoE", "now") in steps and (DENSE_ROW, "dense") in steps and peak:
        ratio = steps[(DENSE_ROW, "dense")]["s"] / steps[("ShardedRoutedMoE", "now")]["s"]
        print(f"compare: ShardedRoutedMoE's training step {100 * mfu('ShardedRoutedMoE'):.1f}% "
              f"expert MFU, a dense MLP of the same FLOPs (hidden {STEP_H[0]}) "
              f"{100 * mfu(DENSE_ROW, 'dense'):.1f}% MFU (step time dense / routed {ratio:.3f})")
    return int(fails > 0)


STEP_H = [0]   # the dense MLP's hidden size, K * F (set by main)


def step_parts() -> list[tuple[str, tuple[str, ...]]]:
    """The training-step rows, each as (row, paths run in one process): now, then issue
    34's kernels and today's path (after now: the chip's peak is then now's), and the
    dense MLP. Six processes: with today's path in a process of its own (eleven), the full
    --isolate run outlasted the device tool's 10-minute call on a v5e (2026-12-06)."""
    return [(row, ("now", "issue 34", "today")) for row in STEP_ROWS] + [(DENSE_ROW, ("dense",))]


def main(argv=None) -> int:
    args = parse(argv)
    STEP_H[0] = args.top_k * args.mlp
    if args.part is None and args.isolate:
        return _isolated(args, argv if argv is not None else sys.argv[1:])
    backend = jax.default_backend()
    if backend != "tpu" and not args.allow_cpu:
        print(f"skip: no TPU (JAX backend is {backend!r}); this benchmark measures the MoE "
              f"layers on a TPU chip")
        return 3 if args.part else 0
    if backend != "tpu":
        args.seq, args.emb, args.mlp, args.experts, args.top_k, args.repeats = 64, 256, 128, 8, 2, 10
        STEP_H[0] = args.top_k * args.mlp
    bench = Bench(args)
    if args.part and args.part.startswith("step:"):
        _, row, paths = args.part.split(":")
        for path in paths.split(","):
            print("ROW " + json.dumps(bench.step_row(row, path)), flush=True)
        return 0
    if args.part and args.part.startswith("tilings:"):
        print(STEP_HEADER)
        for tiling in args.tilings:
            print_step(bench.step_row(args.part.split(":")[1], "now", tiling))
        return 0
    print(f"{bench.dev.device_kind} ({backend}), JAX {jax.__version__}; bf16, T={args.batch * args.seq} "
          f"tokens, E={args.experts}, top-{args.top_k}, D={args.emb}, F={args.mlp}; median of "
          f"{args.repeats}; peak {bench.peak and bench.peak / 1e12} TFLOP/s")
    kern = bench.kernel_rows()
    if args.part == "kernels":
        print("KERN " + json.dumps(kern), flush=True)
        return 0
    print(STEP_HEADER)
    steps = {}
    for row, paths in step_parts():
        for path in paths:
            r = bench.step_row(row, path)
            steps[(row, path)] = r
            print_step(r)
    if args.row_tiles and not bench.interpret:
        for tiling in args.tilings:
            print_step(bench.step_row("RoutedMoE", "now", tiling))
    return goals(kern, steps, bench.peak)


STEP_HEADER = (f"\n{'training step (value_and_grad), one chip':<42}{'step, expert MFU':>30}"
               f"{'temp':>7}{'XLA pk':>7}{'chip pk':>7}{'compile':>8}  (GiB, s; * the chip's "
               f"peak was reached before the step ran: not the step's)")


def _isolated(args, argv: list[str]) -> int:
    """Every part in a process of its own (the chip's peak memory is then the part's)."""
    base = [sys.executable, __file__, *argv]
    def child(part: str) -> tuple[int, list[str]]:
        proc = subprocess.run(base + ["--part", part], capture_output=True, text=True,
                              env=os.environ.copy())
        sys.stderr.write(proc.stderr[-2000:] if proc.returncode not in (0, 3) else "")
        return proc.returncode, proc.stdout.splitlines()
    rc, lines = child("kernels")
    for line in lines:
        if not line.startswith("KERN "):
            print(line, flush=True)
    if rc != 0:
        return 0 if rc == 3 else rc
    kern = json.loads(next(l for l in lines if l.startswith("KERN "))[5:])
    print(STEP_HEADER + "  (each row in its own process; issue 34's and today's after now's)")
    steps, peak = {}, None
    for row, paths in step_parts():
        rc, lines = child(f"step:{row}:{','.join(paths)}")
        found = [json.loads(l[4:]) for l in lines if l.startswith("ROW ")]
        for r in found:
            steps[(row, r["path"])], peak = r, r["peak"]
            print_step(r)
        if rc or len(found) < len(paths):
            print(f"{row} ({', '.join(paths)}): failed (exit {rc})", flush=True)
    return goals(kern, steps, peak)


if __name__ == "__main__":
    sys.exit(main())
