"""The runs behind a report: before and after the rewrite, and the sweep over one mesh axis.

A sweep re-runs the target with one mesh axis set to each value, so the device count
changes from point to point. JAX fixes its device count when the backend starts, so
`prepare_devices` asks for the largest mesh the sweep needs and starts the backend at
once; a later, smaller request (the CLI's own set-up) then finds enough devices. The
result is the structure `shardlint.reports` draws (`reports._sweep`).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any, Callable

from .._errors import NothingToRewrite, ShardlintError, UsageError
from ..analyzer import Analysis

Progress = Callable[[str], None]


def parse_sweep_spec(text: str) -> tuple[str, tuple[int, ...]]:
    """`context=1,2,4,8` -> ("context", (1, 2, 4, 8))."""
    m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*([\d,\s]+)", text or "")
    values = tuple(int(v) for v in m.group(2).replace(" ", "").split(",") if v) if m else ()
    if not m or not values:
        raise UsageError(f"--sweep: cannot read {text!r}; write AXIS=v1,v2,..., "
                         f"e.g. --sweep context=1,2,4,8")
    if min(values) < 1:
        raise UsageError(f"--sweep: sizes must be >= 1, got {text!r}")
    if len(set(values)) != len(values):
        raise UsageError(f"--sweep: {text!r} repeats a value")
    return m.group(1), tuple(sorted(values))


def sweep_meshes(mesh: dict[str, int], axis: str, values: tuple[int, ...]) -> list[dict[str, int]]:
    """The mesh of each sweep point: `mesh` with `axis` set to the value, order kept."""
    if axis not in mesh:
        raise UsageError(f"--sweep: axis {axis!r} is not in --mesh {mesh}; sweep one of "
                         f"{', '.join(mesh)}")
    return [{**mesh, axis: v} for v in values]


def device_count(mesh: dict[str, int], sweep: tuple[str, tuple[int, ...]] | None) -> int:
    """Devices to simulate: the largest of the mesh and every sweep point's mesh."""
    meshes = [mesh] + (sweep_meshes(mesh, *sweep) if sweep else [])
    return max(math.prod(m.values()) for m in meshes)


def prepare_devices(mesh_spec: str, sweep_spec: str | None) -> tuple[str, tuple[int, ...]] | None:
    """Parses --mesh/--sweep and, for a sweep, simulates its largest mesh and starts JAX.

    Without a sweep nothing happens here: the CLI's usual set-up sizes the backend.
    Returns the parsed sweep (axis, values) or None.
    """
    from ._targets import parse_mesh_spec, simulate_devices

    if not sweep_spec:
        return None
    mesh = parse_mesh_spec(mesh_spec)
    sweep = parse_sweep_spec(sweep_spec)
    simulate_devices(device_count(mesh, sweep))
    import jax

    jax.devices()  # start the backend now, at the sweep's size
    return sweep


def analyze_pair(fn: Callable, args: tuple, mesh, *, rewrite: bool = True, verify: bool = True,
                 progress: Progress | None = None, on_rewrite_note: Callable[[str], None] | None = None,
                 **rewrite_options) -> tuple[Analysis, Analysis | None]:
    """Analyzes the step, then (with `rewrite`) the rewritten step on the same arguments.

    With `on_rewrite_note`, a rewrite that is refused (`RewriteError`) or that changes
    nothing is said to it in one sentence and the pair comes back without an after side
    (there is nothing to compare), instead of raising. `rewrite_options` are the rewrite's
    `batch_axes=`, `seq_axes=`, `capacity=` and `params_argnums=` (the analyses' too).
    """
    import warnings

    from .._errors import NothingToRewrite, RewriteError
    from ..analyzer import analyze
    from ..rewrites import rewrite as rewrite_step

    params_argnums = rewrite_options.get("params_argnums")
    before = analyze(fn, *args, params_argnums=params_argnums, progress=progress)
    if not rewrite:
        return before, None
    try:
        with warnings.catch_warnings():
            if on_rewrite_note is not None:   # said on the page instead
                warnings.simplefilter("ignore", NothingToRewrite)
            fixed = rewrite_step(fn, mesh, verify=verify, args=args, analysis=before, progress=progress,
                                 **rewrite_options)
    except RewriteError as e:
        if on_rewrite_note is None:
            raise
        on_rewrite_note(f"The rewrite was refused: {e}")
        return before, None
    if fixed.changed is False and on_rewrite_note is not None:
        on_rewrite_note(f"Nothing was rewritten: {fixed.notes[-1].removeprefix('nothing to rewrite: ')}.")
        return before, None
    if progress:
        progress("analyzing the rewritten step")
    return before, analyze(fixed, *args, params_argnums=params_argnums, progress=progress)


def run_sweep(target: str, mesh: dict[str, int], sweep: tuple[str, tuple[int, ...]], *,
              rewrite: bool = True, progress: Progress | None = None,
              known: dict[int, tuple[Analysis, Analysis | None]] | None = None,
              build_mesh: Callable[[dict[str, int]], Any] | None = None,
              options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Re-runs TARGET at each sweep value; `known` holds points already analyzed (by value).

    `build_mesh(axes)` makes each point's mesh (default: simulated CPU devices; the CLI
    passes TPU topology meshes for `--topology`); `options` are the target's `--set`
    keyword arguments.
    """
    from ._targets import build_mesh as cpu_mesh
    from ._targets import check_mesh, make_step

    build_mesh = build_mesh or cpu_mesh

    axis, values = sweep
    known = known or {}
    points = []
    for value, axes in zip(values, sweep_meshes(mesh, axis, values)):
        if value in known:
            before, after = known[value]
        else:
            if progress:
                progress(f"sweep {axis}={value}: mesh {axes}")
            try:
                sweep_mesh = build_mesh(axes)
                fn, args = make_step(target, sweep_mesh, options)
                check_mesh(args, sweep_mesh)
                with warnings.catch_warnings():   # a point may have nothing to rewrite (context 1)
                    warnings.simplefilter("ignore", NothingToRewrite)
                    before, after = analyze_pair(fn, args, sweep_mesh, rewrite=rewrite, verify=False,
                                                 progress=progress)
            except ShardlintError as e:
                raise type(e)(f"--sweep {axis}={value}: {e}") from e
        points.append({"value": value, "before": before, "after": after})
    return {"axis": axis, "points": points}
