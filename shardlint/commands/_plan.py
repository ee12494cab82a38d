"""`shardlint plan`: which mesh, and how long a sequence, fits a device, with and without the fix.

Every point of the grid (`--grid KEY=v1,v2,...`: an axis of `--mesh`, or a target option;
`--grid A:B=a1:b1,a2:b2` ties keys that move together) is compiled as written and as fixed, in a process of its own (`_engine`: local processes, or
Ray tasks), for the devices `--mesh`, `--devices` or `--topology` give. With `--longest
KEY=lo..hi` each side of each point also searches the longest value of KEY that fits, down
to a multiple of the step (1024 by default, or `lo` where that is smaller; `lo..hi:step` to
say), led by the compiles' needs (`next_probe`); a compile the compiler refused for lack of
memory does not fit. The search's rounds run every point's next probe at once.

A point that cannot be compiled for another reason is a row that says why. The best row
fits after the fix and, among those, is the longest (with `--longest`), then moves the
fewest collective bytes per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import re
from typing import Any

from .._errors import UsageError, first_line
from .._files import write_text
from .._format import progress
from ..reports import Longest, Plan, PlanPoint, PlanRow, PlanSide, format_plan
from ._engine import Engine, Failed, engine_of

SIDES = ("before", "after")
BEST_RULE = "fits after the fix; then the longest that fits after it; then the fewest collective bytes per step"


@dataclasses.dataclass(frozen=True)
class PointSpec:
    """What a worker process needs to compile one point: the command line's target and
    devices, the point's options and mesh, and which sides to compile."""

    target: str
    mesh: str | None
    devices: int | None
    topology: str | None
    options: tuple[str, ...]           # `--set` words, the point's values among them
    values: tuple[tuple[str, Any], ...]
    sides: tuple[str, ...]
    hbm_gib: float | None
    rewrite: dict                      # the rewrite's options (capacity, axes, params_argnums)


def parse_grid(words: list[str] | None) -> dict[tuple[str, ...], tuple[tuple, ...]]:
    """`--grid KEY=v1,v2,...` words -> {(KEY,): ((v1,), (v2,), ...)}, each value read as JSON
    where it parses (as `--set` reads values), in the order given. Keys tied by `:` move
    together: `--grid ici_context_parallelism:per_device_batch_size=1:1,4:0.25` is two
    points, not four."""
    grid: dict[tuple[str, ...], tuple[tuple, ...]] = {}
    seen: set[str] = set()
    for word in words or ():
        left, sep, text = word.partition("=")
        keys = tuple(k.strip() for k in left.split(":"))
        values = tuple(tuple(_value(v.strip()) for v in item.split(":"))
                       for item in text.split(",") if item.strip())
        if not sep or not all(k.isidentifier() for k in keys) or not values:
            raise UsageError(f"--grid {word!r}: write KEY=v1,v2,..., e.g. --grid ici_context_parallelism=1,2,4,8")
        if any(len(v) != len(keys) for v in values):
            raise UsageError(f"--grid {word!r}: give each point {len(keys)} values, one per key "
                             f"({':'.join(keys)}), joined by ':'")
        again = [k for k in keys if k in seen] or [k for k in keys if keys.count(k) > 1]
        if again:
            raise UsageError(f"--grid: {again[0]!r} is given twice")
        if len(set(map(str, values))) != len(values):
            raise UsageError(f"--grid {word!r} repeats a value")
        seen.update(keys)
        grid[keys] = values
    return grid


def grid_points(grid: dict[tuple[str, ...], tuple[tuple, ...]]) -> list[dict[str, Any]]:
    """Every combination of the grid's words, tied keys together: one dict of values per point."""
    return [{k: v for keys, values in zip(grid, combo) for k, v in zip(keys, values)}
            for combo in itertools.product(*grid.values())]


def grid_values(grid: dict[tuple[str, ...], tuple[tuple, ...]]) -> dict[str, tuple]:
    """Each key's values, in the order given (a tied key's, point by point)."""
    return {k: tuple(v[i] for v in values) for keys, values in grid.items() for i, k in enumerate(keys)}


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_longest(text: str | None) -> tuple[str, int, int, int] | None:
    """`max_target_length=4096..262144` (or `...:step`) -> (key, lo, hi, step)."""
    if not text:
        return None
    m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(\d+)\s*\.\.\s*(\d+)\s*(?::\s*(\d+))?\s*", text)
    if not m:
        raise UsageError(f"--longest {text!r}: write KEY=lo..hi (or KEY=lo..hi:step), "
                         "e.g. --longest max_target_length=4096..262144")
    key, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
    step = int(m.group(4)) if m.group(4) else min(1024, lo)
    if not 0 < lo <= hi or step < 1:
        raise UsageError(f"--longest {text!r}: needs 0 < lo <= hi and a step >= 1")
    return key, lo, hi, step


def next_probe(fits: dict[int, bool | None], lo: int, hi: int, step: int,
               needs: dict[int, int] | None = None, limit: int | None = None) -> int | None:
    """The next value to compile in the search for the longest value in [lo, hi] that fits,
    given what was compiled so far, in order (`fits`: value -> fits; None: it could not be
    compiled, which ends the search); None when the search is over.

    Without the compiles' needs it doubles from `lo`, then halves the gap between the last
    value that fit and the first that did not, on the step's multiples. With them (`needs`:
    value -> bytes, against `limit`), the next value is where the line through the two
    nearest needs meets the limit, rounded down to the step: a step's memory grows about
    linearly with its sequence, so the search ends in four or five compiles, not ten. It
    halves the gap instead wherever the line has not halved it over the last two compiles."""
    if lo not in fits:
        return lo
    if not fits[lo] or any(ok is None for ok in fits.values()):
        return None
    good = max(v for v, ok in fits.items() if ok)
    bad = min((v for v, ok in fits.items() if ok is False and v > good), default=None)
    first = (good // step + 1) * step            # the step's multiples above good
    if bad is None:
        if good >= hi:
            return None
        below = sorted(v for v, ok in fits.items() if ok)[-2:]
        guess = _where_need_meets(limit, needs, *below, step) if len(below) == 2 else None
        if guess is not None and guess > good:
            return min(guess, hi)
        if guess is not None and good - below[0] > step:     # the line ends here: one step on
            return min(first, hi)
        return min(2 * good, hi)
    last = (bad - 1) // step * step
    if first > last:
        return None
    guess = _where_need_meets(limit, needs, good, bad, step)
    if guess is None or _stalled(fits):
        guess = (good + bad) // 2 // step * step
    return min(max(guess, first), last)


def _where_need_meets(limit: int | None, needs: dict[int, int] | None, a: int, b: int, step: int) -> int | None:
    """The value, rounded down to the step, where the line through the needs at a and b
    reaches the limit; None where a need is unknown or the line does not rise."""
    if limit is None or needs is None or a not in needs or b not in needs or needs[b] <= needs[a]:
        return None
    slope = (needs[b] - needs[a]) / (b - a)
    return int(a + (limit - needs[a]) / slope) // step * step


def _stalled(fits: dict[int, bool | None]) -> bool:
    """Whether the last two compiles left the gap between fitting and not more than half
    what it was before them."""
    gaps = []
    for n in range(1, len(fits) + 1):
        seen = list(fits.items())[:n]
        good = max((v for v, ok in seen if ok), default=None)
        bad = min((v for v, ok in seen if ok is False and good is not None and v > good), default=None)
        if bad is not None:
            gaps.append(bad - good)
    return len(gaps) >= 3 and gaps[-1] > gaps[-3] / 2


def longest_fitting(fits: dict[int, bool | None]) -> int | None:
    return max((v for v, ok in fits.items() if ok), default=None)


def evaluate(spec: PointSpec) -> PlanPoint:
    """Compiles one point's sides; runs in a process of its own (`_engine`), whose peak
    resident memory is then what the compiles took."""
    return dataclasses.replace(_compiled_point(spec), host_peak_bytes=_host_peak_bytes())


def _compiled_point(spec: PointSpec) -> PlanPoint:
    """One point's sides. The after side needs the before side's analysis (it says what to
    rewrite), so both are compiled for it."""
    from ..analyzer import fit_of
    from ._load import load
    from ._sweep import analyze_pair

    args = argparse.Namespace(target=spec.target, mesh=spec.mesh, devices=spec.devices,
                              topology=spec.topology, options=list(spec.options))
    mesh, fn, step_args = load(args)
    pair = analyze_pair(fn, step_args, mesh, rewrite="after" in spec.sides, verify=False,
                        keep_refusal=True, **spec.rewrite)
    before = _side(pair.before, fit_of(pair.before, spec.hbm_gib))
    if pair.refused:
        return PlanPoint(values=dict(spec.values), before=before,
                         note=f"the rewrite was refused: {first_line(pair.refused)}")
    if pair.unchanged:
        return PlanPoint(values=dict(spec.values), before=before, after=before,
                         note=f"nothing to rewrite ({pair.unchanged})")
    after = None if pair.after is None else _side(pair.after, fit_of(pair.after, spec.hbm_gib))
    return PlanPoint(values=dict(spec.values), before=before, after=after, regions=pair.regions)


def _host_peak_bytes() -> int:
    """This process's peak resident memory so far: a point's process (`_engine`: spawned,
    or a Ray worker that runs one task) holds one point's compiles."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024   # bytes there, KiB on Linux


def _side(analysis, fit) -> PlanSide:
    moved: dict[str, int] = {}
    for c in analysis.collectives:
        key = f"{c.kind} over {','.join(c.axes) or '-'}"
        moved[key] = moved.get(key, 0) + c.step_bytes
    memory = analysis.memory
    return PlanSide(fits=fit.fits, need_bytes=fit.need_bytes, limit_bytes=fit.limit_bytes,
                    argument_bytes=memory.argument_bytes, temp_bytes=memory.temp_bytes,
                    peak_bytes=memory.peak_bytes, refused=fit.refused is not None,
                    collective_bytes=dict(sorted(moved.items())))


def run_plan(args, engine: Engine) -> Plan:
    """The plan the command line asks for: every grid point, and with `--longest` its search."""
    from ._run import rewrite_options
    from ._targets import parse_mesh_spec, parse_options

    words = parse_grid(args.grid)
    grid = grid_values(words)
    longest = parse_longest(args.longest)
    if not grid and not longest:
        raise UsageError("plan: give at least one --grid KEY=v1,v2,... or --longest KEY=lo..hi")
    if args.hbm_gib is None and not args.topology:
        raise UsageError("plan: give --topology NAME (the chip's HBM is the limit) or --hbm-gib N")
    if longest and longest[0] in grid:
        raise UsageError(f"--longest {longest[0]} is also a --grid key: give it in one of them")
    given = parse_options(args.options)   # says so where a word is not key=value
    clash = [k for k in grid if k in given]
    if clash:
        raise UsageError(f"--grid {clash[0]}=... and --set {clash[0]}=...: give its values in --grid only")
    axes = parse_mesh_spec(args.mesh) if args.mesh else {}
    options = rewrite_options(args, None)
    points = grid_points(words)
    specs = [_spec(args, axes, point, options) for point in points]
    if longest is None:
        found = _compiled(engine, [s(SIDES) for s in specs], [_label(p) for p in points], args.cache)
        rows = [PlanRow(grid=p, point=_point(p, r)) for p, r in zip(points, found)]
    else:
        rows = _search(engine, specs, points, longest, args.cache)
    best = best_row(rows)
    return Plan(target=args.target, topology=args.topology, limit_bytes=_limit(args),
                grid=grid, rows=tuple(rows), longest_key=longest[0] if longest else None,
                longest_range=longest[1:] if longest else None, best=best, rule=BEST_RULE)


def _spec(args, axes: dict[str, int], point: dict, rewrite: dict):
    """A function of the sides (and a searched value) to the PointSpec of `point`: its
    `--mesh` axes in the mesh, its other keys beside the `--set` words."""
    mesh = ",".join(f"{k}={point.get(k, n)}" for k, n in axes.items()) if axes else None
    words = list(args.options or []) + [f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                                        for k, v in point.items() if k not in axes]

    def make(sides, searched: tuple[str, Any] | None = None) -> PointSpec:
        extra = [f"{searched[0]}={searched[1]}"] if searched else []
        values = tuple(point.items()) + ((searched,) if searched else ())
        return PointSpec(target=args.target, mesh=mesh, devices=args.devices, topology=args.topology,
                         options=tuple(words + extra), values=values, sides=tuple(sides),
                         hbm_gib=args.hbm_gib, rewrite=rewrite)

    return make


def _search(engine: Engine, specs, points: list[dict], longest, cache: str | None) -> list[PlanRow]:
    """Rounds of probes: each round compiles every unfinished side's next value at once."""
    key, lo, hi, step = longest
    fits = {(i, side): {} for i in range(len(points)) for side in SIDES}
    needs = {(i, side): {} for i in range(len(points)) for side in SIDES}
    limit: int | None = None
    tried: dict[int, list[PlanPoint]] = {i: [] for i in range(len(points))}
    for round_number in itertools.count(1):
        probes: dict[tuple[int, int], list[str]] = {}   # (point, value) -> sides to compile
        for (i, side), known in fits.items():
            value = next_probe(known, lo, hi, step, needs[(i, side)], limit)
            if value is not None:
                probes.setdefault((i, value), []).append(side)
        if not probes:
            break
        order = list(probes)
        if engine.progress:
            engine.progress(f"longest {key}, round {round_number}: {len(order)} point(s) to compile")
        found = _compiled(engine, [specs[i](tuple(probes[(i, v)]), (key, v)) for i, v in order],
                          [_label({**points[i], key: v}, probes[(i, v)]) for i, v in order], cache)
        for (i, value), result in zip(order, found):
            point = _point({**points[i], key: value}, result)
            tried[i].append(point)
            for side in probes[(i, value)]:
                fits[(i, side)][value] = point.fits(side)
                compiled = getattr(point, side)
                if compiled is not None:
                    needs[(i, side)][value] = compiled.need_bytes
                    limit = compiled.limit_bytes
    return [PlanRow(grid=p, longest=Longest(key=key, before=longest_fitting(fits[(i, "before")]),
                                            after=longest_fitting(fits[(i, "after")]),
                                            tried=tuple(sorted(tried[i], key=lambda t: t.values[key]))))
            for i, p in enumerate(points)]


def _compiled(engine: Engine, specs: list[PointSpec], labels: list[str], cache: str | None) -> list:
    """Each point evaluated on the engine, or read from `cache` (a folder: `--cache`) where
    the same point was compiled before by the same shardlint, JAX and libtpu; what the
    engine compiles is written there as each point ends, so a plan stopped in a round keeps
    the points it finished. A point that failed is not kept (it may have run out of memory
    beside others)."""
    if cache is None:
        return engine.map(evaluate, specs, labels)
    from ..reports import point_of

    os.makedirs(cache, exist_ok=True)
    paths = [os.path.join(cache, f"{_key(spec)}.json") for spec in specs]
    found: list = [None] * len(specs)
    for i, path in enumerate(paths):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                found[i] = point_of(json.load(fh))
            if engine.progress:
                engine.progress(f"{labels[i]}: compiled before, read from {path}")
    todo = [i for i, point in enumerate(found) if point is None]

    def keep(k: int, result) -> None:   # as each point ends: a stop later keeps it
        if not isinstance(result, Failed):
            write_text(paths[todo[k]], json.dumps(dataclasses.asdict(result), indent=1) + "\n")

    done = engine.map(evaluate, [specs[i] for i in todo], [labels[i] for i in todo], on_done=keep)
    for i, result in zip(todo, done):
        found[i] = result
    return found


def _key(spec: PointSpec) -> str:
    """What a point's result depends on: its spec and the compiler's versions."""
    import jax

    from ..analyzer import libtpu_version
    from .. import __version__

    versions = [__version__, jax.__version__, libtpu_version() if spec.topology else None]
    text = json.dumps([dataclasses.asdict(spec), versions], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _point(values: dict, result) -> PlanPoint:
    return PlanPoint(values=values, error=result.why) if isinstance(result, Failed) else result


def _label(point: dict, sides=SIDES) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items()) + f" ({' and '.join(sides)})"


def _limit(args) -> int:
    from ..analyzer import hbm_gib

    gib = args.hbm_gib or hbm_gib(args.topology) or 0
    return int(gib * 2**30)


def best_row(rows: list[PlanRow]) -> int | None:
    """The row that fits after the fix, longest after it (with --longest), then the fewest
    collective bytes; None where none fits."""
    def score(row: PlanRow):
        if row.longest is not None:
            at = row.longest.at_longest()
            if at is None:
                return None
            return (-row.longest.after, at.after.moved_bytes)
        point = row.point
        if point is None or point.after is None or not point.after.fits:
            return None
        return (0, point.after.moved_bytes)

    scored = [(s, i) for i, row in enumerate(rows) for s in [score(row)] if s is not None]
    return min(scored)[1] if scored else None


def plan_command(args) -> int:
    from ..reports import write_plan_json

    engine = engine_of(args, least=1, progress=progress)
    plan = run_plan(args, engine)
    print(format_plan(plan))
    if args.json:
        write_plan_json(plan, args.json)
        progress(f"wrote {args.json}")
    if args.out:
        from ..reports import write_plan_html

        write_plan_html(plan, args.out)
        progress(f"wrote {args.out}")
    return 0 if plan.best is not None else 1

