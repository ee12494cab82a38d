"""From command-line words to a step on a mesh: parse `--mesh` and `--set`, simulate the
devices, import `file.py:callable` or `package.module:callable`, and call it with the mesh
and the options.

The device count must be set before JAX starts a backend, so `simulate_devices` runs
before the user's module is imported; every mistake here is a `UsageError` that names
the argument and the way out.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
from typing import Any, Callable

from .._errors import ShardlintError, UsageError
from .._source import user_line


def parse_mesh_spec(text: str) -> dict[str, int]:
    """`data=2,context=4` -> {"data": 2, "context": 4}, in the order given."""
    axes: dict[str, int] = {}
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        m = re.fullmatch(r"([A-Za-z_][\w]*)\s*=\s*(\d+)", part)
        if not m:
            raise UsageError(f"--mesh: cannot read {part!r}; write axes as name=size, "
                             f"e.g. --mesh data=2,context=4")
        name, size = m.group(1), int(m.group(2))
        if name in axes:
            raise UsageError(f"--mesh: axis {name!r} is given twice in {text!r}")
        if size < 1:
            raise UsageError(f"--mesh: axis {name!r} has size {size}; sizes must be >= 1")
        axes[name] = size
    if not axes:
        raise UsageError(f"--mesh: no axes in {text!r}; e.g. --mesh data=2,context=4")
    return axes


def simulate_devices(count: int) -> None:
    """Asks for `count` CPU devices; must run before JAX initialises its backend."""
    import jax

    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if m and int(m.group(1)) < count:
        raise UsageError(f"XLA_FLAGS asks for {m.group(1)} CPU devices but the mesh needs "
                         f"{count}; unset --xla_force_host_platform_device_count")
    try:
        # CPU only: with libtpu installed (shardlint[tpu]) JAX would otherwise start its TPU
        # client too, and libtpu prints its start-up errors on every command.
        jax.config.update("jax_platforms", "cpu")
        if not m:
            jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as e:  # backend already started (the user's module touched devices)
        if len(jax.devices()) < count:
            raise UsageError(f"JAX started with {len(jax.devices())} devices before shardlint "
                             f"could ask for {count}: {e}") from e


def build_mesh(axes: dict[str, int]):
    import jax
    from jax.sharding import AxisType

    count = math.prod(axes.values())
    devices = jax.devices()
    if len(devices) < count:
        raise UsageError(f"--mesh {axes} needs {count} devices, JAX has {len(devices)}")
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes),
                         devices=devices[:count])


def load_target(target: str) -> Callable:
    """Imports TARGET (`file.py:callable` or `package.module:callable`)."""
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise UsageError(f"target {target!r}: write path/to/model.py:make_step or "
                         f"package.module:make_step")
    try:
        if module_part.endswith(".py") or os.sep in module_part:
            path = os.path.abspath(module_part)
            if not os.path.isfile(path):
                raise UsageError(f"target {target!r}: no file {module_part}")
            folder = os.path.dirname(path)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            name = os.path.splitext(os.path.basename(path))[0]
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_part)
    except UsageError:
        raise
    except ModuleNotFoundError as e:
        raise UsageError(f"target {target!r}: cannot import {module_part}: {e}") from e
    except Exception as e:
        raise UsageError(f"target {target!r}: importing {module_part} raised "
                         f"{type(e).__name__}{_raised_at(e)}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise UsageError(f"target {target!r}: {module_part} has no attribute {attr!r}")
    if not callable(fn):
        raise UsageError(f"target {target!r}: {attr} is not callable")
    return fn


def _raised_at(error: Exception) -> str:
    """Where in the user's code `error` came from (` at model.py:12 in make_step (...)`)."""
    return user_line(error)


def parse_options(words: list[str] | None) -> dict[str, Any]:
    """`--set key=value` words -> keyword arguments for the target's make_step. A value is
    read as JSON when it parses (`4`, `true`, `-1.5`, `[2, 4]`, `"4"`), else kept as the
    string it is (`mixtral`)."""
    options: dict[str, Any] = {}
    for word in words or ():
        key, sep, text = word.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UsageError(f"--set {word!r}: write key=value, e.g. --set ici_context_parallelism=4")
        if key in options:
            raise UsageError(f"--set: {key!r} is given twice")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text
    return options


def make_step(target: str, mesh, options: dict[str, Any] | None = None, *,
              devices: list | None = None) -> tuple[Callable, tuple[Any, ...]]:
    """Calls the target and checks what it returns, as the target contract says: it is
    stated once, on `shardlint.integrations`' face."""
    factory = load_target(target)
    kwargs = dict(options or {})
    if devices is not None:
        kwargs["devices"] = devices
    _check_accepts(factory, target, kwargs)
    try:
        made = factory(mesh, **kwargs)
    except ShardlintError:
        raise   # the target's own one-line error (MaxText's target raises these)
    except Exception as e:
        raise UsageError(f"target {target!r} raised {type(e).__name__}{_raised_at(e)}: {e}") from e
    if not (isinstance(made, tuple) and len(made) == 2):
        raise UsageError(f"target {target!r} must return (step_fn, args), got {_described(made)}")
    if not callable(made[0]):
        raise UsageError(f"target {target!r} must return (step_fn, args): its first item must be "
                         f"the step function, got {_described(made[0])}")
    fn, args = made
    if not isinstance(args, (tuple, list)):
        raise UsageError(f"target {target!r}: args must be a tuple of arrays or "
                         f"ShapeDtypeStructs, got {type(args).__name__}")
    return fn, tuple(args)


def target_options(target: str) -> list[str] | None:
    """The keyword arguments the target takes after the mesh (None: any, or unknown)."""
    return _options_of(load_target(target))


def _options_of(factory: Callable) -> list[str] | None:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None  # a builtin or C callable: let the call say
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return [name for i, (name, p) in enumerate(params.items()) if i > 0 and p.kind in
            (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def _check_accepts(factory: Callable, target: str, kwargs: dict[str, Any]) -> None:
    """Every option must be a keyword the target takes: one line naming those it does."""
    takes = _options_of(factory)
    if takes is None:
        return
    for key in kwargs:
        if key in takes:
            continue
        if key == "devices":
            raise UsageError(f"--topology without --mesh: target {target!r} builds its own mesh, so "
                             f"it must take devices= (the topology's chips); or pass --mesh")
        raise UsageError(f"target {target!r} takes no option {key!r} (--set {key}=...); "
                         f"it takes {', '.join(takes) if takes else 'none'}")


def _described(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def mesh_of_args(args, target: str):
    """The mesh a target that built its own put its arguments on (`--devices`)."""
    from .._errors import AnalysisError
    from ..analyzer import mesh_of

    try:
        return mesh_of(args)
    except AnalysisError as e:
        raise UsageError(f"target {target!r}: {e}") from e


def check_mesh(args, mesh) -> None:
    """The arguments' mesh must be the one `--mesh` built."""
    from ..analyzer import mesh_of

    theirs = mesh_of(args)
    if (tuple(theirs.axis_names), theirs.devices.shape) != (tuple(mesh.axis_names), mesh.devices.shape):
        mine = dict(zip(mesh.axis_names, mesh.devices.shape))
        other = dict(zip(theirs.axis_names, theirs.devices.shape))
        raise UsageError(f"the arguments are sharded over mesh {other}, not the --mesh {mine}; "
                         f"build their NamedShardings from the mesh the target receives")


def build_topology_mesh(axes: dict[str, int], topology: str):
    """A mesh over the compile-only devices of a TPU topology (`--topology v5p:2x2x1`)."""
    from ..analyzer import topology_mesh

    return topology_mesh(axes, topology)
