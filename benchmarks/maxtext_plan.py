"""`shardlint plan` at the size users train: the longest sequence that fits a v5p chip against
the context degree, MaxText's own MoE presets as written and fixed.

MaxText 0.2.5's presets, unmodified (`model_name=...`: their layers, dims and experts; bf16,
scanned layers, MaxText's default remat, its flash attention on TPU), on the dense MoE path
that loses the sequence sharding (`sparse_matmul=false`; mixtral-8x7b with a capacity,
`capacity_factor=1.25`, the rewrite then per-shard capacity; qwen3-next-80b-a3b dropless,
`capacity_factor=-1`), compiled by the TPU compiler for `v5p:4x4x4` (64 chips; libtpu ahead
of time, no TPU attached), at `ici_context_parallelism` 1, 2, 4, 8 with FSDP over the other
chips and one sequence per FSDP shard (`per_device_batch_size` = 1 / context degree: each
sequence split over the context chips, so a longer sequence is what context parallelism
buys). At each point `--longest max_target_length=8192..524288:4096` finds the longest
sequence that fits a chip's HBM, before and after the fix, to a multiple of 4096 (MaxText's
flash attention takes a sequence whose part on each of 8 context shards is a multiple of its
512-token block; with steps of 1024 a probe at context 8 fails to trace, which ends that
search).

This runs the command line (printed first), times it, records the peak memory of its
processes (the largest point's compile) and each point's seconds, round by round (its
progress lines), and writes them with the plan to `benchmarks/results/plan-<model>.json`.
More than an hour per preset here (2 cores, `--jobs 2`: 13-24 minutes a round of four
points, four or five rounds); `--cache` keeps every point, so a run stopped and started
again compiles only what is new. The projection printed last spreads each
round's measured points over N workers (Ray: `--ray`): a round ends with its last point.

    pip install 'shardlint[maxtext,tpu]'          # Python 3.12+
    python benchmarks/maxtext_plan.py --model mixtral-8x7b
    python benchmarks/maxtext_plan.py --model qwen3-next-80b-a3b
    python benchmarks/maxtext_plan.py --brackets --cache benchmarks/results/plan-mixtral-8x7b

A run stopped before its searches closed still leaves its points in `--cache`; `--brackets`
prints, from them alone, each point's longest length that fitted and shortest that did not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# The MoE path that loses the sequence sharding, per preset, and what the rewrite needs.
PRESETS = {
    "mixtral-8x7b": (["sparse_matmul=false", "capacity_factor=1.25"], ["--per-shard-capacity"]),
    # GatedDeltaNet's recurrence needs the sequence in device order (MaxText says so).
    "qwen3-next-80b-a3b": (["sparse_matmul=false", "capacity_factor=-1",
                            "context_parallel_load_balance=false"], []),
}
# One sequence per FSDP shard; a context degree that does not divide the torus's axes
# (2, 8 on 4x4x4) needs MaxText's allow_split_physical_axes.
GRID = ("ici_context_parallelism:per_device_batch_size:allow_split_physical_axes="
        "1:1:false,2:0.5:true,4:0.25:false,8:0.125:true")


def command(model: str, topology: str, longest: str | None, jobs: int, length: int | None = None) -> list[str]:
    """The command line this measures (what docs/plan.md shows), without where it writes;
    with `length` instead of `longest`, the grid at that one max_target_length."""
    options, rewrite = PRESETS[model]
    words = [f"model_name={model}", *options, "ici_fsdp_parallelism=-1", "attention=flash"]
    words += [f"max_target_length={length}"] if length else []
    search = ["--longest", longest] if longest else []
    return (["shardlint", "plan", "shardlint.integrations.maxtext:make_step", "--topology", topology]
            + [w for word in words for w in ("--set", word)]
            + ["--grid", GRID, *search, *rewrite, "--jobs", str(jobs)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mixtral-8x7b", choices=sorted(PRESETS))
    parser.add_argument("--topology", default="v5p:4x4x4")
    # A step of 4096: MaxText's flash attention needs each context shard's part of the
    # sequence to be a multiple of its 512-token block (512 x 8 at context 8).
    parser.add_argument("--longest", default="max_target_length=8192..524288:4096")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--record", nargs=2, metavar=("PLAN_JSON", "STDERR"),
                        help="record a run of the printed command made by hand under "
                             "`/usr/bin/time -v` (its --json, its stderr) instead of running it")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/shardlint/plan"),
                        help="plan --cache: a run again (after a stop) compiles only what is new")
    parser.add_argument("--brackets", action="store_true",
                        help="print what the points kept in --cache bracket (a search stopped "
                             "before its end: the longest value that fitted, the shortest that "
                             "did not), compiling nothing")
    args = parser.parse_args(argv)
    if args.brackets:
        print(brackets(args.cache))
        return 0
    shown = command(args.model, args.topology, args.longest, args.jobs)
    if args.record:
        plan_json, log = args.record
        text = Path(log).read_text()
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", text)
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
        if not wall or not rss:
            parser.error(f"{log} has no /usr/bin/time -v figures")
        seconds = int(wall.group(1) or 0) * 3600 + int(wall.group(2)) * 60 + float(wall.group(3))
        record(args, shown, json.loads(Path(plan_json).read_text()), text, seconds, int(rss.group(1)) * 1024)
        return 0
    if importlib.util.find_spec("maxtext") is None:
        print("skip: MaxText is not installed (pip install 'shardlint[maxtext,tpu]', Python 3.12+)")
        return 0
    print("$", " ".join(shown), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        argv = [sys.executable, "-m", *shown, "--cache", args.cache, "--json", "plan.json"]
        start = time.monotonic()
        done = subprocess.Popen(argv, cwd=folder, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in done.stderr:          # shown as it comes, kept for the projection
            sys.stderr.write(line)
            lines.append(line)
        done.wait()
        seconds = time.monotonic() - start
        out = os.path.join(folder, "plan.json")
        if not os.path.exists(out):
            return done.returncode or 1
        plan = json.loads(Path(out).read_text())
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024   # KiB on Linux
    record(args, shown, plan, "".join(lines), seconds, peak)
    return done.returncode


def record(args, shown: list[str], plan: dict, log: str, seconds: float, peak: int | None) -> None:
    rounds = point_seconds(log)
    doc = {"command": shown, "seconds": round(seconds), "jobs": args.jobs, "peak_rss_bytes": peak,
           "rounds": rounds, "plan": plan}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"plan-{args.model}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{seconds / 60:.0f} min with --jobs {args.jobs}"
          + (f"; peak memory of a point's process {peak / 2**30:.1f} GiB" if peak else "")
          + f"; wrote {path.relative_to(ROOT)}")
    for workers in (args.jobs, 4, 8, 16):
        print(f"  on {workers} workers: about {projected(rounds, workers) / 60:.0f} min "
              "(each round's points spread over them, the measured time of each)")


def brackets(cache: str, key: str = "max_target_length") -> str:
    """Per grid point and side, the longest `key` that fitted and the shortest that did not,
    with the compiler's need per chip at each, from the points a plan kept in `cache` (a
    folder holding one run's points: each is a compile that ended); then the peak resident
    memory of the points' processes, where they recorded it."""
    from shardlint.reports import point_of

    found: dict[tuple, dict[str, list]] = {}
    host_peaks = []
    for name in sorted(os.listdir(cache)):
        point = point_of(json.loads(Path(cache, name).read_text()))
        if point.host_peak_bytes is not None:
            host_peaks.append(point.host_peak_bytes)
        grid = tuple((k, v) for k, v in point.values.items() if k != key)
        for side in ("before", "after"):
            compiled = getattr(point, side)
            if compiled is not None:
                found.setdefault(grid, {}).setdefault(side, []).append(
                    (point.values[key], compiled.fits, compiled.need_bytes / 2**30))

    def bracket(tried: list) -> str:
        fits = [t for t in tried if t[1]]
        above = [t for t in tried if not t[1] and (not fits or t[0] > max(fits)[0])]
        low = f"fits {max(fits)[0]} ({max(fits)[2]:.1f} GiB)" if fits else "none fits"
        high = f", not {min(above)[0]} ({min(above)[2]:.1f} GiB)" if above else ""
        below = [t for t in tried if not t[1] and fits and t[0] < max(fits)[0]]   # XLA's choices
        odd = f" (yet not {', '.join(str(t[0]) for t in sorted(below))})" if below else ""
        return low + high + odd

    rows = [f"{', '.join(f'{k}={v}' for k, v in grid)}: before {bracket(sides.get('before', []))}; "
            f"after {bracket(sides.get('after', []))}"
            for grid, sides in sorted(found.items(), key=lambda item: str(item[0]))]
    if host_peaks:   # points compiled before the record had it have none
        rows.append(f"peak memory of a point's process: {max(host_peaks) / 2**30:.1f} GiB at most, "
                    f"median {statistics.median(host_peaks) / 2**30:.1f} GiB ({len(host_peaks)} of "
                    f"{len(os.listdir(cache))} points recorded it)")
    return "\n".join(rows)


_ROUND = re.compile(r"round (\d+): (\d+) point")
_POINT = re.compile(r"\[\d+/\d+\] .* \((\d+) s\)")


def point_times(log: str) -> list[int]:
    """The seconds of every point the command's progress lines report, in order."""
    return [int(m.group(1)) for m in map(_POINT.search, log.splitlines()) if m]


def point_seconds(log: str) -> list[list[int]]:
    """The seconds each point of each round took, from the command's progress lines."""
    rounds: list[list[int]] = []
    for line in log.splitlines():
        if _ROUND.search(line):
            rounds.append([])
        elif (m := _POINT.search(line)) and rounds:
            rounds[-1].append(int(m.group(1)))
    return rounds


def projected(rounds: list[list[int]], workers: int) -> float:
    """Wall time with `workers` points at once: each round's points, longest first, each to
    the worker free first; the round ends with its last point. The times are those measured
    here with other points beside them (2 cores), so alone on a worker a point is faster."""
    total = 0.0
    for times in rounds:
        free = [0.0] * workers
        for t in sorted(times, reverse=True):
            free[free.index(min(free))] += t
        total += max(free)
    return total


if __name__ == "__main__":
    sys.exit(main())
