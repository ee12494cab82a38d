"""Where a MoE training step's time goes on a TPU chip, by the layer's named scopes.

Profiles the training step of one row of `tpu_moe.py` (ShardedRoutedMoE at T=8192 tokens,
E=64, top-8, D=2048, F=1024 by default, the layer's own kernels) with `jax.profiler`,
reads the device's op events from the Perfetto trace JAX writes, and charges each op's
time to the layer's `jax.named_scope` (moe/route, moe/sort, moe/experts, moe/unsort,
moe/combine) in the forward or the backward pass, read from the op_name XLA keeps in the
compiled module's metadata (`shardlint.analyzer.parse_hlo`). Prints per-step milliseconds
per scope and the ops that take longest, beside the step's median wall time.

    python benchmarks/tpu_moe_profile.py [--row ShardedRoutedMoE] [--path now|today]
                                         [--steps 5] [--trace-dir DIR] [--top 25]

Without a TPU it prints one skip line and exits 0 (--allow-cpu runs the machinery with
small sizes; the CPU backend's trace has no per-op device events, so the table is empty).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpu_moe  # noqa: E402

from shardlint.analyzer import parse_hlo  # noqa: E402

_SCOPE = re.compile(r"moe/[a-z_]+")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in dict(batch=1, seq=8192, experts=64, top_k=8, emb=2048, mlp=1024,
                            steps=5, top=25).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    p.add_argument("--row", default="ShardedRoutedMoE", choices=tpu_moe.STEP_ROWS)
    p.add_argument("--path", default="now", choices=[p for p, _ in tpu_moe.PATHS])
    p.add_argument("--trace-dir", default=None, help="keep the trace here")
    p.add_argument("--allow-cpu", action="store_true")
    args = p.parse_args(argv)
    args.repeats = 10
    return args


def scope_of(op_name: str) -> str:
    """`moe/sort (bwd)` for an op under that scope that the backward pass made."""
    scope = (_SCOPE.findall(op_name) or ["(outside the layer)"])[-1]
    return f"{scope} (bwd)" if "transpose(" in op_name else scope


def device_op_events(trace: dict) -> list[dict]:
    """Complete events on the first TPU device's "XLA Ops" line."""
    names = {}
    for e in trace.get("traceEvents", ()):
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["name"], e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    pids = sorted(pid for (kind, pid, _), n in names.items()
                  if kind == "process_name" and "TPU:0" in n)
    if not pids:
        return []
    tids = {tid for (kind, pid, tid), n in names.items()
            if kind == "thread_name" and pid == pids[0] and n == "XLA Ops"}
    return [e for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("pid") == pids[0] and e.get("tid") in tids]


def read_trace(folder: Path) -> dict:
    found = sorted(folder.rglob("perfetto_trace.json.gz"))
    if not found:
        return {}
    with gzip.open(found[-1], "rt") as f:
        return json.load(f)


def main(argv=None) -> int:
    args = parse(argv)
    backend = jax.default_backend()
    if backend != "tpu" and not args.allow_cpu:
        print(f"skip: no TPU (JAX backend is {backend!r}); this profiles a MoE step on a TPU chip")
        return 0
    if backend != "tpu":
        args.seq, args.emb, args.mlp, args.experts, args.top_k = 64, 256, 128, 8, 2
    bench = tpu_moe.Bench(args)
    compiled, step_args, flops, _ = bench.step_program(args.row, args.path)
    op_names = {i.name: i.op_name for i in parse_hlo(compiled.as_text()).instructions()}
    wall = tpu_moe.median_s(compiled, *step_args, repeats=args.repeats)
    folder = Path(args.trace_dir or tempfile.mkdtemp(prefix="tpu_moe_profile_"))
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for _ in range(args.steps):
            jax.block_until_ready(compiled(*step_args))
        time.sleep(0.1)
    trace = read_trace(folder)
    events = device_op_events(trace)
    experts, top_k = tpu_moe.row_sizes(args.row, args)   # a row's own "E=8 top-2" first
    print(f"{bench.dev.device_kind}, JAX {jax.__version__}; {args.row} ({args.path}), "
          f"T={args.batch * args.seq}, E={experts}, top-{top_k}, D={args.emb}, "
          f"F={args.mlp}; step {tpu_moe.cell(wall, flops, bench.peak)} (median of "
          f"{args.repeats}); trace of {args.steps} steps in {folder}")
    if not events:
        lines = sorted({f"{e['name']}: {e.get('args', {}).get('name', '')}"
                        for e in trace.get("traceEvents", ()) if e.get("ph") == "M"
                        and e.get("name") in ("process_name", "thread_name")})
        print("no device op events in the trace (not a TPU, or the profiler wrote none); "
              f"its lines: {lines[:40]}")
        return 0
    by_scope, by_op = collections.Counter(), collections.Counter()
    for e in events:
        name = e["name"]
        by_scope[scope_of(op_names.get(name, ""))] += e["dur"]
        by_op[name] += e["dur"]
    per_step = lambda us: us / args.steps / 1e3
    total = sum(by_scope.values())
    print(f"\ndevice op time {per_step(total):.2f} ms per step (wall {wall * 1e3:.2f} ms)")
    print(f"{'scope':<32}{'ms/step':>9}{'share':>8}")
    for scope, us in sorted(by_scope.items(), key=lambda kv: -kv[1]):
        print(f"{scope:<32}{per_step(us):9.3f}{100 * us / total:7.1f}%")
    print(f"\n{'op':<40}{'ms/step':>9}  scope / XLA op_name")
    for name, us in by_op.most_common(args.top):
        op_name = op_names.get(name, "")
        print(f"{name[:40]:<40}{per_step(us):9.3f}  {scope_of(op_name)}: {op_name[-90:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
