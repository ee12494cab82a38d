"""`shardlint analyze`, `report`, `check` and `demo`: each takes the parsed command line
and returns the exit code (0 clean, 1 findings or a failed gate); a user's mistake is a
`UsageError`, one line. Each names the files it writes first (`_outputs`: refused before
any work if the OS will not take them, removed again on Ctrl-C)."""

from __future__ import annotations

import os

from .._errors import UsageError
from .._format import progress
from ._load import analyze_dump_of, load, load_sweep, reads_dump
from ._outputs import output_file, output_folder


def analyze_command(args) -> int:
    from_dump = reads_dump(args)
    if args.json:
        output_file(args.json, "the analysis")
    if args.sweep:
        return _analyze_sweep(args)
    return _analyze(args, from_dump)


def _analyze(args, from_dump: bool) -> int:
    from ..analyzer import fit_of
    from ..reports import format_scopes, format_text, write_json
    from ._sweep import analyze_pair

    if from_dump:
        analysis, title = analyze_dump_of(args), ""
    else:
        mesh, fn, step_args = load(args)
        if args.rewrite:   # nothing to rewrite: the step as it is, said in one progress line
            pair = analyze_pair(fn, step_args, mesh, rewrite=True, verify=_can_verify(args, True),
                                progress=progress, **rewrite_options(args, mesh))
            analysis = pair.after or pair.before
            title = args.target + (" (rewritten)" if pair.after is not None else "")
        else:
            from ..analyzer import analyze

            analysis = analyze(fn, *step_args, params_argnums=args.params_argnums, progress=progress)
            title = args.target
    fit = fit_of(analysis, args.hbm_gib)
    print(format_text(analysis, title=title, fit=fit))
    if args.by_scope:
        print()
        print(format_scopes(analysis))
    if args.json:
        write_json(analysis, args.json)
        progress(f"wrote {args.json}")
    return 1 if analysis.findings or (fit and not fit.fits) else 0


def _analyze_sweep(args) -> int:
    """`analyze --sweep`: the step (with --rewrite, also the rewritten one) at each point,
    its memory against the ideal, and the lines that hold what does not shrink."""
    from ..reports import format_sweep, write_report_data

    points = _sweep(args, load_sweep(args), bool(args.rewrite))
    print(format_sweep(points, title=args.target))
    if args.json:
        last = points["points"][-1]
        write_report_data(args.json, last["before"], last["after"], points)
        progress(f"wrote {args.json}")
    last = points["points"][-1]
    return 1 if (last["after"] or last["before"]).findings else 0


def rewrite_options(args, mesh) -> dict:
    """The rewrite's `batch_axes=`/`seq_axes=`/`capacity=`/`params_argnums=` from the
    command line; the axes checked against `mesh` where there is one."""
    options = {"capacity": "per-shard"} if args.per_shard_capacity else {}
    if args.params_argnums is not None:
        options["params_argnums"] = args.params_argnums
    if args.batch_axes and not args.seq_axes:
        raise UsageError("--batch-axes needs --seq-axes too: the rewrite runs per shard over both")
    if not args.seq_axes:
        return options
    mesh_axes = set(mesh.axis_names) if mesh is not None else None
    names = (args.batch_axes or ()) + args.seq_axes
    if mesh_axes is not None and not set(names) <= mesh_axes:
        raise UsageError(f"--batch-axes/--seq-axes name {sorted(set(names) - mesh_axes)}, not "
                         f"axes of the mesh ({', '.join(sorted(mesh_axes))})")
    return {**options, "batch_axes": args.batch_axes or (), "seq_axes": args.seq_axes}


def _can_verify(args, rewriting: bool) -> bool:
    """Whether to check the rewrite's numbers: not on TPU topology devices (they only
    compile), nor with per-shard capacity (it drops other tokens by design)."""
    if rewriting and args.per_shard_capacity:
        progress("not verifying the rewrite's numbers: per-shard capacity drops other tokens")
        return False
    return _can_run(args, rewriting)


def _can_run(args, rewriting: bool) -> bool:
    """TPU topology devices only compile: a rewrite cannot be checked by running it."""
    if args.topology and rewriting:
        progress("not verifying the rewrite's numbers: --topology devices cannot run")
    return not args.topology


def report_command(args) -> int:
    from_dump = reads_dump(args)
    output_file(args.out, "the report")
    if args.json:
        output_file(args.json, "the report's data")
    return _report_dump(args) if from_dump else _report(args)


def _report_dump(args) -> int:
    from ._sweep import Pair

    before = analyze_dump_of(args)
    _write_report(args, Pair(before), None, title=args.xla_dump,
                  note="read from an XLA dump: the rewrite needs the step's Python")
    return 1 if before.findings or not _report_fit(args, before, None) else 0


def _report(args) -> int:
    from ._sweep import Pair, analyze_pair

    plan = load_sweep(args)   # before load: a sweep over a mesh axis may need more devices
    rewrite = not args.no_rewrite
    points = None
    if plan is None or not _over_options(args, plan[0]):
        mesh, fn, step_args = load(args)
        pair = analyze_pair(fn, step_args, mesh, rewrite=rewrite, verify=_can_verify(args, rewrite),
                            progress=progress, keep_refusal=True, **rewrite_options(args, mesh))
        if pair.note():
            progress(pair.note())
        if plan is not None:
            key, values, build = plan
            current = dict(zip(mesh.axis_names, mesh.devices.shape))[key]
            points = _sweep(args, plan, rewrite, known={current: pair})
    else:   # the target's option swept: the report's step is the last point's
        points = _sweep(args, plan, rewrite)
        last = points["points"][-1]
        pair = Pair(last["before"], last["after"], refused=last["refused"])
    _write_report(args, pair, points, title=args.target, note=pair.note())
    fits = _report_fit(args, pair.before, pair.after)
    return 1 if (pair.after or pair.before).findings or not fits else 0


def _write_report(args, pair, points, title: str, note: str) -> None:
    """The page, its data (`--json`) and the summary on stdout."""
    from ..gate import mesh_text
    from ..reports import write_html, write_report_data
    from ._summary import summary

    write_html(pair.before, pair.after, path=args.out, sweep=points, title=title, rewrite_note=note)
    progress(f"wrote {args.out}")
    files = [("report", os.path.abspath(args.out))]
    if args.json:
        write_report_data(args.json, pair.before, pair.after, points)
        progress(f"wrote {args.json}")
        files.append(("data", os.path.abspath(args.json)))
    print(summary(f"shardlint report: {title} on mesh {mesh_text(pair.before.mesh)}", pair, points, files))


def _over_options(args, key: str) -> bool:
    from ._targets import parse_mesh_spec

    return not (args.mesh and key in parse_mesh_spec(args.mesh))


def _sweep(args, plan, rewrite: bool, known=None) -> dict:
    """The sweep's points (on the engine `--jobs`/`--ray` say); each point's headline on
    stderr as it comes."""
    from ._engine import engine_of
    from ._sweep import run_sweep

    key, values, build = plan
    return run_sweep(key, values, build, rewrite=rewrite, progress=progress, known=known,
                     rewrite_options=rewrite_options(args, None),
                     engine=engine_of(args, least=0, progress=progress))


def _report_fit(args, before, after) -> bool:
    """Prints the memory fit of each side; False when the step as reported would not fit."""
    from ..analyzer import fit_of

    for label, analysis in (("step", before), ("rewritten step", after)):
        fit = fit_of(analysis, args.hbm_gib) if analysis is not None else None
        if fit is not None:
            progress(f"{label}: {fit.line()}")
    final = fit_of(after or before, args.hbm_gib)
    return final is None or final.fits


def check_command(args) -> int:
    from ._check import run_check

    from_dump = reads_dump(args)
    if args.update:
        output_file(args.baseline, "the baseline")

    def analysis():
        if from_dump:
            return analyze_dump_of(args)
        from ..analyzer import analyze

        _mesh, fn, step_args = load(args)
        return analyze(fn, *step_args, params_argnums=args.params_argnums, progress=progress)

    return run_check(args, analysis_of=analysis, progress=progress)


def demo_command(args) -> int:
    from ._demo import FILES, run_demo

    output_folder(args.out, "the demo's report", files=FILES)
    print(run_demo(args.out, progress=progress))
    return 0
