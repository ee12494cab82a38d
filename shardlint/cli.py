"""The `shardlint` command: argparse over the library, nothing else.

Exit codes: 0 clean, 1 findings (or gate failed), 2 usage or input error (one line on
stderr, no traceback).
"""

from __future__ import annotations

import argparse
import sys

from ._errors import ShardlintError


def _progress(message: str) -> None:
    print(f"shardlint: {message}", file=sys.stderr, flush=True)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="path/to/model.py:make_step or package.module:make_step; "
                                  "called with the mesh, returns (step_fn, args)")
    p.add_argument("--mesh", required=True, help="mesh axes in order, e.g. data=2,context=4")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlint", description="Find where XLA loses the sharding of a JAX step.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("analyze", help="analyze a step: findings, collectives, memory")
    _add_target(p)
    p.add_argument("--json", metavar="FILE", help="write the analysis (shardlint.analysis/1)")
    p.add_argument("--rewrite", action="store_true",
                   help="analyze the step after putting the sharding-preserving MoE in place")
    p = sub.add_parser("report", help="write one self-contained HTML report: findings, "
                                      "collectives and memory, before and after the rewrite")
    _add_target(p)
    p.add_argument("--out", metavar="FILE", default="shardlint-report.html",
                   help="the HTML file to write (default: shardlint-report.html)")
    p.add_argument("--no-rewrite", action="store_true",
                   help="report the step as it is, without the rewritten step beside it")
    p.add_argument("--sweep", metavar="AXIS=v1,v2,...",
                   help="also re-run the step with the mesh's AXIS at each size and chart "
                        "per-device memory against it, e.g. --sweep context=1,2,4,8")
    p = sub.add_parser("demo", help="run the whole story on the built-in example: analyze, "
                                    "rewrite, analyze again, write a report")
    p.add_argument("--out", metavar="DIR", default="shardlint-demo",
                   help="folder for report.html and the JSON analyses (default: ./shardlint-demo)")
    p = sub.add_parser("check", help="fail (exit 1) when the step gains an all-gather that "
                                     "the baseline lacks; --update records the baseline")
    _add_target(p)
    p.add_argument("--baseline", metavar="FILE", default="shardlint.baseline.json",
                   help="the baseline (shardlint.baseline/1; default: shardlint.baseline.json)")
    p.add_argument("--update", action="store_true",
                   help="record the current collectives as the baseline instead of checking")
    p.add_argument("--format", choices=("text", "json", "github", "sarif"), default="text",
                   help="text (default), json, github (workflow annotations) or sarif (2.1.0)")
    p.add_argument("--kinds", default="all-gather",
                   help="collective kinds that can fail the check, comma-separated, or 'all' "
                        "(default: all-gather)")
    p.add_argument("--tolerance", default="0%",
                   help="allowed growth in bytes per collective, in percent (default: 0%%)")
    p.add_argument("--root", metavar="DIR",
                   help="project root that source paths are relative to (default: the git "
                        "top-level of the current folder, else the current folder)")
    return parser


def _load(args):
    from ._target import build_mesh, check_mesh, make_step, parse_mesh_spec, simulate_devices

    axes = parse_mesh_spec(args.mesh)
    import math

    simulate_devices(math.prod(axes.values()))
    mesh = build_mesh(axes)
    _progress(f"tracing {args.target}")
    fn, step_args = make_step(args.target, mesh)
    check_mesh(step_args, mesh)
    return mesh, fn, step_args


def _analyze(args) -> int:
    from .analyzer import analyze
    from .reports import format_text, write_json

    mesh, fn, step_args = _load(args)
    if args.rewrite:
        from .rewrites import rewrite

        fn = rewrite(fn, mesh, verify=True, args=step_args, progress=_progress)
    analysis = analyze(fn, *step_args, progress=_progress)
    print(format_text(analysis, title=args.target + (" (rewritten)" if args.rewrite else "")))
    if args.json:
        write_json(analysis, args.json)
        _progress(f"wrote {args.json}")
    return 1 if analysis.findings else 0


def _report(args) -> int:
    from .reports import analyze_pair, prepare_devices, run_sweep, write_html

    sweep = prepare_devices(args.mesh, args.sweep)  # before _load: the sweep may need more devices
    mesh, fn, step_args = _load(args)
    rewrite = not args.no_rewrite
    before, after = analyze_pair(fn, step_args, mesh, rewrite=rewrite, progress=_progress)
    points = None
    if sweep:
        axes = dict(zip(mesh.axis_names, mesh.devices.shape))
        points = run_sweep(args.target, axes, sweep, rewrite=rewrite, progress=_progress,
                           known={axes[sweep[0]]: (before, after)})
    write_html(before, after, path=args.out, sweep=points, title=args.target)
    _progress(f"wrote {args.out}")
    return 1 if (after or before).findings else 0


def _check(args) -> int:
    from .gate import run_check

    return run_check(args, load=_load, progress=_progress)


def _demo(args) -> int:
    from .examples.demo import run_demo

    print(run_demo(args.out, progress=_progress))
    return 0


_COMMANDS = {"analyze": _analyze, "report": _report, "check": _check, "demo": _demo}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed one line of usage
        return int(e.code or 0)
    try:
        return _COMMANDS[args.command](args)
    except ShardlintError as e:
        print(f"shardlint: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardlint: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
