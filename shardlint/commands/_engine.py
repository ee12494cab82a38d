"""One engine for sets of independent points (a plan's grid, and its search for the longest
sequence that fits): each point is one call of a worker function in a process of its own,
so that each starts JAX afresh (its simulated device count, its TPU topology) and gives a
compile's memory back when it ends.

Locally the points run `jobs` at a time, each in a spawned process; a process that dies (the
kernel's out-of-memory killer, a crash in native code) fails its own point only. With
`jobs=0` they run one after another in this process (a report's `--sweep` by default: the
JAX that is already started, no pickling), and a worker's exception reaches the caller. With
`ray=ADDRESS` (or "auto") each point is a Ray task on that cluster with its CPU and memory
request, in a worker process of its own (`max_calls=1`). Either way the results come back in
the order of the points, the same for the same points. libtpu lets a second process load it
only with `ALLOW_MULTIPLE_LIBTPU_LOAD=1`: every point runs with it.

A progress line per finished point says how many are done, what ran, and an estimate of
what is left. Ctrl-C stops what runs and starts nothing more: on the command line the
process ends at once and kills the points' processes (`shardlint._interrupt`); in a library
call, KeyboardInterrupt reaches the caller after they are terminated. Nothing is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import statistics
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Sequence

from .._interrupt import ended_on_interrupt

# Every point: libtpu refuses to load in a second process without it (measured: libtpu
# 0.0.42 and 0.0.50 on one machine, two compiles at once).
POINT_ENV = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def engine_of(args, *, least: int, progress: Callable[[str], None] | None) -> Engine:
    """The engine the command line asks for (`--jobs`, `--ray`...); `least` jobs at least."""
    from .._errors import UsageError

    if args.jobs < least:
        raise UsageError(f"--jobs {args.jobs}: give {least} or more")
    return Engine(jobs=args.jobs, ray=args.ray, cpus=args.ray_cpus, memory_gib=args.ray_memory_gib,
                  progress=progress)


@dataclasses.dataclass(frozen=True)
class Failed:
    """A point whose worker raised or whose process died: why, in one line."""

    why: str


@dataclasses.dataclass(frozen=True)
class Engine:
    """Where points run: `jobs` local processes (0: this process), or the Ray cluster at
    `ray`, each task asking for `cpus` CPUs and `memory_gib` of memory."""

    jobs: int = 1
    ray: str | None = None
    cpus: float = 1.0
    memory_gib: float | None = None
    progress: Callable[[str], None] | None = None

    def map(self, worker: Callable[[Any], Any], specs: Sequence[Any],
            labels: Sequence[str] | None = None,
            on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """`worker(spec)` for every spec, each in a process of its own; a point whose
        worker raised or whose process died is a `Failed`. `on_done(index, result)` hears
        each point as it ends (what a later point's failure or Ctrl-C leaves done)."""
        labels = list(labels or [str(s) for s in specs])
        if self.ray is not None:
            return _on_ray(self, worker, list(specs), labels, on_done)
        clock = _Clock(len(specs), self.jobs, self.progress, on_done)
        if self.jobs == 0:
            return [_here(worker, i, spec, label, clock) for i, (spec, label) in enumerate(zip(specs, labels))]
        return _locally(self.jobs, worker, list(specs), labels, clock)


class _Clock:
    """The progress line of a set of points: done/total, what finished, what is left."""

    def __init__(self, total: int, parallel: int, progress, on_done=None):
        self.total, self.parallel, self.progress, self.on_done = total, max(1, parallel), progress, on_done
        self.done, self.took, self.started = 0, [], time.monotonic()

    def finished(self, index: int, label: str, seconds: float, result: Any) -> None:
        self.done += 1
        self.took.append(seconds)
        if self.on_done is not None:
            self.on_done(index, result)
        if self.progress is None:
            return
        left = self.total - self.done
        estimate = ""
        if left:
            rounds = -(-left // self.parallel)
            estimate = f"; about {_minutes(rounds * statistics.median(self.took))} left"
        outcome = f"failed: {result.why}" if isinstance(result, Failed) else f"{seconds:.0f} s"
        self.progress(f"[{self.done}/{self.total}] {label} ({outcome}){estimate}")


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _here(worker, index: int, spec, label: str, clock: _Clock) -> Any:
    start = time.monotonic()
    result = worker(spec)
    clock.finished(index, label, time.monotonic() - start, result)
    return result


def _child(conn, worker, spec) -> None:
    # Ctrl-C is the parent's to handle: it ends its points (`_interrupt`), and a point that
    # took the signal itself would only print a traceback on its way out.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(POINT_ENV)
    try:
        result = worker(spec)
    except BaseException as e:   # the point fails, the plan goes on
        result = Failed(_one_line(e))
        traceback.print_exc()
    conn.send(result)
    conn.close()


def _locally(jobs: int, worker, specs: list, labels: list[str], clock: _Clock) -> list:
    context = multiprocessing.get_context("spawn")
    results: list = [None] * len(specs)
    waiting = list(range(len(specs)))
    running: dict[int, tuple[Any, Any, float]] = {}   # index -> (process, reader, start)
    ended = contextlib.ExitStack()
    try:
        while waiting or running:
            while waiting and len(running) < max(1, jobs):
                i = waiting.pop(0)
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(target=_child, args=(writer, worker, specs[i]), daemon=True)
                process.start()
                writer.close()
                ended.enter_context(ended_on_interrupt(process.pid))
                running[i] = (process, reader, time.monotonic())
            ready = wait([r for _, r, _ in running.values()])
            for i in [i for i, (_, r, _) in running.items() if r in ready]:
                process, reader, start = running.pop(i)
                try:
                    results[i] = reader.recv()
                except EOFError:   # the process ended without a result
                    process.join()
                    results[i] = Failed(f"its process ended with code {process.exitcode} "
                                        "(killed for memory?) before a result")
                process.join()
                clock.finished(i, labels[i], time.monotonic() - start, results[i])
    finally:
        for process, _, _ in running.values():
            process.terminate()
            process.join()
        ended.close()
    return results


def _on_ray(engine: Engine, worker, specs: list, labels: list[str], on_done=None) -> list:
    try:
        import ray
    except ImportError as e:
        from .._errors import UsageError

        raise UsageError("--ray needs Ray: pip install 'shardlint[ray]'") from e
    if not ray.is_initialized():
        ray.init(address=engine.ray, log_to_driver=False,
                 runtime_env={"env_vars": dict(POINT_ENV)})
    options: dict[str, Any] = {"num_cpus": engine.cpus, "max_calls": 1}
    if engine.memory_gib:
        options["memory"] = int(engine.memory_gib * 2**30)
    task = ray.remote(**options)(_on_a_ray_worker)
    slots = int(ray.cluster_resources().get("CPU", 1) // engine.cpus)
    clock = _Clock(len(specs), slots, engine.progress, on_done)
    refs = {task.remote(worker, spec): i for i, spec in enumerate(specs)}
    results: list = [None] * len(specs)
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            i = refs[done[0]]
            try:
                seconds, results[i] = ray.get(done[0])
            except Exception as e:   # the worker process died (Ray's WorkerCrashedError...)
                seconds, results[i] = 0.0, Failed(_one_line(e))
            clock.finished(i, labels[i], seconds, results[i])
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
    return results


def _on_a_ray_worker(worker, spec) -> tuple[float, Any]:
    os.environ.update(POINT_ENV)
    start = time.monotonic()
    try:
        result = worker(spec)
    except Exception as e:   # the point fails, the plan goes on
        result = Failed(_one_line(e))
    return time.monotonic() - start, result


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
