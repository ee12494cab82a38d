"""The `shardlint` command: argparse over the library, nothing else.

Exit codes: 0 clean, 1 findings (or gate failed), 2 usage or input error (one line on
stderr, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys

from ._errors import ShardlintError, UsageError


def _progress(message: str) -> None:
    print(f"shardlint: {message}", file=sys.stderr, flush=True)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?",
                   help="path/to/model.py:make_step or package.module:make_step; "
                        "called with the mesh, returns (step_fn, args)")
    p.add_argument("--xla-dump", metavar="DIR",
                   help="instead of a target: read what a real job compiled from the folder "
                        "XLA_FLAGS=--xla_dump_to=DIR wrote (add --xla_dump_hlo_as_text "
                        "--xla_dump_hlo_pass_re='shardy-xla|sharding-propagation' for the "
                        "findings); --mesh names the axes of a GSPMD module")
    p.add_argument("--module", metavar="NAME",
                   help="with --xla-dump: the module to read (jit_train_step, or its number "
                        "module_0012); default: the largest")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--mesh", help="mesh axes in order, e.g. data=2,context=4; the target "
                                      "receives this mesh")
    where.add_argument("--devices", type=int, metavar="N",
                       help="simulate N CPU devices and call the target with mesh=None, for "
                            "targets that build their own mesh (MaxText does)")
    p.add_argument("--set", dest="options", action="append", metavar="KEY=VALUE",
                   help="pass KEY=VALUE to the target as a keyword argument (repeatable; VALUE "
                        "is read as JSON when it parses, else as a string), e.g. "
                        "--set ici_context_parallelism=4 --set decoder_block=mixtral")


def _add_topology(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", metavar="NAME",
                   help="compile with the real TPU compiler for this TPU topology, no TPU "
                        "needed (libtpu AOT), e.g. v5p:2x2x1; memory is then per-chip HBM. "
                        "With --mesh the mesh is laid over its chips; alone, the target gets "
                        "mesh=None and devices=<the chips> (MaxText's does). "
                        "Needs: pip install 'shardlint[tpu]'")
    p.add_argument("--hbm-gib", type=float, metavar="N",
                   help="flag the step (exit 1) when one device's arguments + outputs + temp "
                        "exceed N GiB (default with --topology: the chip's HBM; v4 32, "
                        "v5e 16, v5p 95, v6e 32)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlint", description="Find where XLA loses the sharding of a JAX step.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("analyze", help="analyze a step: findings, collectives, memory")
    _add_target(p)
    p.add_argument("--json", metavar="FILE", help="write the analysis (shardlint.analysis/2)")
    p.add_argument("--by-scope", action="store_true",
                   help="also print the collectives rolled up by named scope / module path, "
                        "forward and backward apart")
    p.add_argument("--rewrite", action="store_true",
                   help="analyze the step after putting the sharding-preserving MoE in place")
    _add_rewrite_options(p)
    _add_topology(p)
    p = sub.add_parser("report", help="write one self-contained HTML report: findings, "
                                      "collectives and memory, before and after the rewrite")
    _add_target(p)
    p.add_argument("--out", metavar="FILE", default="shardlint-report.html",
                   help="the HTML file to write (default: shardlint-report.html)")
    p.add_argument("--no-rewrite", action="store_true",
                   help="report the step as it is, without the rewritten step beside it")
    _add_rewrite_options(p)
    p.add_argument("--sweep", metavar="AXIS=v1,v2,...",
                   help="also re-run the step with the mesh's AXIS at each size and chart "
                        "per-device memory against it, e.g. --sweep context=1,2,4,8")
    _add_topology(p)
    p = sub.add_parser("demo", help="run the whole story on the built-in example: analyze, "
                                    "rewrite, analyze again, write a report")
    p.add_argument("--out", metavar="DIR", default="shardlint-demo",
                   help="folder for report.html and the JSON analyses (default: ./shardlint-demo)")
    p = sub.add_parser("check", help="fail (exit 1) when the step gains an all-gather that "
                                     "the baseline lacks; --update records the baseline")
    _add_target(p)
    p.add_argument("--baseline", metavar="FILE", default="shardlint.baseline.json",  # gate.DEFAULT_BASELINE
                   help="the baseline (shardlint.baseline/2; default: shardlint.baseline.json)")
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


# Options that need the step's Python; a dump holds only what XLA compiled.
_NEEDS_A_TARGET = (("devices", "--devices"), ("options", "--set"), ("topology", "--topology"),
                   ("rewrite", "--rewrite"), ("batch_axes", "--batch-axes"),
                   ("seq_axes", "--seq-axes"), ("per_shard_capacity", "--per-shard-capacity"),
                   ("sweep", "--sweep"))


def _from_dump(args) -> bool:
    """Whether the command reads an XLA dump; checks that target and options agree."""
    if args.xla_dump is None:
        if args.target is None:
            raise UsageError("give a target (path/to/model.py:make_step) or --xla-dump DIR")
        if args.module is not None:
            raise UsageError("--module picks a module of an XLA dump: it needs --xla-dump DIR")
        return False
    if args.target is not None:
        raise UsageError(f"give a target or --xla-dump, not both ({args.target}, --xla-dump "
                         f"{args.xla_dump})")
    used = [flag for attr, flag in _NEEDS_A_TARGET if getattr(args, attr, None)]
    if used:
        raise UsageError(f"{' and '.join(used)} {'needs' if len(used) == 1 else 'need'} the "
                         f"step's Python (a target); an XLA dump holds only what XLA compiled")
    return True


def _analyze_dump(args):
    from .analyzer import analyze_dump
    from .commands._targets import parse_mesh_spec

    mesh = parse_mesh_spec(args.mesh) if args.mesh else None
    return analyze_dump(args.xla_dump, module=args.module, mesh=mesh, progress=_progress)


def _load(args):
    from .commands._targets import (build_mesh, build_topology_mesh, check_mesh, make_step, mesh_of_args,
                                    parse_mesh_spec, parse_options, simulate_devices)

    options = parse_options(args.options)
    topology = getattr(args, "topology", None)
    if args.devices is not None:
        if topology:
            raise UsageError("--topology brings its own chips: drop --devices (or use --mesh to lay "
                             "a mesh over them)")
        if args.devices < 1:
            raise UsageError(f"--devices {args.devices}: give a positive device count")
        simulate_devices(args.devices)
        _progress(f"tracing {args.target} (mesh=None, {args.devices} simulated CPU devices)")
        fn, step_args = make_step(args.target, None, options)
        return mesh_of_args(step_args, args.target), fn, step_args
    if args.mesh is None:
        if not topology:
            raise UsageError("give --mesh AXES (the target gets that mesh), --devices N (it builds "
                             "its own), or --topology NAME (it builds its own over a TPU topology)")
        from .analyzer._topology import topology_devices

        devices = topology_devices(topology)
        _progress(f"tracing {args.target} (mesh=None, the {len(devices)} chips of {topology})")
        fn, step_args = make_step(args.target, None, options, devices=devices)
        return mesh_of_args(step_args, args.target), fn, step_args
    axes = parse_mesh_spec(args.mesh)
    import math

    if topology:
        mesh = build_topology_mesh(axes, topology)
    else:
        simulate_devices(math.prod(axes.values()))
        mesh = build_mesh(axes)
    _progress(f"tracing {args.target}")
    fn, step_args = make_step(args.target, mesh, options)
    check_mesh(step_args, mesh)
    return mesh, fn, step_args


def _writable_file(path: str, what: str) -> None:
    """Fails now, in one line, if `path` cannot be written (before minutes of analysis)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write {what} to {path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"cannot write {what} to {path}: it is a folder")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"cannot write {what} to {path}: permission denied")


def _writable_folder(path: str, what: str) -> None:
    """Creates `path` if missing; fails now, in one line, if it cannot be written."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot write {what} to {path}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"cannot write {what} to {path}: permission denied")


def _analyze(args) -> int:
    from .analyzer import analyze
    from .analyzer._fit import fit_of
    from .reports import format_scopes, format_text, write_json

    from_dump = _from_dump(args)
    if args.json:
        _writable_file(args.json, "the analysis")
    if from_dump:
        analysis, title = _analyze_dump(args), ""
    else:
        mesh, fn, step_args = _load(args)
        if args.rewrite:
            from .rewrites import rewrite

            fn = rewrite(fn, mesh, verify=_can_verify(args, True), args=step_args,
                         progress=_progress, **_rewrite_options(args, mesh))
        analysis = analyze(fn, *step_args, progress=_progress)
        title = args.target + (" (rewritten)" if args.rewrite else "")
    fit = fit_of(analysis, args.hbm_gib)
    print(format_text(analysis, title=title, fit=fit))
    if args.by_scope:
        print()
        print(format_scopes(analysis))
    if args.json:
        write_json(analysis, args.json)
        _progress(f"wrote {args.json}")
    return 1 if analysis.findings or (fit and not fit.fits) else 0


def _add_rewrite_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-axes", metavar="A,B", type=_axis_list,
                   help="mesh axes that shard the tokens' batch dimension, for the rewrite "
                        "(default: read from the analysis)")
    p.add_argument("--seq-axes", metavar="A,B", type=_axis_list,
                   help="mesh axes that shard the tokens' sequence dimension, for the rewrite "
                        "(default: read from the analysis)")
    p.add_argument("--per-shard-capacity", action="store_true",
                   help="let the rewrite run a capacity computed from the tokens (GShard-style "
                        "dispatch) per shard: each shard drops by its own capacity, so which "
                        "tokens drop changes (refused by default)")


def _axis_list(text: str) -> tuple[str, ...]:
    names = tuple(a.strip() for a in text.split(",") if a.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected mesh axis names like data,fsdp, got {text!r}")
    return names


def _rewrite_options(args, mesh) -> dict:
    """The rewrite's `batch_axes=`/`seq_axes=`/`capacity=` from the command line."""
    options = {"capacity": "per-shard"} if args.per_shard_capacity else {}
    if args.batch_axes and not args.seq_axes:
        raise UsageError("--batch-axes needs --seq-axes too: the rewrite runs per shard over both")
    if not args.seq_axes:
        return options
    mesh_axes = set(mesh.axis_names)
    names = (args.batch_axes or ()) + args.seq_axes
    if not set(names) <= mesh_axes:
        raise UsageError(f"--batch-axes/--seq-axes name {sorted(set(names) - mesh_axes)}, not "
                         f"axes of the mesh ({', '.join(sorted(mesh_axes))})")
    return {**options, "batch_axes": args.batch_axes or (), "seq_axes": args.seq_axes}


def _can_verify(args, rewriting: bool) -> bool:
    """Whether to check the rewrite's numbers: not on TPU topology devices (they only
    compile), nor with per-shard capacity (it drops other tokens by design)."""
    if rewriting and args.per_shard_capacity:
        _progress("not verifying the rewrite's numbers: per-shard capacity drops other tokens")
        return False
    return _can_run(args, rewriting)


def _can_run(args, rewriting: bool) -> bool:
    """TPU topology devices only compile: a rewrite cannot be checked by running it."""
    if args.topology and rewriting:
        _progress("not verifying the rewrite's numbers: --topology devices cannot run")
    return not args.topology


def _report(args) -> int:
    from .commands import analyze_pair, prepare_devices, run_sweep
    from .commands._targets import parse_options
    from .reports import write_html

    if _from_dump(args):
        _writable_file(args.out, "the report")
        before = _analyze_dump(args)
        write_html(before, None, path=args.out, title=args.xla_dump,
                   rewrite_note="read from an XLA dump: the rewrite needs the step's Python")
        _progress(f"wrote {args.out}")
        return 1 if before.findings or not _report_fit(args, before, None) else 0
    if args.sweep and args.mesh is None:
        raise UsageError("--sweep needs --mesh: it re-runs the step with one mesh axis resized")
    _writable_file(args.out, "the report")
    sweep = prepare_devices(args.mesh, args.sweep)  # before _load: the sweep may need more devices
    mesh, fn, step_args = _load(args)
    rewrite = not args.no_rewrite
    notes: list[str] = []
    before, after = analyze_pair(fn, step_args, mesh, rewrite=rewrite, verify=_can_verify(args, rewrite),
                                 progress=_progress, on_rewrite_note=notes.append,
                                 **_rewrite_options(args, mesh))
    for note in notes:
        _progress(note)
    points = None
    if sweep:
        axes = dict(zip(mesh.axis_names, mesh.devices.shape))
        points = run_sweep(args.target, axes, sweep, rewrite=rewrite, progress=_progress,
                           options=parse_options(args.options),
                           known={axes[sweep[0]]: (before, after)},
                           build_mesh=_topology_meshes(args))
    write_html(before, after, path=args.out, sweep=points, title=args.target,
               rewrite_note=notes[0] if notes else "")
    _progress(f"wrote {args.out}")
    fits = _report_fit(args, before, after)
    return 1 if (after or before).findings or not fits else 0


def _topology_meshes(args):
    """With --topology, sweep points are meshes over the same TPU topology."""
    if not args.topology:
        return None
    from .commands._targets import build_topology_mesh

    return lambda axes: build_topology_mesh(axes, args.topology)


def _report_fit(args, before, after) -> bool:
    """Prints the memory fit of each side; False when the step as reported would not fit."""
    from .analyzer._fit import fit_of

    for label, analysis in (("step", before), ("rewritten step", after)):
        fit = fit_of(analysis, args.hbm_gib) if analysis is not None else None
        if fit is not None:
            _progress(f"{label}: {fit.line()}")
    final = fit_of(after or before, args.hbm_gib)
    return final is None or final.fits


def _check(args) -> int:
    from .commands import run_check

    from_dump = _from_dump(args)
    if args.update:
        _writable_file(args.baseline, "the baseline")

    def analysis():
        if from_dump:
            return _analyze_dump(args)
        from .analyzer import analyze

        _mesh, fn, step_args = _load(args)
        return analyze(fn, *step_args, progress=_progress)

    return run_check(args, analysis_of=analysis, progress=_progress)


def _demo(args) -> int:
    from .commands import run_demo

    _writable_folder(args.out, "the demo's report")

    print(run_demo(args.out, progress=_progress))
    return 0


def _negative_values_attached(argv: list[str]) -> list[str]:
    """`--tolerance -5%` as `--tolerance=-5%`: argparse would read `-5%` as an option."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--tolerance":
            value = next(it, None)
            out.append(a if value is None else f"{a}={value}")
        else:
            out.append(a)
    return out


_COMMANDS = {"analyze": _analyze, "report": _report, "check": _check, "demo": _demo}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(_negative_values_attached(sys.argv[1:] if argv is None else list(argv)))
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
