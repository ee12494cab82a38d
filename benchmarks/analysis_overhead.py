"""How much does `shardlint.analyze()` cost over a bare `lower().compile()`?

Both sides compile the same step from scratch each repeat (a fresh function object, so
neither hits JAX's compilation cache); prints the medians and their ratio, for the example
MoE step and for a `lax.scan` over 4 stacked layers under `jax.checkpoint` (the loop
bodies, the dataflow through the while carry), and with --maxtext MaxText's own training
step (its dense capacity path, 2 layers, seq 2048). Target <= 1.1 (issue 53). A third
line compiles with the analysis's dump options and reads nothing: what XLA's dump costs by
itself (XLA:CPU writes LLVM IR and object files for every kernel once a dump folder is set).

    python benchmarks/analysis_overhead.py [--repeats 5] [--mesh data=2,context=4] [--maxtext]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/maxtext_memory.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mesh", default="data=2,context=4")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--maxtext", action="store_true",
                        help="also MaxText's training step (Python 3.12+ with shardlint[maxtext])")
    args = parser.parse_args()

    from shardlint.commands._targets import build_mesh, parse_mesh_spec, simulate_devices

    axes = parse_mesh_spec(args.mesh)
    simulate_devices(math.prod(axes.values()))
    from shardlint.examples import steps

    mesh = build_mesh(axes)
    sizes = steps.Sizes(batch=8, seq=args.seq, emb=64, mlp=128, experts=8, top_k=2)

    def scanned(params, x_BSD):
        def layer(h_BSD, layer_params):
            return h_BSD + steps.routed_moe(layer_params, h_BSD, sizes.top_k), None

        out_BSD, _ = jax.lax.scan(jax.checkpoint(layer), x_BSD, params)
        return out_BSD

    def make_scanned_step(mesh, sizes):
        step = steps._loss_step(scanned)
        params, x = steps._args(mesh, sizes, steps._moe_shapes(sizes))
        stacked = {k: jax.ShapeDtypeStruct((4, *v.shape), v.dtype, sharding=v.sharding)
                   for k, v in params.items()}
        return step, (stacked, x)

    print(f"jax {jax.__version__}, mesh {dict(axes)}, seq {args.seq}, {args.repeats} repeats")
    cases = [("example MoE step", steps.make_step), ("scan over 4 layers + remat", make_scanned_step)]
    if args.maxtext:
        cases.append(("MaxText's step, dense capacity path (seq 2048)", _maxtext_step))
    for label, make in cases:
        _measure(label, make, mesh, sizes, args.repeats)


def _maxtext_step(mesh, sizes):
    """MaxText's real training step (benchmarks/maxtext_memory.py's CPU config, context 4 x
    fsdp 2); each call builds it anew, so nothing comes from a cache."""
    import maxtext_memory
    from shardlint.integrations.maxtext import make_step

    return make_step(**{**maxtext_memory.MIXTRAL, **maxtext_memory.CPU, **maxtext_memory.PATHS["capacity"]},
                     ici_context_parallelism=4)


def _measure(label, make, mesh, sizes, repeats) -> None:
    import shardlint

    def fresh_step(i):
        step, step_args = make(mesh, sizes)

        def f(*a):  # another program each time (a constant output): no compilation-cache hits
            return step(*a), jax.numpy.float32(i)

        return f, step_args

    from shardlint.analyzer.compile._compile import _DUMP_OPTIONS

    bare, dumped, analyzed = [], [], []
    for i in range(repeats):
        fn, step_args = fresh_step(3 * i)
        t0 = time.perf_counter()
        jax.jit(fn).lower(*step_args).compile()
        bare.append(time.perf_counter() - t0)
        fn, step_args = fresh_step(3 * i + 1)
        with tempfile.TemporaryDirectory() as folder:  # XLA's part: the same dump, nothing read
            t0 = time.perf_counter()
            jax.jit(fn).lower(*step_args).compile(compiler_options=_DUMP_OPTIONS | {"xla_dump_to": folder})
            dumped.append(time.perf_counter() - t0)
        fn, step_args = fresh_step(3 * i + 2)
        t0 = time.perf_counter()
        result = shardlint.analyze(fn, *step_args)
        analyzed.append(time.perf_counter() - t0)
    b, d, a = (statistics.median(x) for x in (bare, dumped, analyzed))
    print(f"{label}:")
    print(f"  bare lower().compile():       median {b:.3f} s  (all: {', '.join(f'{t:.3f}' for t in bare)})")
    print(f"  the same with the dump on:    median {d:.3f} s  (all: {', '.join(f'{t:.3f}' for t in dumped)})")
    print(f"  shardlint.analyze():          median {a:.3f} s  (all: {', '.join(f'{t:.3f}' for t in analyzed)})")
    print(f"  ratio analyze / bare:         {a / b:.2f}  (target <= 1.1; XLA's dump alone {d / b:.2f}; "
          f"{len(result.collectives)} collectives, {len(result.findings)} findings)")


if __name__ == "__main__":
    main()
