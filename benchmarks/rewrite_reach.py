"""Where the rewrite reaches, in numbers: the steps users write, before and after.

For each training step of the tests' libraries (`tests/support`: scanned, rematerialized,
pre-jitted, nnx, FSDP, scatter dispatch, capacity, a kernel wrapper with its own
shard_map), on 8 simulated CPU devices as data=2 x context=4, this prints a markdown row:
the analysis's `lost` findings, the all-gathers (with their causes where any are left),
and XLA's temp memory per device, before -> after `shardlint.rewrite`. docs/rewrite.md's
table is this script's output (`python docs/regenerate.py --only rewrite-reach`).

    python benchmarks/rewrite_reach.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]   # run from a checkout; the tests' step libraries

import shardlint  # noqa: E402
from support import build_mesh, cause_steps, rewrite_steps  # noqa: E402

MIB = 2 ** 20

# row label: (make, its keyword arguments, rewrite's keyword arguments)
ROWS = {
    "`lax.scan` over 4 layers + `jax.checkpoint`": (cause_steps.make_scanned_layers_step, {}, {}),
    "`lax.scan` over 4 layers, no remat": (cause_steps.make_scanned_layers_step, {"remat": False}, {}),
    "`lax.scan` + remat, tables cached per size": (rewrite_steps.make_size_cached_tables_step, {}, {}),
    "Python loop of 4 `jax.checkpoint` layers": (rewrite_steps.make_remat_loop_step, {}, {}),
    "`jax.checkpoint` around the whole `lax.scan`": (rewrite_steps.make_remat_around_scan_step, {}, {}),
    "pre-jitted, donated, with shardings": (cause_steps.make_prejitted_step, {}, {}),
    "`nnx.jit` + `nnx.Optimizer` (adam)": (cause_steps.make_nnx_step, {}, {}),
    "`nnx.scan` over 4 `nnx.remat` layers (stacked with `nnx.vmap`), `nnx.Optimizer`":
        (cause_steps.make_nnx_step, {"scanned": True}, {}),
    "FSDP weights over `data`": (rewrite_steps.make_fsdp_moe_step, {}, {}),
    "top_k + scatter into `[batch, seq, experts]`, no flatten": (cause_steps.make_scatter_dispatch_step, {}, {}),
    "the same in `lax.scan` over 4 layers, no remat": (rewrite_steps.make_scanned_scatter_step, {}, {}),
    "GShard capacity (cumsum over the sequence), `capacity=\"per-shard\"` (capacity factor 4: nothing drops)":
        (rewrite_steps.make_gshard_step, {"capacity_factor": 4.0}, {"capacity": "per-shard"}),
    "MaxText-style capacity masks (a constraint asking for the whole sequence before the cumsum, "
    "dispatch `BSM,BSEC -> EBCM`), `capacity=\"per-shard\"`":
        (rewrite_steps.make_maxtext_capacity_step, {}, {"capacity": "per-shard"}),
    "attention with a causal mask of the configured length, then the MoE (the attention's own "
    "findings and gathers stay)": (rewrite_steps.make_config_mask_step, {}, {}),
    "attention in a kernel wrapper's own `shard_map` that checks the global batch, then the MoE":
        (rewrite_steps.make_kernel_wrapper_step, {}, {}),
}


def _lost(analysis) -> int:
    return sum(1 for f in analysis.findings if f.cause == "lost")


def _gathers(analysis) -> str:
    causes = sorted({c.cause for c in analysis.all_gathers()} - {"lost"})
    return f"{len(analysis.all_gathers())}" + (f" ({', '.join(causes)})" if causes else "")


def main() -> int:
    mesh = build_mesh({"data": 2, "context": 4})
    print(f"Measured on data=2 x context=4 (8 simulated CPU devices, JAX {jax.__version__}; "
          "`benchmarks/rewrite_reach.py`):\n")
    print("| step | lost findings | all-gathers | temp / device |")
    print("|---|---|---|---|")
    for label, (make, kwargs, options) in ROWS.items():
        fn, args = make(mesh, **kwargs)
        before = shardlint.analyze(fn, *args)
        with warnings.catch_warnings():
            warnings.simplefilter("error", shardlint.NothingToRewrite)   # every row is rewritten
            fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before, **options)
        after = shardlint.analyze(fixed, *args)
        print(f"| {label} | {_lost(before)} -> {_lost(after)} "
              f"| {_gathers(before)} -> {_gathers(after)} "
              f"| {before.memory.temp_bytes / MIB:.2f} -> {after.memory.temp_bytes / MIB:.2f} MiB |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
