"""ShardedRoutedMoE beside the peer a user would pick instead: MaxText's sparse MoE on a TPU.

The peer is MaxText 0.2.5's RoutedMoE on its TPU default (`sparse_matmul=true`,
`megablox=true`, `use_tokamax_gmm=false`, `use_custom_sort_vjp=true`,
`float32_weight_sum=true`, no ring of experts, no ragged sort). MaxText needs Python >=
3.12 and JAX >= 0.11.1, the chip's machine has Python 3.11 and JAX 0.10.2, and MaxText's
own `maxtext.kernels.megablox.ops` imports qwix, tokamax and MaxText's quantization
layers; so its path is written here step for step from `maxtext/layers/moe.py` (`permute`,
`sparse_matmul`'s `gmm_up` and `gmm`, `unpermute`), on the megablox kernels JAX itself
ships (`jax.experimental.pallas.ops.tpu.megablox`, which MaxText's `kernels/megablox`
forked) at MaxText's default tiling: every `wi_tile_*` and `wo_tile_*` is 512 rows x 1024 x
1024, forward, dlhs and drhs alike, so JAX's gmm, which takes one tiling for its three
products, runs MaxText's tiles:

- route: the gate's logits in float32, top-k, softmax over the K (Mixtral's routing, the
  same as ShardedRoutedMoE's default);
- permute: argsort of the flat expert ids; the tokens repeated K times and sorted by it
  (`_sort_activations`, whose custom VJP unsorts by the inverse order); group sizes by
  bincount; rows padded to the 512-row tile;
- experts: gmm wi_0, gmm wi_1, silu(wi_0) * wi_1, gmm wo;
- unpermute: sorted back, [T, K, D] combined with the weights in float32.

Each row compiles both training steps (value_and_grad of mean(out**2) w.r.t. params and
x, as `tpu_moe.py` does) on the same params and tokens, checks that they compute the
same numbers, then times them alternately (--rounds medians of --repeats each, the median
of those), two ways: "call", each call waited for before the next (`tpu_moe.median_s`:
the host's dispatch and the wait are in every step), and "loop", the calls dispatched back
to back with one wait (`tpu_moe.loop_s`: as a training loop runs, the next step dispatched
while the chip runs this one). T=8192 tokens, D=2048, F=1024, at E=64 top-8, E=8 top-2 and
E=128 top-8. MFU counts the expert matmuls against the chip's dense bf16 peak. Before them, the kernel rows
of `tpu_moe.py` (megablox's grouped SwiGLU at MaxText's tiles beside shardlint's); after,
the goals of issue 53 as PASS / FAIL lines, each with its margin (exit status 1 on a FAIL).

    python benchmarks/tpu_moe_peer.py [--rounds 3] [--no-kernels]

Without a TPU it prints one skip line and exits 0 (--allow-cpu runs it with small sizes in
Pallas interpret mode, to check the script; those numbers mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpu_moe  # noqa: E402

ROWS = ("ShardedRoutedMoE", "ShardedRoutedMoE E=8 top-2", "ShardedRoutedMoE E=128 top-8")
# How a step is timed: each call waited for ("call"), or calls back to back ("loop").
HOW = ("call", "loop")
MAXTEXT_TILING = tpu_moe.MAXTEXT_TILING


@jax.custom_vjp
def sort_rows(x, order):
    """MaxText's `_sort_activations` with `use_custom_sort_vjp=True`."""
    return x[order]


def _sort_rows_fwd(x, order):
    return x[order], order


def _sort_rows_bwd(order, g):
    return g[jnp.argsort(order)], None


sort_rows.defvjp(_sort_rows_fwd, _sort_rows_bwd)


def maxtext_sparse_moe(params, x_BSD, top_k: int, tiling=MAXTEXT_TILING, interpret=False):
    """MaxText's sparse RoutedMoE forward on one chip (no expert or tensor parallelism)."""
    B, S, D = x_BSD.shape
    T, E = B * S, params["gate"].shape[1]
    x_TD = x_BSD.reshape(T, D)
    logits_TE = x_TD.astype(jnp.float32) @ params["gate"].astype(jnp.float32)
    top_TK, experts_TK = jax.lax.top_k(logits_TE, top_k)
    weights_TK = jax.nn.softmax(top_TK, axis=-1)
    flat_M = experts_TK.reshape(-1)
    order_M = jnp.argsort(flat_M)
    x_MD = sort_rows(jnp.repeat(x_TD, top_k, axis=0), order_M)
    sizes_E = jnp.bincount(flat_M, length=E).astype(jnp.int32)
    M = x_MD.shape[0]
    pad = -M % tiling[0]                      # max_utils.maybe_pad to the row tile

    def gmm(lhs, rhs):
        return tpu_moe.megablox_gmm(lhs, rhs, sizes_E, tiling, interpret)

    x_PD = jnp.pad(x_MD, ((0, pad), (0, 0)))
    h_PF = jax.nn.silu(gmm(x_PD, params["wi_0"])) * gmm(x_PD, params["wi_1"])
    y_MD = gmm(h_PF, params["wo"])[:M]
    y_TKD = sort_rows(y_MD, jnp.argsort(order_M)).reshape(T, top_k, D)
    out_TD = jnp.einsum("TKD,TK->TD", y_TKD.astype(jnp.float32), weights_TK)
    return out_TD.reshape(B, S, D).astype(x_BSD.dtype)


def peer_step(params, x_BSD, top_k: int, interpret: bool):
    """The peer's training step, compiled: value_and_grad w.r.t. (params, x)."""
    def loss(p, x):
        y = maxtext_sparse_moe(p, x, top_k, interpret=interpret)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x_BSD).compile()


def timed(compiled: dict, args: tuple, rounds: int, repeats: int) -> dict[str, dict[str, float]]:
    """Each step's seconds per call, taken in turn `rounds` times, the median of those: "call"
    (the median of `repeats` calls, each waited for) and "loop" (`repeats` calls back to
    back, one wait: a training loop's step)."""
    times = {name: {"call": [], "loop": []} for name in compiled}
    for _ in range(rounds):
        for name, step in compiled.items():
            times[name]["call"].append(tpu_moe.median_s(step, *args, repeats=repeats))
            times[name]["loop"].append(tpu_moe.loop_s(step, *args, calls=repeats))
    return {name: {how: statistics.median(t) for how, t in by.items()} for name, by in times.items()}


def compare_row(bench: tpu_moe.Bench, row: str, rounds: int) -> dict:
    ours, (params, x_BSD), flops, _ = bench.step_program(row, "now")
    _, top_k = tpu_moe.row_sizes(row, bench.args)
    peer = peer_step(params, x_BSD, top_k, bench.interpret)
    (loss_o, grads_o), (loss_p, grads_p) = ours(params, x_BSD), peer(params, x_BSD)
    same = {"loss": abs(float(loss_o) - float(loss_p)) / abs(float(loss_p)),
            "gradients": tpu_moe.rel_err(grads_o, grads_p)}
    s = timed({"ours": ours, "peer": peer}, (params, x_BSD), rounds, bench.args.repeats)
    return {"row": row, "flops": flops, "ours": s["ours"], "peer": s["peer"], "same": same,
            "temp": {"ours": ours.memory_analysis().temp_size_in_bytes,
                     "peer": peer.memory_analysis().temp_size_in_bytes}}


def print_row(r: dict, peak: float | None) -> None:
    gib = lambda b: f"{b / 2 ** 30:6.2f}"
    for how in HOW:
        ours, peer = r["ours"][how], r["peer"][how]
        print(f"{r['row'] + ' (' + how + ')':<36}{tpu_moe.cell(ours, r['flops'], peak):>30}"
              f"{tpu_moe.cell(peer, r['flops'], peak):>30}{peer / ours:>8.3f}"
              f"{gib(r['temp']['ours'])}{gib(r['temp']['peer'])}   "
              f"{r['same']['loss']:.1e} {r['same']['gradients']:.1e}", flush=True)


def goals(rows: list[dict], kern: dict | None, peak: float | None) -> int:
    """Issue 53's goals, each with its margin."""
    fails = 0

    def check(value: float, goal: float, text: str) -> None:
        nonlocal fails
        fails += value < goal
        verdict = "PASS" if value >= goal else f"FAIL (short by {goal - value:.3f})"
        print(f"{verdict}: {text} {value:.3f} (>= {goal})")
    print()
    for how in HOW:
        for r in rows:
            check(r["peer"][how] / r["ours"][how], 1.2,
                  f"{r['row']}: the peer's step time / ours ({how})")
        for r, goal in zip(rows, (0.60, 0.55, 0.55)):
            if peak:
                check(r["flops"] / r["ours"][how] / peak, goal, f"{r['row']}: expert MFU ({how})")
    if kern:
        grouped = next(v for k, v in kern.items() if k.startswith("grouped SwiGLU Pallas"))
        dense = next(v for k, v in kern.items() if k.startswith("dense SwiGLU"))
        check(grouped[1] / dense[1], 0.90, "grouped SwiGLU (Pallas) / dense SwiGLU FLOP/s, "
              "forward+backward")
    return int(fails > 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--no-kernels", action="store_true", help="skip tpu_moe.py's kernel rows")
    p.add_argument("--allow-cpu", action="store_true")
    args = p.parse_args(argv)
    backend = jax.default_backend()
    if backend != "tpu" and not args.allow_cpu:
        print(f"skip: no TPU (JAX backend is {backend!r}); this benchmark times MoE steps on a "
              f"TPU chip")
        return 0
    bench_argv = ["--repeats", str(args.repeats)] + (["--allow-cpu"] if args.allow_cpu else [])
    bench_args = tpu_moe.parse(bench_argv)
    if backend != "tpu":
        bench_args.seq, bench_args.emb, bench_args.mlp = 64, 256, 128
        bench_args.experts, bench_args.top_k = 8, 2
    bench = tpu_moe.Bench(bench_args)
    a = bench_args
    print(f"{bench.dev.device_kind} ({backend}), JAX {jax.__version__}; bf16, T={a.batch * a.seq}"
          f" tokens, D={a.emb}, F={a.mlp}; the peer: MaxText 0.2.5's sparse path on JAX's "
          f"megablox gmm, tiling {MAXTEXT_TILING}; medians of {args.rounds} x {a.repeats}")
    # The kernel rows first: the step rows' params (1.5 GiB at E=128) would crowd them out.
    kern = None if args.no_kernels else bench.kernel_rows()
    bench.forget_data()
    print(f"\n{'training step, one chip':<36}{'ShardedRoutedMoE':>30}{'MaxText sparse (peer)':>30}"
          f"{'peer/us':>8}{'temp GiB us, peer':>18}   |loss|, |grad| rel. diff")
    rows = []
    for row in ROWS if backend == "tpu" else ROWS[:2]:
        rows.append(compare_row(bench, row, args.rounds))
        print_row(rows[-1], bench.peak)
        bench.forget_data()
    return goals(rows, kern, bench.peak)


if __name__ == "__main__":
    sys.exit(main())
