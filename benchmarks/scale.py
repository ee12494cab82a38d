"""Analysis cost at scale: the 4-layer decoder example on 64 and 256 simulated devices.

A user runs shardlint on the mesh they train on, not on 8 devices, so what matters is
how the analysis (one compile with XLA's dumps, parsing the partitioned HLO and the
propagated module, the graph, the detectors) grows with the device count: the HLO's
replica groups and the collective table grow with it. Each size runs in a fresh
subprocess, because the simulated device count must be set before JAX starts its
backend (`jax.config.update("jax_num_cpu_devices", N)` is the child's first act), and so
that each child's peak RSS (`resource.getrusage`) is its own.

    python benchmarks/scale.py            # both sizes; PASS/FAIL against the targets

Meshes: data=4,fsdp=2,context=8 (64) and data=4,fsdp=8,context=8 (256); sequence 256
over context 8, batch 64 over data x fsdp: two rows per device at 256. With one row per
device (batch 32) the flatten keeps a tiled (batch, seq) sharding and nothing is lost, so
that size would measure an analysis with no finding. Target for 256 devices:
under 120 s wall and 4 GiB peak RSS for `shardlint.analyze`.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SIZES = {
    64: {"data": 4, "fsdp": 2, "context": 8},
    256: {"data": 4, "fsdp": 8, "context": 8},
}
LAYERS, BATCH, SEQ = 4, 64, 256
TARGET_S, TARGET_GIB = 120.0, 4.0
GIB = 2 ** 30


def child(devices: int) -> dict:
    """Runs in the subprocess: build the step, analyze it, report time and peak RSS."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_platforms", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
    from jax.sharding import AxisType

    import shardlint
    from shardlint.examples import decoder

    axes = SIZES[devices]
    start = time.perf_counter()
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes),
                         axis_types=(AxisType.Auto,) * len(axes))
    cfg = decoder.DecoderConfig(layers=LAYERS, batch=BATCH, seq=SEQ)
    step, args = decoder.make_step(mesh, cfg)
    traced = time.perf_counter()
    analysis = shardlint.analyze(step, *args)
    done = time.perf_counter()
    # ru_maxrss is KiB on Linux.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "devices": devices, "mesh": axes, "setup_s": traced - start,
        "analyze_s": done - traced, "peak_rss_bytes": rss,
        "findings": len(analysis.findings),
        "context_flatten_findings": sum(1 for f in analysis.findings
                                        if f.op == "reshape" and "context" in f.axes),
        "collectives": len(analysis.collectives),
        "all_gathers": len(analysis.all_gathers()),
        "temp_bytes": analysis.memory.temp_bytes,
    }


def main() -> int:
    print(f"decoder example: {LAYERS} layers, batch {BATCH}, seq {SEQ}; one fresh process "
          f"per size; shardlint.analyze wall time and the process's peak RSS")
    rows = []
    for devices in SIZES:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", str(devices)],
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            print(f"{devices} devices: the child failed (exit {proc.returncode}):\n"
                  f"{proc.stderr[-3000:]}")
            return 1
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["process_s"] = wall
        rows.append(row)
        mesh = ",".join(f"{k}={v}" for k, v in row["mesh"].items())
        print(f"{devices:>4} devices ({mesh}): analyze {row['analyze_s']:6.1f} s "
              f"(trace {row['setup_s']:.1f} s, process {wall:.1f} s), peak RSS "
              f"{row['peak_rss_bytes'] / GIB:.2f} GiB; {row['findings']} findings "
              f"({row['context_flatten_findings']} context flattens), "
              f"{row['collectives']} collectives ({row['all_gathers']} all-gathers), "
              f"temp {row['temp_bytes'] / 2 ** 20:.1f} MiB/device", flush=True)
    big = rows[-1]
    ok = big["analyze_s"] < TARGET_S and big["peak_rss_bytes"] < TARGET_GIB * GIB
    ok = ok and all(r["context_flatten_findings"] >= LAYERS for r in rows)
    if len(rows) == 2:
        print(f"256 / 64 devices: time x{rows[1]['analyze_s'] / rows[0]['analyze_s']:.2f}, "
              f"RSS x{rows[1]['peak_rss_bytes'] / rows[0]['peak_rss_bytes']:.2f}")
    print(f"{'PASS' if ok else 'FAIL'}: {big['devices']} devices analyzed in "
          f"{big['analyze_s']:.1f} s (< {TARGET_S:.0f} s) with peak RSS "
          f"{big['peak_rss_bytes'] / GIB:.2f} GiB (< {TARGET_GIB:.0f} GiB), and the MoE "
          f"flatten found in every layer at every size")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
