"""Per-chip HBM of a routed-MoE training step on a real TPU topology, from a CPU machine.

The TPU compiler (libtpu, ahead of time for `--topology`, no TPU attached) compiles
value_and_grad of the example MoE step in `shardlint.examples.steps` twice per context
degree N on the mesh data=1 x context=N: flattened (batch, seq) outside shard_map (the
reference, `make_step`) and flattened per shard inside shard_map (`make_per_shard_step`).
Side by side it prints the compiler's per-chip temp memory with its ratio to the ideal
(the layer's own N=1 temp x 1/N: each chip holds 1/N of the tokens), the all-gathers and
findings shardlint's analyzer reports, and XLA's peak. PASS when the per-shard step stays
within 1.15x of ideal at every N and the reference shows its lost-sharding finding at
every N > 1; exit status 1 otherwise.

    pip install 'shardlint[tpu]'
    python benchmarks/tpu_moe_memory.py                 # small: seconds per compile
    python benchmarks/tpu_moe_memory.py --full          # seq 8192, emb 2048, 64 experts
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

from shardlint.analyzer import analyze
from shardlint.analyzer.compile._topology import topology_mesh
from shardlint.examples.steps import Sizes, make_per_shard_step, make_step

TARGET = 1.15
FULL = dict(batch=1, seq=8192, emb=2048, mlp=1024, experts=64, top_k=8)
SMALL = dict(batch=2, seq=1024, emb=512, mlp=256, experts=16, top_k=4)
VARIANTS = (("flatten outside shard_map (reference)", make_step),
            ("flatten per shard (shard_map)", make_per_shard_step))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--contexts", default="1,2,4", help="context degrees N, e.g. 1,2,4")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--full", action="store_true", help="the sizes of the measurement in "
                   "DESIGN.md: " + ", ".join(f"{k} {v}" for k, v in FULL.items()))
    for key, value in SMALL.items():
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None,
                       help=f"default {value} ({FULL[key]} with --full)")
    args = p.parse_args()
    base = FULL if args.full else SMALL
    args.sizes = Sizes(**{k: getattr(args, k) or v for k, v in base.items()})
    args.contexts = tuple(int(n) for n in args.contexts.split(","))
    return args


def _in_dtype(args, dtype):
    """The example's float32 ShapeDtypeStructs in `dtype`, shardings kept."""
    return jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, dtype, sharding=s.sharding), args)


def _findings(analysis) -> str:
    return ", ".join(f"{f.op} drops {'+'.join(f.axes)}" for f in analysis.findings) or "-"


def main() -> int:
    args = _parse()
    z, dtype = args.sizes, jnp.dtype(args.dtype)
    print(f"TPU compiler for {args.topology}; {args.dtype}, value_and_grad; batch {z.batch}, "
          f"seq {z.seq}, emb {z.emb}, mlp {z.mlp}, {z.experts} experts, top-{z.top_k}; "
          f"mesh data=1 x context=N; per-chip memory from the compiler's memory_analysis()")
    rows: dict[str, dict[int, object]] = {}
    start = time.perf_counter()
    for n in args.contexts:
        mesh = topology_mesh({"data": 1, "context": n}, args.topology)
        for name, make in VARIANTS:
            fn, step_args = make(mesh, z)
            t = time.perf_counter()
            rows.setdefault(name, {})[n] = analyze(fn, *_in_dtype(step_args, dtype))
            print(f"  compiled {name} at N={n} in {time.perf_counter() - t:.0f} s", flush=True)
    some = next(iter(rows.values()))[args.contexts[0]]
    print(f"compiler: {some.platform} {some.topology}, libtpu {some.versions.get('libtpu')}, "
          f"jax {some.versions['jax']}")
    top = max(a.memory.temp_bytes for by_n in rows.values() for a in by_n.values())
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    width = max(map(len, rows)) + 2
    print(f"\n{'temp per chip, ' + unit + ' (x ideal)':<{width}}"
          + "".join(f"{'N=' + str(n):>18}" for n in args.contexts))
    ok = True
    for name, by_n in rows.items():
        base = by_n[args.contexts[0]].memory.temp_bytes * args.contexts[0]
        cells = []
        for n in args.contexts:
            ratio = by_n[n].memory.temp_bytes / (base / n)
            cells.append(f"{by_n[n].memory.temp_bytes / scale:8.2f} ({ratio:4.2f}x)")
            if name == VARIANTS[1][0] and ratio > TARGET:
                ok = False
        print(f"{name:<{width}}" + "".join(f"{c:>18}" for c in cells))
    for label, value in (("peak", lambda a: f"{(a.memory.peak_bytes or 0) / scale:.2f}"),
                         ("all-gathers", lambda a: str(len(a.all_gathers()))),
                         ("findings", _findings)):
        cells = {name: [value(by_n[n]) for n in args.contexts] for name, by_n in rows.items()}
        col = max(18, 2 + max(len(c) for row in cells.values() for c in row))
        print(f"\n{label}:")
        for name, row in cells.items():
            print(f"  {name:<{width}}" + "".join(f"{c:>{col}}" for c in row))
    lost = all(rows[VARIANTS[0][0]][n].findings for n in args.contexts if n > 1)
    ok = ok and lost
    print(f"\n({time.perf_counter() - start:.0f} s)")
    print(f"{'PASS' if ok else 'FAIL'}: per-shard temp <= {TARGET}x of 1/N at N={args.contexts}; "
          f"reference finding at every N > 1: {'yes' if lost else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
