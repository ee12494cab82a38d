"""What a command runs on: a target's step and mesh (`path/to/model.py:make_step`, with
`--mesh`, `--devices` or `--topology`), or the module a real job's XLA dump holds."""

from __future__ import annotations

import dataclasses
import math

from .._errors import UsageError
from .._format import progress


# Options that need the step's Python; a dump holds only what XLA compiled.
_NEEDS_A_TARGET = (("devices", "--devices"), ("options", "--set"), ("topology", "--topology"),
                   ("rewrite", "--rewrite"), ("batch_axes", "--batch-axes"),
                   ("seq_axes", "--seq-axes"), ("per_shard_capacity", "--per-shard-capacity"),
                   ("sweep", "--sweep"), ("params_argnums", "--params-argnums"))


def reads_dump(args) -> bool:
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


def analyze_dump_of(args):
    from ..analyzer import analyze_dump
    from ._targets import parse_mesh_spec

    mesh = parse_mesh_spec(args.mesh) if args.mesh else None
    return analyze_dump(args.xla_dump, module=args.module, mesh=mesh, progress=progress)


def load(args):
    from ._targets import (build_mesh, build_topology_mesh, check_mesh, make_step, mesh_of_args,
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
        progress(f"tracing {args.target} (mesh=None, {args.devices} simulated CPU devices)")
        fn, step_args = make_step(args.target, None, options)
        return mesh_of_args(step_args, args.target), fn, step_args
    if args.mesh is None:
        if not topology:
            raise UsageError("give --mesh AXES (the target gets that mesh), --devices N (it builds "
                             "its own), or --topology NAME (it builds its own over a TPU topology)")
        from ..analyzer import topology_devices

        devices = topology_devices(topology)
        progress(f"tracing {args.target} (mesh=None, the {len(devices)} chips of {topology})")
        fn, step_args = make_step(args.target, None, options, devices=devices)
        return mesh_of_args(step_args, args.target), fn, step_args
    axes = parse_mesh_spec(args.mesh)
    if topology:
        mesh = build_topology_mesh(axes, topology)
    else:
        simulate_devices(math.prod(axes.values()))
        mesh = build_mesh(axes)
    progress(f"tracing {args.target}")
    fn, step_args = make_step(args.target, mesh, options)
    check_mesh(step_args, mesh)
    return mesh, fn, step_args


def load_sweep(args):
    """`(key, values, build_point)` of `--sweep KEY=v1,v2,...` (None without one): over an
    axis of `--mesh` (the largest point's devices simulated now, before JAX starts), or over
    one of the target's options (each point the target called with `KEY=value` beside the
    `--set` options, on the devices `--devices`, `--mesh` or `--topology` give every point)."""
    import argparse

    from ._sweep import mesh_points, parse_sweep_spec, start_devices
    from ._targets import parse_mesh_spec, parse_options, target_options

    if not args.sweep:
        return None
    key, values = parse_sweep_spec(args.sweep)
    options = parse_options(args.options)
    axes = parse_mesh_spec(args.mesh) if args.mesh else {}
    if key in axes:
        topology = getattr(args, "topology", None)
        if not topology:
            start_devices(axes, (key, values))
        return key, values, mesh_points(args.target, axes, key, options=options, topology=topology)
    if key in options:
        raise UsageError(f"--sweep {key}=... and --set {key}=...: give its values in --sweep only")
    takes = target_options(args.target)
    if takes is not None and key not in takes:
        raise UsageError(f"--sweep {key}: neither an axis of --mesh ({', '.join(axes) or 'none given'}) "
                         f"nor an option of target {args.target!r} (it takes "
                         f"{', '.join(takes) if takes else 'none'})")

    return key, values, OptionPoints(argparse.Namespace(**vars(args)), key)


@dataclasses.dataclass(frozen=True)
class OptionPoints:
    """`(mesh, step, args)` of the command line's target with `key=value` beside its `--set`
    options (picklable: a sweep point may run in a process of its own)."""

    args: object      # the command line's argparse.Namespace
    key: str

    def __call__(self, value: int) -> tuple:
        import argparse

        point = argparse.Namespace(**vars(self.args))
        point.options = [*(self.args.options or []), f"{self.key}={value}"]
        return load(point)
