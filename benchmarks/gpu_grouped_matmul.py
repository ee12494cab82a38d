"""MFU of the routed experts' grouped matmul against a dense MLP of equal active FLOPs, on
an NVIDIA GPU.

The cheap way out of the lost sequence sharding is to replace the routed MoE by a dense
MLP, which keeps the sharding but drops the routing. DESIGN.md quotes what that costs on
a TPU v5p at sequence 8192: grouped matmul 29.01% MFU, dense MLP 27.82%. This script
measures the same comparison on a GPU, in bf16, with a real MoE's token layout: T tokens
(--batch x --seq, 8192 by default), E=64 experts, top-8, D=2048, F=1024, so T*K rows
sorted by expert with the group sizes a router gives (random tokens through a random
router: uneven, as at initialisation).

Rows, each forward and forward+backward (a VJP with respect to the weights and the input:
three times the forward FLOPs):
  grouped SwiGLU   three `jax.lax.ragged_dot` over the T*K rows already sorted by expert;
                   the line above the table says what XLA compiled them to (a kept
                   ragged-dot, a cuDNN fusion, or dense cuBLAS products over every expert)
  capacity SwiGLU  the same rows in [E, C, D] expert slots, C the largest group (nothing
                   drops), three expert-batched einsums: the grouped matmul as dense
                   batched GEMMs, about E*C/(T*K) times the useful FLOPs
  dense SwiGLU     hidden K*F over the T tokens: the same FLOPs, no routing
  routed MoE layer `shardlint.moe.RoutedMoE` end to end (route, sort, grouped matmuls,
                   unsort, combine), credited with the expert matmuls' FLOPs only, so its
                   gap to the grouped row is what routing and sorting cost
  bf16 matmul      one --ceiling^3 product (8192): the ceiling this machine reaches in
                   practice

Then the two MoE layers as a training step (value_and_grad of a scalar loss w.r.t. the
params and x) on a one-device mesh: `RoutedMoE` and `ShardedRoutedMoE` (its shard_map over
that mesh, nothing to gather: on one device the two do the same work, so their ratio is
what the sharded layer's structure costs), each with its median step time and XLA's temp
memory from `memory_analysis()`.

Times are medians of --repeats calls after two warm-up calls, each ended with
`jax.block_until_ready`. MFU = model FLOPs / median time / peak dense bf16 FLOP/s, the
peak taken from a small table by `device_kind` (H100/H200 989e12, H100 NVL 835e12, H100
PCIe 756e12, A100 312e12); for other devices it prints "unknown peak" and the achieved
TFLOP/s only. Where XLA expands `ragged_dot` into a dense masked product (as on CPU) the
grouped rows do about E times the useful work; MFU counts only the useful FLOPs, so that
shows as a low MFU.

    python benchmarks/gpu_grouped_matmul.py [--seq 8192 --batch 1 --experts 64 ...]

On a machine without a GPU backend it prints one skip line and exits 0 (`--allow-cpu`
runs it anyway, to check the script with small sizes; those numbers mean nothing).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from _common import median_seconds  # noqa: E402
from shardlint import moe  # noqa: E402
from shardlint.analyzer.parse._hlo import parse_hlo  # noqa: E402
from shardlint.moe.layers import _experts as moe_experts  # noqa: E402

# Dense bf16 peak FLOP/s by device_kind (datasheet, no sparsity), most specific first.
PEAKS = (("h100 pcie", 756e12), ("h100 nvl", 835e12), ("h100", 989e12), ("h200", 989e12),
         ("a100", 312e12))


def peak_flops(device_kind: str) -> float | None:
    kind = device_kind.lower()
    return next((peak for name, peak in PEAKS if name in kind), None)


def grouped_swiglu(w, x_MD, sizes_E):
    h0_MF = jax.lax.ragged_dot(x_MD, w["wi_0"], sizes_E)
    h1_MF = jax.lax.ragged_dot(x_MD, w["wi_1"], sizes_E)
    return jax.lax.ragged_dot(jax.nn.silu(h0_MF) * h1_MF, w["wo"], sizes_E)


def capacity_swiglu(w, x_ECD):
    """The grouped matmul as expert-batched einsums over [E, C, D] slots (capacity C)."""
    return moe_experts.batched_swiglu(x_ECD, w["wi_0"], w["wi_1"], w["wo"])


def dense_swiglu(w, x_TD):
    h0_TH = x_TD @ w["wi_0"]
    h1_TH = x_TD @ w["wi_1"]
    return (jax.nn.silu(h0_TH) * h1_TH) @ w["wo"]


def forward_and_backward(f: Callable) -> Callable:
    """VJP of f(w, x, *rest) at a fixed cotangent: grads of the weights and the input."""
    def run(w, x, *rest_and_ct):
        *rest, ct = rest_and_ct
        _, vjp = jax.vjp(lambda w, x: f(w, x, *rest), w, x)
        return vjp(ct)
    return jax.jit(run)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in dict(batch=1, seq=8192, experts=64, top_k=8, emb=2048, mlp=1024,
                            repeats=20, ceiling=8192).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run without a GPU backend (checks the script; numbers mean nothing)")
    return parser.parse_args()


def main() -> int:
    args = parse()
    backend = jax.default_backend()
    if backend not in ("gpu", "cuda", "rocm") and not args.allow_cpu:
        print(f"skip: no GPU backend (JAX backend is {backend!r}); this benchmark measures "
              f"grouped-matmul MFU on an NVIDIA GPU")
        return 0
    device = jax.devices()[0]
    peak = peak_flops(device.device_kind)
    T, E, K = args.batch * args.seq, args.experts, args.top_k
    D, F, M, H = args.emb, args.mlp, args.batch * args.seq * args.top_k, args.top_k * args.mlp
    cfg = moe.MoeConfig(num_experts=E, top_k=K, emb_dim=D, mlp_dim=F, dtype=jnp.bfloat16)
    keys = jax.random.split(jax.random.key(0), 4)
    experts = moe.init_moe_params(keys[0], cfg)
    grouped_w = {k: experts[k] for k in ("wi_0", "wi_1", "wo")}
    dense_w = {"wi_0": jax.random.normal(keys[1], (D, H), jnp.bfloat16) * D ** -0.5,
               "wi_1": jax.random.normal(keys[2], (D, H), jnp.bfloat16) * D ** -0.5,
               "wo": jax.random.normal(keys[3], (H, D), jnp.bfloat16) * H ** -0.5}
    x_TD = jax.random.normal(jax.random.key(1), (T, D), jnp.bfloat16)
    # The token layout a router produces: each token's K experts, rows sorted by expert.
    _, experts_TK = jax.jit(moe.route, static_argnums=2)(x_TD, experts["gate"], cfg)
    order_M = jnp.argsort(experts_TK.reshape(M))
    x_MD = jnp.repeat(x_TD, K, axis=0)[order_M]
    sizes_E = jnp.bincount(experts_TK.reshape(M), length=E).astype(jnp.int32)
    x_BSD = x_TD.reshape(args.batch, args.seq, D)
    # The same sorted rows in per-expert slots of the largest group's size: nothing drops.
    C = int(sizes_E.max())
    expert_M = jnp.sort(experts_TK.reshape(M))
    slot_M = jnp.arange(M) - (jnp.cumsum(sizes_E) - sizes_E)[expert_M]
    x_ECD = jnp.zeros((E, C, D), jnp.bfloat16).at[expert_M, slot_M].set(x_MD)
    layer = moe.RoutedMoE(cfg)
    ct = {"grouped": jnp.ones((M, D), jnp.bfloat16), "dense": jnp.ones((T, D), jnp.bfloat16),
          "capacity": jnp.ones((E, C, D), jnp.bfloat16),
          "layer": jnp.ones((args.batch, args.seq, D), jnp.bfloat16)}
    flops = 3 * 2 * M * D * F  # forward; dense: 3 * 2 * T * D * (K * F), the same
    cases = [
        ("grouped SwiGLU (ragged_dot)", grouped_swiglu, grouped_w, x_MD, (sizes_E,), ct["grouped"]),
        (f"capacity SwiGLU (C={C}, einsum)", capacity_swiglu, grouped_w, x_ECD, (),
         ct["capacity"]),
        (f"dense SwiGLU (hidden {H})", dense_swiglu, dense_w, x_TD, (), ct["dense"]),
        ("routed MoE layer (RoutedMoE)", lambda w, x: layer(w, x), experts, x_BSD, (), ct["layer"]),
    ]
    print(f"{device.device_kind} ({backend}); bf16, T={T} tokens (batch {args.batch} x seq "
          f"{args.seq}), E={E}, top_k={K}, D={D}, F={F}; sizes per expert "
          f"min {int(sizes_E.min())} / max {int(sizes_E.max())} of {M} rows; "
          f"median of {args.repeats}")
    print("peak: " + (f"{peak / 1e12:.0f} TFLOP/s dense bf16" if peak else
                      f"unknown peak for {device.device_kind!r}: MFU not computed"))
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; ragged_dot compiles to: "
          + _lowering(grouped_swiglu, grouped_w, x_MD, sizes_E))
    print(f"\n{'':<32}{'forward':>28}{'forward+backward':>28}")
    results = {}
    for name, f, w, x, rest, cotangent in cases:
        fwd = median_seconds(jax.jit(f), w, x, *rest, repeats=args.repeats, warmup=2)
        both = median_seconds(forward_and_backward(f), w, x, *rest, cotangent,
                              repeats=args.repeats, warmup=2)
        results[name] = (flops / fwd, 3 * flops / both)
        print(f"{name:<32}{_cell(fwd, flops, peak):>28}{_cell(both, 3 * flops, peak):>28}",
              flush=True)
    n = args.ceiling
    a = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    t = median_seconds(jax.jit(lambda a: a @ a), a, repeats=args.repeats, warmup=2)
    print(f"{f'bf16 matmul {n}^3 (ceiling)':<32}{_cell(t, 2 * n ** 3, peak):>28}")
    dense_fwd, dense_both = results[cases[2][0]]
    for name in (cases[0][0], cases[1][0]):
        fwd, both = results[name]
        print(f"{name} / dense SwiGLU achieved FLOP/s: forward {fwd / dense_fwd:.3f}, "
              f"forward+backward {both / dense_both:.3f}")
    print(f"(TPU v5p in DESIGN.md, grouped matmul / dense MLP: 29.01% / 27.82% MFU = "
          f"{29.01 / 27.82:.3f})")
    _layer_steps(cfg, experts, x_BSD, args.repeats, peak, 3 * flops)
    return 0


def _layer_steps(cfg: moe.MoeConfig, params, x_BSD, repeats: int, peak: float | None,
                 flops: float) -> None:
    """RoutedMoE vs ShardedRoutedMoE as a training step on a one-device mesh."""
    mesh = jax.make_mesh((1, 1), ("data", "context"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:1])
    layers = {"RoutedMoE": moe.RoutedMoE(cfg),
              "ShardedRoutedMoE": moe.ShardedRoutedMoE(cfg, mesh, batch_axes=(),
                                                       seq_axes=())}
    print(f"\ntraining step (value_and_grad w.r.t. params and x), one device; MFU counts "
          f"the expert matmuls only\n{'':<32}{'step':>28}{'temp MiB':>12}")
    times = {}
    for name, layer in layers.items():
        loss = lambda p, x, layer=layer: jnp.mean(jnp.square(layer(p, x).astype(jnp.float32)))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        compiled = step.lower(params, x_BSD).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
        times[name] = median_seconds(compiled, params, x_BSD, repeats=repeats, warmup=2)
        print(f"{name:<32}{_cell(times[name], flops, peak):>28}{temp:12.1f}", flush=True)
    print(f"ShardedRoutedMoE / RoutedMoE step time: "
          f"{times['ShardedRoutedMoE'] / times['RoutedMoE']:.3f}")


def _lowering(f: Callable, *args) -> str:
    """What XLA made of the ragged_dots: the instructions of the compiled forward that
    carry them (ragged-dot kept, a cuDNN or cuBLAS custom call, or dense dots), read with
    shardlint's HLO parser."""
    ops = collections.Counter()
    for instr in parse_hlo(jax.jit(f).lower(*args).compile().as_text()).instructions():
        if instr.opcode == "ragged-dot":
            ops["ragged-dot"] += 1
        elif instr.opcode == "custom-call" and instr.custom_call_target:
            ops[f"custom-call {instr.custom_call_target}"] += 1
        elif instr.opcode == "dot":
            ops[f"dot {', '.join(map(str, instr.result))}"] += 1
    return ", ".join(f"{n} x {op}" for op, n in ops.most_common()) or "nothing recognised"


def _cell(seconds: float, flops: float, peak: float | None) -> str:
    rate = flops / seconds
    mfu = f"{100 * rate / peak:5.2f}% MFU" if peak else "unknown peak"
    return f"{seconds * 1e3:8.2f} ms {rate / 1e12:7.1f} TF/s {mfu}"


if __name__ == "__main__":
    sys.exit(main())
