"""The `shardlint` command: its arguments, parsed; what each command does is in
`shardlint.commands` (`_load`: the step or dump it runs on; `_run`: the commands).

Exit codes: 0 clean, 1 findings (or gate failed), 2 usage or input error (one line on
stderr, no traceback unless `--traceback`), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys

from . import _interrupt
from ._errors import exit_code


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
    p.add_argument("--params-argnums", type=_argnums, metavar="I,J",
                   help="the positional arguments of the step that hold parameters and optimizer "
                        "state (default: read from the values: a floating-point argument is a "
                        "weight until something computes from it or it is treated as tokens)")
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


def _common() -> argparse.ArgumentParser:
    """The options every command takes."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--traceback", action="store_true",
                   help="after an error's one line, print the whole Python traceback (the "
                        "error your code or JAX raised, and where)")
    return p


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlint", description="Find where XLA loses the sharding of a JAX step.")
    sub = parser.add_subparsers(dest="command", required=True)
    common = _common()
    p = sub.add_parser("analyze", parents=[common], help="analyze a step: findings, collectives, memory")
    _add_target(p)
    p.add_argument("--json", metavar="FILE", help="write the analysis (shardlint.analysis/3)")
    p.add_argument("--by-scope", action="store_true",
                   help="also print the collectives rolled up by named scope / module path, "
                        "forward and backward apart")
    p.add_argument("--rewrite", action="store_true",
                   help="analyze the step after putting the sharding-preserving MoE in place")
    _add_sweep(p)
    _add_rewrite_options(p)
    _add_topology(p)
    p = sub.add_parser("report", parents=[common], help="write one self-contained HTML report: findings, "
                                      "collectives and memory, before and after the rewrite")
    _add_target(p)
    p.add_argument("--out", metavar="FILE", default="shardlint-report.html",
                   help="the HTML file to write (default: shardlint-report.html)")
    p.add_argument("--no-rewrite", action="store_true",
                   help="report the step as it is, without the rewritten step beside it")
    _add_rewrite_options(p)
    p.add_argument("--json", metavar="FILE",
                   help="also write the report's data (shardlint.report-data/1): the analyses "
                        "before and after, and the sweep's memory with the lines that hold it")
    _add_sweep(p)
    _add_topology(p)
    p = sub.add_parser("plan", parents=[common], help="compile the step at every point of a grid, as "
                       "written and fixed: which mesh, and how long a sequence, fits a device")
    _add_target(p)
    p.add_argument("--grid", action="append", metavar="KEY=v1,v2,...",
                   help="the values of an axis of --mesh or an option of the target to try, "
                        "e.g. --grid ici_context_parallelism=1,2,4,8 (repeatable: every "
                        "combination is a point); keys joined by ':' move together, e.g. "
                        "--grid ici_context_parallelism:per_device_batch_size=1:1,4:0.25")
    p.add_argument("--longest", metavar="KEY=lo..hi",
                   help="at each point, the longest value of KEY (a target option) that fits, "
                        "before and after the fix, to a multiple of 1024 (or lo, if smaller; "
                        "KEY=lo..hi:step to say), led by each compile's memory need, e.g. "
                        "--longest max_target_length=4096..262144")
    _add_topology(p)
    _add_rewrite_options(p)
    _add_engine(p, jobs=1, default="1")
    p.add_argument("--cache", metavar="DIR",
                   help="keep each point's result in DIR and read it back where the same point "
                        "(options, mesh, sides, limit; shardlint, JAX and libtpu versions) comes again")
    p.add_argument("--json", metavar="FILE", help="write the plan (shardlint.plan/1)")
    p.add_argument("--out", metavar="FILE", help="write the plan as an HTML page")
    p = sub.add_parser("demo", parents=[common], help="run the whole story on the built-in example: analyze, "
                                    "rewrite, analyze again, write a report")
    p.add_argument("--out", metavar="DIR", default="shardlint-demo",
                   help="folder for report.html and the JSON analyses (default: ./shardlint-demo)")
    p = sub.add_parser("check", parents=[common], help="fail (exit 1) when the step gains an all-gather that "
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


def _add_sweep(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", metavar="KEY=v1,v2,...",
                   help="re-run the step at each value of KEY, an axis of --mesh or an option of "
                        "the target (--set keys), and say which lines hold the memory that does "
                        "not shrink, e.g. --sweep context=1,2,4,8 or --sweep "
                        "ici_context_parallelism=1,2,4,8")
    _add_engine(p, jobs=0, default="0: one after another in this process")


def _add_engine(p: argparse.ArgumentParser, *, jobs: int, default: str) -> None:
    """Where a plan's or a sweep's points run (`commands._engine`)."""
    p.add_argument("--jobs", type=int, default=jobs, metavar="N",
                   help=f"compile N points at once, each in a process of its own (default {default}; "
                        "each compile of a large step takes its own memory)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run each point as a task on the Ray cluster at ADDRESS ('auto': the "
                        "one this machine belongs to); needs pip install 'shardlint[ray]'")
    p.add_argument("--ray-cpus", type=float, default=1.0, metavar="N",
                   help="CPUs each Ray task asks for (default 1)")
    p.add_argument("--ray-memory-gib", type=float, metavar="N",
                   help="memory each Ray task asks for, in GiB (default: none asked)")


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


def _argnums(text: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(a) for a in text.split(",") if a.strip())
    except ValueError:
        numbers = ()
    if not numbers or min(numbers) < 0:
        raise argparse.ArgumentTypeError(f"expected argument positions like 0,1, got {text!r}")
    return numbers


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


def _commands():
    from .commands import analyze_command, check_command, demo_command, plan_command, report_command

    return {"analyze": analyze_command, "report": report_command, "check": check_command,
            "demo": demo_command, "plan": plan_command}


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit code (130 after Ctrl-C, once what the run had
    created is removed)."""
    parser = _parser()
    try:
        args = parser.parse_args(_negative_values_attached(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as e:  # argparse already printed one line of usage
        return int(e.code or 0)
    return exit_code(lambda: _commands()[args.command](args), show_traceback=args.traceback)


def run() -> None:
    """The console script and `python -m shardlint`: `main` on the process's arguments, then
    exit with its code. Ctrl-C ends the process at once, wherever it is (`shardlint._interrupt`)."""
    _interrupt.exit_on_sigint()
    sys.exit(main())


if __name__ == "__main__":
    run()
