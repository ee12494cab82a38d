"""Each grouped-SwiGLU kernel alone, and the whole SwiGLU forward+backward, under variants
of the Plan (`_plan.Plan`: pow2, tgmm_chunk) and of the SwiGLU's sigmoid, on a TPU
chip; rows routed at random (T tokens, top-K of E experts), D x F. A probe for issue 43.

    python benchmarks/tpu_gmm_probe.py [--experts 64 128] [--what kernels,swiglu,silu]
        [--plans "base;pow2;pow2,c4"] [--swiglu-plans ...] [--kernels "up;tgmm x,dh0"]
        [--steps "RoutedMoE E=8 top-2;..."]

A plan is comma-separated: base (blocks of 4 tiles, a loop over a short visit's tiles),
pow2, cN (the weight gradient's runs of N tiles from each group's first tile); "+NAME"
after a SwiGLU plan picks the sigmoid (cur: the library's; exp, tanh, logistic, recip;
none: no sigmoid, a timing floor). --steps times tpu_moe.py's training-step rows ("now").
(Issue 43 also tried dh0, dh1 and dx of the backward pass in one kernel here, at a418b83:
9.21 ms alone against 2.92 + 3.97, the SwiGLU forward+backward 19.68 against 16.93 ms;
removed. At 663ad63 it tried the two input weights' gradients from one pass over x, one
`_tgmm` with two accumulators at a VMEM limit of 96 MiB: 7.14 ms alone against 4.58 for
the two passes, the SwiGLU 19.54 against 16.92 ms; removed, benchmarks/README.md.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from shardlint.moe.layers import _experts  # noqa: E402
from shardlint.moe.kernels import _gmm
from shardlint.moe.kernels import _kernels as _gmm_kernels
from shardlint.moe.kernels import _plan as _gmm_plan
from shardlint.moe.kernels import _permute
from _common import median_seconds  # noqa: E402

PEAK = 197e12
_CUR = _gmm_kernels.silu_parts   # the library's: the sigmoid as 0.5 tanh(h0 / 2) + 0.5


def _with_sigmoid(sigmoid):
    """silu(h0) and its derivative, with the sigmoid computed by `sigmoid`."""
    def parts(h0):
        sig = sigmoid(h0)
        return h0 * sig, sig * (1.0 + h0 * (1.0 - sig))
    return parts


def _reciprocal(h0):
    from jax.experimental import pallas as pl
    return pl.reciprocal(1.0 + jnp.exp(-h0), approx=True)


SILU = {"cur": _CUR, "tanh": _CUR,
        "exp": _with_sigmoid(lambda h0: 1.0 / (1.0 + jnp.exp(-h0))),
        "logistic": _with_sigmoid(jax.nn.sigmoid), "recip": _with_sigmoid(_reciprocal),
        "none": lambda h0: (h0, h0)}   # a timing floor only: wrong numbers


def _median_ms(label: str, f, *args) -> float | None:
    """The median of 20 timed calls after 2 untimed ones, in ms; None (and a line saying
    why) when `f` does not compile or run."""
    try:
        return 1e3 * median_seconds(f, *args, repeats=20, warmup=2)
    except Exception as e:  # noqa: BLE001
        print(f"  {label}FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None


def case(T, E, K, D, F, tm=128, bm=512):
    rng = np.random.default_rng(0)
    top = np.argsort(-rng.standard_normal((T, E)), axis=1)[:, :K]
    group_M = jnp.asarray(top.reshape(-1), jnp.int32)
    lay = jax.jit(_permute.padded_layout, static_argnums=(1, 2, 3))(group_M, E, tm, bm)
    P = lay.rows
    k = jax.random.split(jax.random.key(0), 8)
    n = lambda i, s, sc=1.0: (jax.random.normal(k[i], s, jnp.float32) * sc).astype(jnp.bfloat16)
    arrays = dict(x=n(0, (P, D)), h=n(1, (P, F)), dy=n(2, (P, D)), dh0=n(3, (P, F)),
                  dh1=n(4, (P, F)), wi_0=n(5, (E, D, F), D ** -0.5),
                  wi_1=n(6, (E, D, F), D ** -0.5), wo=n(7, (E, F, D), F ** -0.5))
    return lay, arrays


def kernels(lay, a, p, E):
    tg, nt = lay.tile_group_I, lay.num_tiles
    return {
        "up": (lambda x, w0, w1: _gmm_kernels.up(x, w0, w1, tg, nt, p),
               (a["x"], a["wi_0"], a["wi_1"]), 2),
        "gmm": (lambda h, w: _gmm_kernels.gmm(h, w, tg, nt, p, transpose_rhs=False),
                (a["h"], a["wo"]), 1),
        "down_grad": (lambda dy, w, h0, h1: _gmm_kernels.down_grad(dy, w, h0, h1, tg, nt, p),
                      (a["dy"], a["wo"], a["dh0"], a["dh1"]), 1),
        "up_grad": (lambda d0, d1, w0, w1: _gmm_kernels.up_grad(d0, d1, w0, w1, tg, nt, p),
                    (a["dh0"], a["dh1"], a["wi_0"], a["wi_1"]), 2),
        "tgmm x,dh0": (lambda x, d: _gmm_kernels.tgmm(x, d, tg, nt, E, p, jnp.bfloat16),
                       (a["x"], a["dh0"]), 1),
        "tgmm h,dy": (lambda h, d: _gmm_kernels.tgmm(h, d, tg, nt, E, p, jnp.bfloat16),
                      (a["h"], a["dy"]), 1),
    }


def swiglu_vjp(lay, p):
    tg, nt = lay.tile_group_I, lay.num_tiles

    def run(w, x, ct):
        y, back = jax.vjp(lambda w, x: _gmm.tiled_swiglu(x, *w, tg, nt, p), w, x)
        return y, back(ct)
    return jax.jit(run)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, nargs="+", default=[64])
    ap.add_argument("--what", default="kernels,swiglu,silu")
    ap.add_argument("--plans", default="base;pow2;pow2,c4;pow2,c8")
    ap.add_argument("--swiglu-plans", default=None)
    ap.add_argument("--silu", default="exp,tanh,logistic,recip,none")
    ap.add_argument("--kernels", default=None, help="only these kernels (;-separated)")
    ap.add_argument("--steps", default="", help="tpu_moe.py step rows, ';'-separated")
    ap.add_argument("--tile", type=int, default=128,
                    help="the layout's row tile (blocks of max(tile, 512) rows by default)")
    ap.add_argument("--interpret", action="store_true", help="tiny sizes, to check the script")
    args = ap.parse_args(argv)
    T, D, F = (8192, 2048, 1024) if not args.interpret else (64, 256, 128)
    what = args.what.split(",")
    if jax.default_backend() != "tpu" and not args.interpret:
        print(f"skip: no TPU (JAX backend is {jax.default_backend()!r}); this probe times "
              f"the grouped-matmul kernels on a TPU chip (--interpret: tiny sizes, anywhere)")
        return 0

    def plan_of(spec, tm=args.tile):
        kw = {}
        for part in spec.split(","):
            if part == "pow2":
                kw["pow2"] = True
            elif part.startswith("c"):
                kw["tgmm_chunk"] = int(part[1:])
            elif part.startswith("bm"):
                kw["nsub"] = int(part[2:]) // tm
        return _gmm_plan.Plan(tm, nsub=kw.pop("nsub", max(1, 512 // tm)),
                              interpret=args.interpret, **kw)

    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    for E in args.experts:
        K = 2 if E == 8 else 8
        lay, a = case(T, E, K, D, F, args.tile, max(args.tile, 512))
        fl = 2 * T * K * D * F
        computed = 2 * int(lay.num_tiles) * args.tile * D * F   # padding rows too
        print(f"\nE={E} K={K}: P={lay.rows} tiles of {args.tile} rows used "
              f"{int(lay.num_tiles)}; kernels: ms, TF/s and % of peak of the routed rows' "
              f"FLOPs, % of peak of the rows computed (padding too)", flush=True)
        if "kernels" in what:
            for spec in args.plans.split(";"):
                p = plan_of(spec)
                for name, (f, xs, prods) in kernels(lay, a, p, E).items():
                    if "c" in spec and not name.startswith("tgmm"):
                        continue
                    if args.kernels and name not in args.kernels.split(";"):
                        continue
                    if (ms := _median_ms(f"{spec:<14}{name:<12}", jax.jit(f), *xs)) is not None:
                        print(f"  {spec:<14}{name:<12}{ms:8.3f} ms {prods * fl / ms / 1e9:7.1f} TF/s "
                              f"{100 * prods * fl / ms / 1e9 / (PEAK / 1e12):5.1f}% "
                              f"{100 * prods * computed / ms / 1e9 / (PEAK / 1e12):5.1f}%", flush=True)
        if "silu" in what:
            p = plan_of("base")
            ks = kernels(lay, a, p, E)
            for sname in args.silu.split(","):
                _gmm_kernels.silu_parts = SILU[sname]
                for name in ("up", "down_grad"):
                    f, xs, prods = ks[name]
                    if (ms := _median_ms(f"silu={sname:<9}{name:<12}", jax.jit(f), *xs)) is not None:
                        print(f"  silu={sname:<9}{name:<12}{ms:8.3f} ms {prods * fl / ms / 1e9:7.1f} TF/s", flush=True)
            _gmm_kernels.silu_parts = _CUR
        if "swiglu" in what:
            ct = a["dy"]
            w = (a["wi_0"], a["wi_1"], a["wo"])
            ref = None
            for spec in (args.swiglu_plans or args.plans).split(";"):
                sname = "cur"
                if "+" in spec:
                    spec, sname = spec.split("+")
                _gmm_kernels.silu_parts = SILU[sname]
                fn = swiglu_vjp(lay, plan_of(spec))
                if (ms := _median_ms(f"swiglu {spec}: ", fn, w, a["x"], ct)) is not None:
                    out = fn(w, a["x"], ct)
                    used = int(lay.num_tiles) * 128
                    out = (out[0][:used], out[1][0], out[1][1][:used])
                    ref = ref if ref is not None else out
                    err = max(float(jnp.max(jnp.abs(u.astype(jnp.float32) - r.astype(jnp.float32)))
                                    / jnp.max(jnp.abs(r.astype(jnp.float32))))
                              for u, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
                    print(f"  swiglu fwd+bwd {spec + '+' + sname:<20}{ms:8.3f} ms "
                          f"{3 * 3 * fl / ms / 1e9:7.1f} TF/s  (vs the first: {err:.2e})", flush=True)
                _gmm_kernels.silu_parts = _CUR
            if E == 64:
                H = K * F
                kd = jax.random.split(jax.random.key(2), 4)
                dense = (jax.random.normal(kd[0], (D, H), jnp.bfloat16) * D ** -0.5,
                         jax.random.normal(kd[1], (D, H), jnp.bfloat16) * D ** -0.5,
                         jax.random.normal(kd[2], (H, D), jnp.bfloat16) * H ** -0.5)
                xT = jax.random.normal(kd[3], (T, D), jnp.bfloat16)

                def dense_run(w, x, ct):
                    y, back = jax.vjp(lambda w, x: _experts.swiglu(x, *w), w, x)
                    return y, back(ct)
                ms = 1e3 * median_seconds(jax.jit(dense_run), dense, xT, xT, repeats=20, warmup=2)
                print(f"  dense SwiGLU fwd+bwd{'':<20}{ms:8.3f} ms {3 * 3 * fl / ms / 1e9:7.1f} TF/s", flush=True)

    if args.steps:
        steps(args)


def steps(args):
    """Training steps of tpu_moe.py's rows, the layer's own plan ("now")."""
    import tpu_moe
    targs = tpu_moe.parse([])
    if args.interpret:
        targs.seq, targs.emb, targs.mlp, targs.experts, targs.top_k = 64, 256, 128, 8, 2
    bench = tpu_moe.Bench(targs)
    for row in args.steps.split(";"):
        tpu_moe.print_step(bench.step_row(row, "now"))


if __name__ == "__main__":
    sys.exit(main())
