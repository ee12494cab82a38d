"""Median training-step time of the three MoE stand-ins at context 8, side by side.

8 simulated CPU devices, mesh data=1 x context=8, x sharded over the sequence: the
reference RoutedMoE, ShardedRoutedMoE and a dense MLP of equal active FLOPs (hidden =
top_k * mlp_dim), each a jitted value_and_grad step, warmed up, then timed as the median
of `--repeats` runs in one process, with ratios to ShardedRoutedMoE.

On CPU `jax.lax.ragged_dot` is a dense masked fallback (about num_experts times the
FLOPs of a real grouped matmul), so the MoE rows here overstate the MoE cost relative to
the dense MLP; the reference-vs-sharded ratio is the meaningful one. The 8 simulated
devices share this host's cores, so work that every device repeats (the reference computes
all tokens on every device after its all-gather) costs up to 8x wall time here; on real
accelerators the same waste shows up as memory and all-gather traffic instead. Timings on a
shared host are noisy: compare ratios from one run, not across runs.

    python benchmarks/moe_step_time.py [--repeats 5 --seq 2048 ...]
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")  # simulated devices even where libtpu is installed

import _common  # noqa: E402

CONTEXT = 8


def _host_cores() -> int:
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def main() -> int:
    args = _common.parse_sizes(__doc__.splitlines()[0], repeats=5, warmup=1)
    cfg = _common.config(args)
    mesh = _common.mesh_for(CONTEXT)
    shape = (args.batch, args.seq, args.emb)
    x = jax.random.normal(jax.random.key(1), shape)
    print(f"x f32{list(shape)} sharded {args.x_spec} on mesh {dict(mesh.shape)} "
          f"({_common.NUM_DEVICES} simulated CPU devices, {jax.device_count()} visible), "
          f"experts={cfg.num_experts}, top_k={cfg.top_k}, mlp_dim={cfg.mlp_dim}; "
          f"fwd+bwd, median of {args.repeats} after {args.warmup} warm-up steps")
    print("note: jax.lax.ragged_dot on CPU is a dense masked fallback (~num_experts x the "
          "FLOPs of a grouped matmul); MoE rows overstate MoE cost vs the dense MLP.")
    medians: dict[str, float] = {}
    for v in _common.variants(cfg, mesh, args.x_spec):
        step = _common.train_step(v)
        step_args = _common.concrete_args(v, mesh, args.x_spec, x)
        compiled = step.lower(*step_args).compile()
        medians[v.name] = _common.median_seconds(compiled, *step_args, repeats=args.repeats,
                                                 warmup=args.warmup)
    base = medians["ShardedRoutedMoE"]
    width = max(map(len, medians)) + 2
    print(f"\n{'layer':<{width}}{'median ms':>12}{'vs Sharded':>12}")
    for name, t in medians.items():
        print(f"{name:<{width}}{t * 1e3:12.1f}{t / base:11.2f}x")
    ref = medians["RoutedMoE (reference)"]
    print(f"\nreference / sharded step time: {ref / base:.2f}x (simulated devices share the "
          f"host's {_host_cores()} cores: repeated per-device work is serialized)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
