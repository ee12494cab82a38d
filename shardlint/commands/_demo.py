"""`shardlint demo`: the whole story on the built-in decoder, on a laptop's CPU.

Eight simulated devices (data=2, context=4): analyze the example decoder step, rewrite its
MoE to keep tokens sharded, analyze again, sweep the context degree (1, 2, 4) to show
whether more context parallelism saves memory, and write `report.html` plus both JSON
analyses to the output folder. Prints a short summary of what changed.
"""

from __future__ import annotations

import os
from typing import Callable

TARGET = "shardlint.examples.decoder:make_step"
MESH = "data=2,context=4"
SWEEP = "context=1,2,4"


def run_demo(out_dir: str, progress: Callable[[str], None]) -> str:
    """Runs the demo into `out_dir`; returns the summary text."""
    from ..reports import write_html, write_json
    from ._sweep import analyze_pair, mesh_points, parse_sweep_spec, run_sweep, start_devices
    from ._targets import build_mesh, check_mesh, make_step, parse_mesh_spec
    from .._format import human_bytes

    axes, sweep = parse_mesh_spec(MESH), parse_sweep_spec(SWEEP)
    start_devices(axes, sweep)
    mesh = build_mesh(axes)
    progress(f"tracing {TARGET} on mesh {MESH}")
    fn, args = make_step(TARGET, mesh)
    check_mesh(args, mesh)
    before, after = analyze_pair(fn, args, mesh, rewrite=True, verify=True, progress=progress)
    points = run_sweep(*sweep, mesh_points(TARGET, axes, sweep[0]), progress=progress,
                       known={axes["context"]: (before, after)})
    os.makedirs(out_dir, exist_ok=True)
    report = os.path.join(out_dir, "report.html")
    write_html(before, after, path=report, sweep=points, title=f"{TARGET} (shardlint demo)")
    write_json(before, os.path.join(out_dir, "before.json"))
    write_json(after, os.path.join(out_dir, "after.json"))

    def gathers(a):
        ags = a.all_gathers()
        return f"{len(ags)} ({human_bytes(sum(c.bytes for c in ags))}/device)"

    lines = [
        f"shardlint demo: {TARGET} on mesh {MESH} (8 simulated CPU devices)",
        f"  findings:        {len(before.findings)} -> {len(after.findings)}",
        f"  all-gathers:     {gathers(before)} -> {gathers(after)}",
        f"  temp memory:     {human_bytes(before.memory.temp_bytes)} -> {human_bytes(after.memory.temp_bytes)} per device",
        "  context sweep (temp memory per device, before -> after):",
    ]
    for point in points["points"]:
        lines.append(f"    context={point['value']}: {human_bytes(point['before'].memory.temp_bytes)} -> "
                     f"{human_bytes(point['after'].memory.temp_bytes)}")
    fixed: dict[str, int] = {}
    for f in before.findings:  # one line per place; each layer repeats it
        where = str(f.source) if f.source else "?"  # already relative: cwd, sys.path or package root
        key = f"{f.op} at {where} lost {', '.join(f.axes)}"
        fixed[key] = fixed.get(key, 0) + 1
    for key, count in fixed.items():
        lines.append(f"  fixed: {key}" + (f" (x{count})" if count > 1 else ""))
    lines.append(f"  report: {os.path.abspath(report)}")
    lines.append(f"  analyses: {os.path.abspath(os.path.join(out_dir, 'before.json'))}, after.json")
    return "\n".join(lines)
