"""`shardlint check`: the command-line face of the gate. The gate package is a library
(keys, baselines, the comparison, its formats); reading the command's options, loading the
target and deciding the exit code happen here, in the commands layer.

Order matters for speed and for clear errors: options and the baseline are validated
before the step is traced and compiled. Everything the command prints for a machine
(JSON, workflow commands, SARIF) goes to stdout alone; progress goes to stderr.
"""

from __future__ import annotations

import os
import shlex
from typing import Callable

from .._vocab import COLLECTIVE_KINDS
from ..gate import (BaselineError, BaselineRef, compare, default_root, headline, mesh_text,
                    parse_kinds, parse_tolerance, read_baseline, record, render)


def update_command(target: str | None, mesh: str | None, baseline: str, root: str | None = None,
                   devices: int | None = None, options: list[str] | None = None,
                   topology: str | None = None, xla_dump: str | None = None,
                   module: str | None = None) -> str:
    where = (["--mesh", mesh] if mesh is not None else
             ["--devices", str(devices)] if devices is not None else [])
    where += ["--topology", topology] if topology else []
    where += [w for option in options or () for w in ("--set", option)]
    source = [target] if target is not None else ["--xla-dump", xla_dump]
    source += ["--module", module] if module else []
    words = ["shardlint", "check", *source, *where, "--baseline", baseline]
    words += ["--root", root] if root else []
    return " ".join(shlex.quote(w) for w in words) + " --update"


def run_check(args, *, analysis_of: Callable, progress: Callable[[str], None],
              out: Callable[[str], None] = print) -> int:
    """args: target or xla_dump, mesh, baseline, update, format, kinds, tolerance, root
    (argparse). `analysis_of()` analyzes the step (or reads its dump) once the options and
    the baseline are known to be good. Returns the exit code: 0 passed or recorded, 1 a
    watched collective is new or grew; errors raise ShardlintError (2)."""
    kinds = parse_kinds(args.kinds)
    tolerance = parse_tolerance(args.tolerance)
    root = os.path.abspath(args.root) if args.root else default_root()
    hint = update_command(args.target, args.mesh, args.baseline, args.root, args.devices,
                          args.options, getattr(args, "topology", None),
                          getattr(args, "xla_dump", None), getattr(args, "module", None))
    before = None if args.update else read_baseline(args.baseline, how_to_create=hint)
    analysis = analysis_of()
    if not args.update:
        if before.mesh and dict(before.mesh) != dict(analysis.mesh):
            raise BaselineError(
                f"the baseline {args.baseline} was recorded on mesh {mesh_text(before.mesh)}, this "
                f"run is on {mesh_text(analysis.mesh)}: its keys hold per-device shapes, so every "
                f"collective would read as new. Run on the baseline's mesh, or record a baseline "
                f"for this one: {hint}")
        result = compare(analysis, before, root=root, baseline_path=args.baseline, kinds=kinds,
                         tolerance=tolerance, update_hint=hint)
        out(render(result, args.format))
        return 0 if result.passed else 1
    try:
        previous = read_baseline(args.baseline)
    except BaselineError:
        previous = None
    written: list[str] = []
    baseline = record(analysis, BaselineRef(path=args.baseline, update=True,
                                            target=args.target or f"--xla-dump {args.xla_dump}",
                                            on_write=written.append), root)
    what = (f"{len(baseline.entries)} collective key(s) on mesh {mesh_text(baseline.mesh)}, "
            f"jax {baseline.jax}")
    out(f"shardlint: wrote baseline {args.baseline} ({what})" if written else
        f"shardlint: baseline {args.baseline} is up to date ({what})")
    if previous is not None:
        changes = compare(analysis, previous, root=root, kinds=COLLECTIVE_KINDS).changes
        for change in changes:
            out(f"  accepted: {headline(change)}  [{change.key}]")
    return 0
