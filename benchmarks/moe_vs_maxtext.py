"""ShardedRoutedMoE next to MaxText's RoutedMoE: per-device memory, all-gathers, step time.

Both layers are built on the same config in one process: MaxText 0.2.5's own RoutedMoE
(its config, 12-axis mesh and logical-axis shardings, through the tests'
`support.maxtext_moe`; the sparse, dropless path) and shardlint's
ShardedRoutedMoE in its default memory-lean layout, on MaxText's mesh and with MaxText's x
sharding. Each is compiled as value_and_grad of mean(out**2) w.r.t. params and x, at
context degrees cp on the mesh data x context=cp (MaxText's other axes 1). Printed per
device: arguments, temp and their sum from the compiler's `memory_analysis()`, the
all-gathers by cause from shardlint's analyzer, and on CPU each layer's median step time
(CPU evidence only). Goals, printed as PASS/FAIL lines (exit status 1 on a FAIL):
ShardedRoutedMoE's arguments + temp <= MaxText's at every cp, and its temp <= 1.15 x
(its cp=1 temp / cp).

    .venv312/bin/python benchmarks/moe_vs_maxtext.py         # 8 simulated CPU devices
    .venv312/bin/python benchmarks/moe_vs_maxtext.py --topology v5p:2x2x1   # TPU compiler
    .venv312/bin/python benchmarks/moe_vs_maxtext.py --topology v5p:2x2x1 --expert-axis context
    .venv312/bin/python benchmarks/moe_vs_maxtext.py --topology v5p:2x2x1 --weight-gather whole

CPU default: batch 2, seq 2048 and 8192, emb 64, mlp 128, 8 experts, top-2, float32, data 2.
`--topology`: libtpu ahead of time, no TPU attached (no step time): bf16, batch 1, seq
8192, emb 2048, mlp 1024, 64 experts, top-8, data 1 (2x2x1 has 4 chips). MaxText needs
Python 3.12+; without it the script prints one skip line and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]   # run from a checkout; the tests' MaxText layer

TARGET = 1.15
CPU_SIZES = dict(batch=2, seqs=(2048, 8192), emb=64, mlp=128, experts=8, top_k=2,
                 dtype="float32", data=2)
MAXTEXT, SHARDED = "MaxText RoutedMoE", "ShardedRoutedMoE"
# MaxText's grouped matmul: `jax.lax.ragged_dot` on CPU (its Pallas kernels do not lower
# there); on a TPU its own megablox kernel, which is what it runs there (with ragged_dot the
# TPU compiler runs out of VMEM on the weight gradient at the TPU sizes: measured).
CPU_MAXTEXT: dict[str, object] = dict(hardware="cpu", megablox=False)
TPU_MAXTEXT: dict[str, object] = dict(hardware="tpu", megablox=True)
# The same routing on both sides: ShardedRoutedMoE computes the router's logits and top-k
# in float32 whatever the activations' dtype, and MaxText does when float32_gate_logits is
# set (its default computes them in the activations' dtype: in bf16 on the TPU compiler that
# measured 11 MiB less temp at cp 1, 1.628 against 1.639 GiB). No effect in float32.
SAME_ROUTING: dict[str, object] = dict(float32_gate_logits=True)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default=None, help="e.g. v5p:2x2x1 (the TPU compiler, AOT)")
    p.add_argument("--contexts", default="1,2,4")
    p.add_argument("--seqs", default=None, help="comma-separated (CPU: 2048,8192; TPU: 8192)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per layer (CPU)")
    for key in ("batch", "emb", "mlp", "experts", "top_k", "data"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    p.add_argument("--expert-axis", default=None,
                   help="ShardedRoutedMoE's expert_axis (e.g. context: its experts sharded over "
                        "that token axis and tokens moved by all-to-all, instead of the "
                        "default layout's weights gathered in the layer)")
    p.add_argument("--weight-gather", default=None, choices=("whole", "ring"),
                   help="ShardedRoutedMoE's weight_gather (default: whole): its expert "
                        "matrices gathered whole in the layer, in pieces, or their slices "
                        "passed round the weight axes")
    args = p.parse_args()
    base = dict(CPU_SIZES)
    if args.topology:
        from tpu_moe_memory import FULL  # the TPU sizes of DESIGN.md, defined once

        base.update({k: v for k, v in FULL.items() if k != "seq"}, seqs=(FULL["seq"],),
                    dtype="bfloat16", data=1)
    for key in ("batch", "emb", "mlp", "experts", "top_k", "data", "dtype"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    args.seqs = tuple(int(s) for s in args.seqs.split(",")) if args.seqs else base["seqs"]
    args.contexts = tuple(int(n) for n in args.contexts.split(","))
    return args


@dataclasses.dataclass(frozen=True)
class Point:
    """One layer compiled at one (seq, cp): per-device bytes and the analyzer's gathers."""

    arguments: int
    outputs: int
    temp: int
    peak: int          # XLA's peak where it computes one (TPU), else arguments + outputs + temp
    peak_from_xla: bool
    gathers: dict[str, int]
    seconds: float | None

    @property
    def total(self) -> int:
        """The issue's measure: arguments + temp."""
        return self.arguments + self.temp


def _measure(step, step_args, repeats: int, timed: bool) -> Point:
    import jax

    from shardlint import analyze
    from shardlint.rewrites._verify import random_like

    analysis = analyze(step, *step_args, params_argnums=(0,))
    gathers: dict[str, int] = {}
    for c in analysis.all_gathers():
        gathers[c.cause] = gathers.get(c.cause, 0) + 1
    seconds = None
    if timed:
        import _common

        values = random_like(step_args)
        compiled = jax.jit(step).lower(*values).compile()
        seconds = _common.median_seconds(compiled, *values, repeats=repeats)
    m = analysis.memory
    peak = m.peak_bytes or (m.argument_bytes + m.output_bytes + m.temp_bytes - m.alias_bytes)
    return Point(m.argument_bytes, m.output_bytes, m.temp_bytes, peak, bool(m.peak_bytes),
                 gathers, seconds)


def _layers(args, seq: int, cp: int, devices) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Both layers' steps and abstract arguments on MaxText's mesh for this point."""
    import jax
    import jax.numpy as jnp

    import _common
    from shardlint import moe
    from shardlint.examples.steps import Sizes
    from support import maxtext_moe

    sizes = Sizes(batch=args.batch, seq=seq, emb=args.emb, mlp=args.mlp, experts=args.experts,
                  top_k=args.top_k)
    maxtext_step, maxtext_args = maxtext_moe.make_moe_step(
        sparse=True, context=cp, data=args.data, sizes=sizes, dtype=args.dtype,
        devices=devices, grad_x=True,
        jax_cache_dir="", **SAME_ROUTING,
        **(CPU_MAXTEXT if args.topology is None else TPU_MAXTEXT))
    x = maxtext_args[-1]
    mesh, x_spec = x.sharding.mesh, x.sharding.spec
    cfg = moe.MoeConfig(num_experts=args.experts, top_k=args.top_k, emb_dim=args.emb,
                        mlp_dim=args.mlp, dtype=jnp.dtype(args.dtype))
    layer = moe.ShardedRoutedMoE(cfg, mesh, **_common.token_axes(x_spec),
                                 expert_axis=args.expert_axis,
                                 weight_gather=args.weight_gather or "whole")
    variant = _common.Variant(SHARDED, layer, jax.eval_shape(layer.init, jax.random.key(0)),
                              layer.param_specs())
    sharded_args = _common.abstract_args(variant, mesh, x_spec, x.shape, x.dtype)
    return {MAXTEXT: (maxtext_step, maxtext_args),
            SHARDED: (_common.train_step(variant), sharded_args)}


def _gathers(point: Point) -> str:
    return ", ".join(f"{n} {cause}" for cause, n in sorted(point.gathers.items())) or "0"


def _report(args, seq: int, rows: dict[int, dict[str, Point]]) -> bool:
    top = max(p.total for by_layer in rows.values() for p in by_layer.values())
    unit, scale = ("GiB", 2 ** 30) if top >= 2 ** 30 else ("MiB", 2 ** 20)
    timed = all(p.seconds is not None for by in rows.values() for p in by.values())
    print(f"\nseq {seq}: batch {args.batch}, emb {args.emb}, mlp {args.mlp}, "
          f"{args.experts} experts, top-{args.top_k}, {args.dtype}; mesh data={args.data} x "
          f"context=cp; per device, {unit}")
    print(f"  {'cp':>2}  {'layer':<18}{'arguments':>10}{'temp':>9}{'args+temp':>10}"
          f"{'outputs':>9}{'peak':>9}  {'all-gathers':<12}" + (f"{'step ms':>9}" if timed else ""))
    from_xla = [p.peak_from_xla for by in rows.values() for p in by.values()]
    for cp, by_layer in rows.items():
        for name, p in by_layer.items():
            ms = f"{p.seconds * 1e3:9.1f}" if timed else ""
            mark = "*" if any(from_xla) and not p.peak_from_xla else " "
            print(f"  {cp:>2}  {name:<18}{p.arguments / scale:10.3f}{p.temp / scale:9.3f}"
                  f"{p.total / scale:10.3f}{p.outputs / scale:9.3f}{p.peak / scale:9.3f}{mark} "
                  f"{_gathers(p):<12}{ms}")
    computed = "arguments + outputs + temp - aliased"
    if all(from_xla):
        print("  peak: XLA's own peak per device")
    elif any(from_xla):
        print(f"  peak: XLA's own peak per device; *: {computed} (no peak reported for that step)")
    else:
        print(f"  peak: {computed} (XLA:CPU computes no peak)")
    if timed:
        print("  step time ShardedRoutedMoE / MaxText (CPU evidence only: simulated devices "
              "share this host's cores, and ragged_dot is a dense masked fallback on CPU): "
              + ", ".join(f"cp{cp} {by[SHARDED].seconds / by[MAXTEXT].seconds:.2f}x"
                          for cp, by in rows.items()))
    fits = all(by[SHARDED].total <= by[MAXTEXT].total for by in rows.values())
    first = min(rows)
    base = rows[first][SHARDED].temp * first
    ratios = {cp: by[SHARDED].temp / (base / cp) for cp, by in rows.items()}
    scales = all(r <= TARGET for r in ratios.values())
    cps = ",".join(map(str, rows))
    print(f"{'PASS' if fits else 'FAIL'}: seq {seq}: ShardedRoutedMoE arguments+temp <= "
          f"MaxText's at cp={cps} ("
          + ", ".join(f"{by[SHARDED].total / scale:.3f} vs {by[MAXTEXT].total / scale:.3f}"
                      for by in rows.values()) + f" {unit})")
    print(f"{'PASS' if scales else 'FAIL'}: seq {seq}: ShardedRoutedMoE temp <= {TARGET} x "
          f"(its cp{first} temp / cp) at cp={cps} ("
          + ", ".join(f"{r:.2f}x" for r in ratios.values()) + ")")
    leaner = sum(by[SHARDED].peak <= by[MAXTEXT].peak for by in rows.values())
    print(f"info: seq {seq}: peak per device ShardedRoutedMoE / MaxText at cp={cps}: "
          + ", ".join(f"{by[SHARDED].peak / by[MAXTEXT].peak:.2f}x" for by in rows.values())
          + f" (lower or equal at {leaner} of {len(rows)})")
    return fits and scales


def main() -> int:
    args = _parse()
    import jax

    if args.topology is None:  # before anything starts JAX's backend
        jax.config.update("jax_num_cpu_devices", 8)
        jax.config.update("jax_platforms", "cpu")  # simulated devices where libtpu is installed
    try:
        importlib.import_module("maxtext")
    except ImportError as e:
        print(f"skip: MaxText is not importable here (Python {sys.version.split()[0]}: {e}); "
              f"it needs Python 3.12+ and pip install -e '.[maxtext]'")
        return 0
    if args.topology is None:
        devices = jax.devices()
        where = f"{len(devices)} simulated CPU devices"
    else:
        from shardlint.analyzer.compile._topology import topology_devices

        devices = topology_devices(args.topology)
        where = f"the TPU compiler for {args.topology} ({len(devices)} chips, AOT)"
    chosen = {"expert_axis": args.expert_axis, "weight_gather": args.weight_gather}
    layout = ", ".join(f"{k}={v}" for k, v in chosen.items() if v)
    layout = f" ({layout})" if layout else ""
    print(f"{MAXTEXT} (maxtext {importlib.metadata.version('maxtext')}) vs {SHARDED}{layout} on "
          f"{where}; jax {jax.__version__}; value_and_grad w.r.t. params and x")
    ok = True
    for seq in args.seqs:
        rows: dict[int, dict[str, Point]] = {}
        for cp in args.contexts:
            steps = _layers(args, seq, cp, devices[:args.data * cp])
            rows[cp] = {name: _measure(step, step_args, args.repeats, args.topology is None)
                        for name, (step, step_args) in steps.items()}
            print(f"  measured seq {seq} cp {cp}", file=sys.stderr, flush=True)
        ok = _report(args, seq, rows) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
