"""Does the rewritten step's per-device memory fall as 1/N with the context degree?

The MoE-only step of `shardlint.examples.steps` (a routed MoE written in plain JAX that
flattens (batch, seq) outside shard_map), value_and_grad, on N of 8 simulated CPU devices
with mesh data=1 x context=N: the global batch and sequence stay fixed while context
parallelism splits the sequence N ways, so the ideal per-device memory is 1/N. (On a mesh
data=8/N x context=N every device always holds 1/8 of the tokens, which measures nothing
about context parallelism.) For each N it analyzes the original and `shardlint.rewrite`'s
result side by side and prints per-device temp memory (XLA's memory analysis), the
all-gathers the analyzer finds, and each one's ratio to the ideal (context-1 memory / N).
Target: rewritten <= 1.15 x ideal at every N. Exits 1 if the target is missed.

    python benchmarks/rewrite_memory.py [--seq 2048]
    python benchmarks/rewrite_memory.py --model scan [--seq 2048]
    python benchmarks/rewrite_memory.py --model decoder [--seq 1024]

`--model scan` measures the same MoE as 4 stacked layers under `lax.scan`, each
rematerialized (`jax.checkpoint`), as MaxText's `scan_layers` builds them
(`steps.make_scanned_step`); the rewrite runs inside the scan bodies, forward and backward.

`--model decoder` measures the built-in example decoder (`shardlint.examples.decoder`:
attention with K/V gathered over context, Qwen3-Next MoE blocks on the reference RoutedMoE)
instead of the MoE-only step; there the attention's requested K/V gathers stay, and the
target applies to the MoE-only step.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import AxisType  # noqa: E402

import shardlint  # noqa: E402
from shardlint.examples import decoder, steps  # noqa: E402

MiB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--contexts", default="1,2,4,8")
    parser.add_argument("--model", choices=("moe", "scan", "decoder"), default="moe")
    args = parser.parse_args()
    if args.model in ("moe", "scan"):
        sizes = steps.Sizes(batch=8, seq=args.seq, emb=64, mlp=128, experts=8, top_k=2)
        make = steps.make_step if args.model == "moe" else steps.make_scanned_step
    else:
        sizes = decoder.DecoderConfig(batch=8, seq=args.seq, emb=64, mlp=128, experts=8, top_k=2)
        make = decoder.make_step
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"jax {jax.__version__}; {sizes}; fwd+bwd; mesh data=1 x context=N on N CPU devices")
    print(f"{'N':>3} {'original MiB':>13} {'AG':>3} {'x ideal':>8} {'rewritten MiB':>14} {'AG':>3} "
          f"{'x ideal':>8} {'rewrite s':>9}")
    rows = []
    for n in contexts:
        mesh = jax.make_mesh((1, n), ("data", "context"), axis_types=(AxisType.Auto,) * 2,
                             devices=jax.devices()[:n])
        fn, step_args = make(mesh, sizes)
        before = shardlint.analyze(fn, *step_args)
        t0 = time.perf_counter()
        with warnings.catch_warnings():   # context 1 shards no sequence: nothing to rewrite
            warnings.simplefilter("ignore" if n == 1 else "default", shardlint.NothingToRewrite)
            fixed = shardlint.rewrite(fn, mesh, args=step_args, analysis=before)
        after = shardlint.analyze(fixed, *step_args)
        rows.append((n, before, after, time.perf_counter() - t0))
    base_before = rows[0][1].memory.temp_bytes
    base_after = rows[0][2].memory.temp_bytes
    ok = True
    for n, before, after, seconds in rows:
        ideal_before, ideal_after = base_before / n, base_after / n
        ratio_after = after.memory.temp_bytes / ideal_after
        ok &= ratio_after <= 1.15
        print(f"{n:>3} {before.memory.temp_bytes / MiB:>13.1f} {len(before.all_gathers()):>3} "
              f"{before.memory.temp_bytes / ideal_before:>8.2f} {after.memory.temp_bytes / MiB:>14.1f} "
              f"{len(after.all_gathers()):>3} {ratio_after:>8.2f} {seconds:>9.1f}")
    print("ideal = the context-1 memory of the same version / N; AG = all-gathers found by the analyzer")
    if args.model == "decoder":
        print("(decoder: attention and embeddings scale too; the 1.15 target is for the MoE steps)")
        return 0
    print(f"{'PASS' if ok else 'FAIL'}: rewritten <= 1.15 x ideal at every N")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
