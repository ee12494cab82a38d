"""The runs behind a report: before and after the rewrite, and a sweep over one knob.

A sweep re-runs the target at each value of one mesh axis or one of its options (`--set`
keys, such as MaxText's `ici_context_parallelism`). Over a mesh axis the device count
changes from point to point; JAX fixes its device count when the backend starts, so
`start_devices` asks for the largest mesh the sweep needs and starts the backend at
once; a later, smaller request (the CLI's own set-up) then finds enough devices. The points
run on the plan's engine (`_engine`): one after another in this process by default, or each
in a process of its own (`--jobs`, `--ray`), where a point starts JAX at its own device
count (`MeshPoints`). The result is the structure `shardlint.reports` draws
(`reports._sweep`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, Callable

from .._errors import NothingToRewrite, RewriteError, ShardlintError, UsageError, first_line
from ..analyzer import Analysis
from ._engine import Engine, Failed

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


def start_devices(mesh: dict[str, int], sweep: tuple[str, tuple[int, ...]]) -> None:
    """Simulates the largest mesh the sweep needs and starts JAX's backend at that size."""
    from ._targets import simulate_devices

    simulate_devices(device_count(mesh, sweep))
    import jax

    jax.devices()


@dataclasses.dataclass(frozen=True)
class Pair:
    """A step analyzed before and after the rewrite. `after` is None where there is no
    rewritten step to analyze: none was asked for, it was refused (`refused`, the
    RewriteError's text) or nothing was rewritten (`unchanged`, why)."""

    before: Analysis
    after: Analysis | None = None
    refused: str = ""
    unchanged: str = ""
    regions: int = 0          # routed regions (or MoE layers) the rewrite runs per shard

    def note(self) -> str:
        """One sentence for the page where there is no after side ("" where there is)."""
        if self.refused:
            return f"The rewrite was refused: {self.refused}"
        if self.unchanged:
            return f"Nothing was rewritten: {self.unchanged}."
        return ""


def analyze_pair(fn: Callable, args: tuple, mesh, *, rewrite: bool = True, verify: bool = True,
                 progress: Progress | None = None, keep_refusal: bool = False,
                 **rewrite_options) -> Pair:
    """Analyzes the step, then (with `rewrite`) the rewritten step on the same arguments.

    A rewrite that changes nothing comes back `unchanged`, with no after side (nothing to
    compare; the rewrite said why on `progress`, and no warning is shown). With
    `keep_refusal` a refused rewrite (`RewriteError`) comes back `refused` instead of
    raising. `rewrite_options` are the rewrite's `batch_axes=`, `seq_axes=`, `capacity=`
    and `params_argnums=` (the analyses' too).
    """
    from ..analyzer import analyze
    from ..rewrites import rewrite as rewrite_step

    params_argnums = rewrite_options.get("params_argnums")
    before = analyze(fn, *args, params_argnums=params_argnums, progress=progress)
    if not rewrite:
        return Pair(before)
    try:
        with warnings.catch_warnings():   # the result says it, in one line
            warnings.simplefilter("ignore", NothingToRewrite)
            fixed = rewrite_step(fn, mesh, verify=verify, args=args, analysis=before, progress=progress,
                                 **rewrite_options)
    except RewriteError as e:
        if not keep_refusal:
            raise
        return Pair(before, refused=str(e))
    if fixed.changed is False:
        return Pair(before, unchanged=fixed.notes[-1].removeprefix("nothing to rewrite: "))
    if progress:
        progress("analyzing the rewritten step")
    return Pair(before, analyze(fixed, *args, params_argnums=params_argnums, progress=progress),
                regions=fixed.regions)


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    """One point of a sweep, as a worker gets it (`_engine`): picklable where `build_point`
    is, so that it may run in a process of its own."""

    key: str
    value: int
    build_point: Callable[[int], tuple]
    rewrite: bool
    progress: Progress | None
    rewrite_options: dict[str, Any]


def analyze_point(point: SweepPoint) -> Pair:
    """A sweep point's step analyzed, and rewritten where asked (refusals kept)."""
    if point.progress:
        point.progress(f"sweep {point.key}={point.value}")
    try:
        mesh, fn, args = point.build_point(point.value)
        pair = analyze_pair(fn, args, mesh, rewrite=point.rewrite, verify=False, progress=point.progress,
                            keep_refusal=True, **point.rewrite_options)
    except ShardlintError as e:
        raise type(e)(f"--sweep {point.key}={point.value}: {e}") from e
    if pair.refused and point.progress:
        point.progress(f"sweep {point.key}={point.value}: the rewrite was refused: {first_line(pair.refused)}")
    return pair


def run_sweep(key: str, values: tuple[int, ...], build_point: Callable[[int], tuple], *,
              rewrite: bool = True, progress: Progress | None = None,
              known: dict[int, Pair] | None = None,
              rewrite_options: dict[str, Any] | None = None, engine: Engine | None = None) -> dict[str, Any]:
    """Analyzes the step at each value of `key` (and with `rewrite`, the rewritten step);
    `build_point(value)` returns that point's `(mesh, step, args)`, `known` holds points
    already analyzed (by value). The points run on `engine` (`_engine.Engine`, the plan's;
    default: one after another in this process). Returns `{"axis": key, "points": [...]}`
    (`reports._sweep`): a point where the rewrite changes nothing has the step itself as
    its after side; one where it is refused has none, and says why (`refused`)."""
    known = dict(known or {})
    engine = engine or Engine(jobs=0, progress=progress)
    todo = [v for v in values if v not in known]
    specs = [SweepPoint(key, v, build_point, rewrite, progress, dict(rewrite_options or {})) for v in todo]
    for value, pair in zip(todo, engine.map(analyze_point, specs, [f"sweep {key}={v}" for v in todo])):
        if isinstance(pair, Failed):
            raise ShardlintError(f"--sweep {key}={value}: {pair.why}")
        known[value] = pair
    points = []
    for value in values:
        pair = known[value]
        after = pair.before if pair.unchanged else pair.after
        points.append({"value": value, "before": pair.before, "after": after, "refused": pair.refused})
    return {"axis": key, "points": points}


def mesh_points(target: str, mesh: dict[str, int], axis: str, *, options: dict[str, Any] | None = None,
                topology: str | None = None) -> MeshPoints:
    """The points of a sweep over one axis of `mesh`: simulated CPU devices, or the chips of
    a TPU `topology`, the target called with each point's mesh."""
    sweep_meshes(mesh, axis, ())   # the axis must be the mesh's
    return MeshPoints(target, dict(mesh), axis, dict(options or {}), topology)


@dataclasses.dataclass(frozen=True)
class MeshPoints:
    """`(mesh, step, args)` at a value of one mesh axis (see `mesh_points`)."""

    target: str
    mesh: dict[str, int]
    axis: str
    options: dict[str, Any]
    topology: str | None = None

    def __call__(self, value: int) -> tuple:
        from ._targets import build_mesh, build_topology_mesh, check_mesh, make_step, simulate_devices

        axes = {**self.mesh, self.axis: value}
        if self.topology:
            point_mesh = build_topology_mesh(axes, self.topology)
        else:
            simulate_devices(math.prod(axes.values()))   # in a point's own process, its devices
            point_mesh = build_mesh(axes)
        fn, args = make_step(self.target, point_mesh, self.options)
        check_mesh(args, point_mesh)
        return point_mesh, fn, args
