"""How much does `shardlint.analyze()` cost over a bare `lower().compile()`?

Both sides compile the same step from scratch each repeat (a fresh function object, so
neither hits JAX's compilation cache); prints the medians and their ratio. Target <= 1.3.

    python benchmarks/analysis_overhead.py [--repeats 5] [--mesh data=2,context=4]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import jax

jax.config.update("jax_platforms", "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mesh", default="data=2,context=4")
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()

    from shardlint._target import build_mesh, parse_mesh_spec, simulate_devices

    axes = parse_mesh_spec(args.mesh)
    simulate_devices(math.prod(axes.values()))
    import shardlint
    from shardlint.examples import steps

    mesh = build_mesh(axes)
    sizes = steps.Sizes(batch=8, seq=args.seq, emb=64, mlp=128, experts=8, top_k=2)

    def fresh_step(i):
        step, step_args = steps.make_step(mesh, sizes)

        def f(params, x):  # a new function each time: no compilation-cache hits
            return step(params, x * (1.0 + i * 1e-6))

        return f, step_args

    bare, analyzed = [], []
    for i in range(args.repeats):
        fn, step_args = fresh_step(2 * i)
        t0 = time.perf_counter()
        jax.jit(fn).lower(*step_args).compile()
        bare.append(time.perf_counter() - t0)
        fn, step_args = fresh_step(2 * i + 1)
        t0 = time.perf_counter()
        result = shardlint.analyze(fn, *step_args)
        analyzed.append(time.perf_counter() - t0)
    b, a = statistics.median(bare), statistics.median(analyzed)
    print(f"jax {jax.__version__}, mesh {dict(axes)}, seq {args.seq}, {args.repeats} repeats")
    print(f"bare lower().compile(): median {b:.3f} s  (all: {', '.join(f'{t:.3f}' for t in bare)})")
    print(f"shardlint.analyze():    median {a:.3f} s  (all: {', '.join(f'{t:.3f}' for t in analyzed)})")
    print(f"ratio analyze / bare:   {a / b:.2f}  (target <= 1.3; {len(result.collectives)} collectives, "
          f"{len(result.findings)} findings)")


if __name__ == "__main__":
    main()
