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
FILES = ("report.html", "before.json", "after.json")


def run_demo(out_dir: str, progress: Callable[[str], None]) -> str:
    """Runs the demo into `out_dir` (made if missing, when the files are written); returns
    the summary text."""
    from ..reports import write_html, write_json
    from ._summary import summary
    from ._sweep import analyze_pair, mesh_points, parse_sweep_spec, run_sweep, start_devices
    from ._targets import build_mesh, check_mesh, make_step, parse_mesh_spec

    axes, sweep = parse_mesh_spec(MESH), parse_sweep_spec(SWEEP)
    start_devices(axes, sweep)
    mesh = build_mesh(axes)
    progress(f"tracing {TARGET} on mesh {MESH}")
    fn, args = make_step(TARGET, mesh)
    check_mesh(args, mesh)
    pair = analyze_pair(fn, args, mesh, rewrite=True, verify=True, progress=progress)
    points = run_sweep(*sweep, mesh_points(TARGET, axes, sweep[0]), progress=progress,
                       known={axes["context"]: pair})
    os.makedirs(out_dir, exist_ok=True)
    report, before_json, after_json = (os.path.join(out_dir, name) for name in FILES)
    write_html(pair.before, pair.after, path=report, sweep=points, title=f"{TARGET} (shardlint demo)")
    write_json(pair.before, before_json)
    write_json(pair.after, after_json)
    return summary(f"shardlint demo: {TARGET} on mesh {MESH} (8 simulated CPU devices)", pair, points,
                   [("report", os.path.abspath(report)),
                    ("analyses", f"{os.path.abspath(before_json)}, {FILES[2]}")])
