"""Compile for a real TPU topology on a machine with no TPU (TPU AOT through libtpu).

Simulated CPU devices show where sharding is lost, but only the TPU compiler knows the
HBM a step really needs per chip (its layouts are tiled, its fusions and buffer
assignment differ). The `libtpu` wheel compiles for a named topology such as `v5p:2x2x1`
with no chip attached: `jax.experimental.topologies.get_topology_desc` returns
compile-only devices, a mesh over them lowers and compiles as usual, and nothing runs.

Three things make that one flag instead of an afternoon, and they live here:

- libtpu must be the build the installed jax was released with. jax's own `tpu` extra
  pins it (jax 0.10.2: `libtpu==0.0.42.*`); a newer libtpu loads fine and then fails
  inside the compiler with an internal RET_CHECK (libtpu 0.0.52 under jax 0.10.2). So
  the pin is read from jax's metadata and checked before libtpu is loaded (and again
  before every TPU compile), and a mismatch is a `LibtpuError` that names both versions
  and the install command.
- libtpu expects a Cloud TPU VM: with no metadata server and no TPU_* variables it logs
  errors about the accelerator type and worker hostnames (measured). The variables are
  set here, before libtpu loads, to describe a single host that owns the topology; a value
  the user already set wins.
- Topologies smaller than libtpu's default host (2x2x1 chips, e.g. `v5p:1x1x1`) need
  `chips_per_host_bounds`, and v4 topologies list both TensorCores of a chip while JAX
  meshes want one device per chip (megacore). Both are handled when the devices are made.

Whether a step fits a chip's HBM is `_fit`'s question.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re

from ..._errors import ShardlintError

INSTALL = "pip install 'shardlint[tpu]'"


# JAX's `device_kind` for each chip: names a topology whose devices were made elsewhere.
_CHIP_OF_KIND = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e"}

# libtpu's default host is 2x2x1 chips; a smaller topology has to say its own bounds.
_DEFAULT_HOST_BOUNDS = (2, 2, 1)

_TOPOLOGY_RE = re.compile(r"(v\d+[a-z]*):(\d+(?:x\d+){1,2})")

# Devices already made, by topology name: libtpu is loaded once per process, and the
# names let an analysis say which topology a mesh's devices came from.
_DEVICES: dict[str, list] = {}


class TopologyError(ShardlintError):
    """A TPU topology that cannot be compiled for: bad name, mesh larger than it."""


class LibtpuError(TopologyError):
    """libtpu is missing, or is not the build the installed jax was released with."""


# ---------------------------------------------------------------- libtpu


def required_libtpu() -> str | None:
    """The libtpu version specifier jax's own `tpu` extra pins, e.g. `==0.0.42.*`."""
    for req in importlib.metadata.requires("jax") or ():
        m = re.match(r"\s*libtpu\s*([^;]*?)\s*;\s*(.*)$", req)
        if m and re.search(r"""extra\s*==\s*["']tpu["']""", m.group(2)):
            return m.group(1).replace(" ", "") or None
    return None


def libtpu_version() -> str | None:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_libtpu() -> str:
    """The installed libtpu version; raises `LibtpuError` if it is missing or mismatched.

    A libtpu named by TPU_LIBRARY_PATH (a TPU VM image, a custom build) is used as it is.
    """
    jax_version = importlib.metadata.version("jax")
    wanted = required_libtpu()
    have = libtpu_version()
    pin = f"libtpu{wanted}" if wanted else "libtpu"
    if have is None and os.path.isfile(os.environ.get("TPU_LIBRARY_PATH", "")):
        return "TPU_LIBRARY_PATH"  # the user's own libtpu build: no version to compare
    if have is None:
        raise LibtpuError(
            f"--topology compiles with the TPU compiler, which comes with libtpu, and libtpu "
            f"is not installed; jax {jax_version} wants {pin}: run {INSTALL} "
            f"(or pip install 'jax[tpu]=={jax_version}')")
    if wanted and not satisfies(have, wanted):
        raise LibtpuError(
            f"libtpu {have} is installed but jax {jax_version} was released with {pin}; "
            f"a mismatched libtpu fails inside the TPU compiler. Run "
            f"pip install '{pin}' (or {INSTALL})")
    return have


def satisfies(version: str, spec: str) -> bool:
    """Whether `version` meets a PEP 440 specifier list of release numbers (`==0.0.42.*`).

    Only the numeric release is compared; jax pins libtpu with `==X.*` and ranges, which
    this covers without a dependency on `packaging`.
    """
    have = _release(version)
    for clause in filter(None, spec.split(",")):
        m = re.fullmatch(r"(===|==|!=|~=|>=|<=|>|<)(.+)", clause.strip())
        if not m:
            raise ValueError(f"cannot read version specifier {clause!r}")
        op, target = m.groups()
        if target.endswith(".*"):
            prefix = _release(target[:-2])
            same = have[: len(prefix)] + (0,) * (len(prefix) - len(have)) == prefix
            ok = same if op in ("==", "===") else not same
        else:
            want = _release(target)
            n = max(len(have), len(want))
            a, b = have + (0,) * (n - len(have)), want + (0,) * (n - len(want))
            if op == "~=":
                ok = a >= b and a[: len(want) - 1] == b[: len(want) - 1]
            else:
                ok = {"==": a == b, "===": a == b, "!=": a != b, ">=": a >= b,
                      "<=": a <= b, ">": a > b, "<": a < b}[op]
        if not ok:
            return False
    return True


def _release(version: str) -> tuple[int, ...]:
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"cannot read version {version!r}")
    return tuple(int(x) for x in m.group(1).split("."))


# ---------------------------------------------------------------- topology


def parse_topology(name: str) -> tuple[str, tuple[int, ...]]:
    """`v5p:2x2x1` -> ("v5p", (2, 2, 1)); raises `TopologyError` with an example."""
    m = _TOPOLOGY_RE.fullmatch(name.strip())
    if not m:
        raise TopologyError(f"--topology: cannot read {name!r}; write CHIP:AxBxC as libtpu "
                            f"names them, e.g. v5p:2x2x1, v4:2x2x1, v5e:2x2, v6e:2x2")
    dims = tuple(int(d) for d in m.group(2).split("x"))
    if min(dims) < 1:
        raise TopologyError(f"--topology {name!r}: every dimension must be >= 1")
    return m.group(1), dims


def accelerator_type(name: str) -> str:
    """The Cloud TPU accelerator type of a topology (`v5p:2x2x1` -> `v5p-8`).

    v4 and v5p count TensorCores (two per chip); v5e (`v5litepod`) and v6e count chips.
    """
    chip, dims = parse_topology(name)
    chips = math.prod(dims)
    if chip in ("v2", "v3", "v4", "v5p"):
        return f"{chip}-{2 * chips}"
    if chip == "v5e":
        return f"v5litepod-{chips}"
    return f"{chip}-{chips}"


def tpu_environment(name: str) -> dict[str, str]:
    """Sets what libtpu reads from a Cloud TPU VM, for one host that owns the topology.

    Must run before libtpu loads (its first load reads these once). Values the user has
    already set are kept. Returns the variables this call set.
    """
    wanted = {
        "TPU_SKIP_MDS_QUERY": "1",            # no metadata server to ask
        "TPU_ACCELERATOR_TYPE": accelerator_type(name),
        "TPU_WORKER_HOSTNAMES": "localhost",  # this host is the only worker
        "TPU_WORKER_ID": "0",
    }
    set_here = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(set_here)
    return set_here


def topology_devices(name: str) -> list:
    """Compile-only devices of a TPU topology, one per chip, in libtpu's order."""
    chip, dims = parse_topology(name)
    name = f"{chip}:{'x'.join(map(str, dims))}"
    check_libtpu()  # before libtpu loads; cheap enough to repeat for cached topologies
    if name in _DEVICES:
        return _DEVICES[name]
    tpu_environment(name)
    _keep_jax_on_cpu()
    from jax.experimental import topologies

    padded = dims + (1,) * (3 - len(dims))
    bounds = tuple(min(d, b) for d, b in zip(padded, _DEFAULT_HOST_BOUNDS))
    kwargs = {"chips_per_host_bounds": bounds} if bounds != _DEFAULT_HOST_BOUNDS else {}
    try:
        devices = list(topologies.get_topology_desc(topology_name=name, platform="tpu",
                                                    **kwargs).devices)
    except Exception as e:  # libtpu rejects the name or the shape, or is in use
        said = str(e).splitlines()[0]
        if "lockfile" in said:   # another process on this machine holds libtpu
            raise TopologyError(f"--topology {name}: libtpu is in use by another process on this "
                                f"machine ({said}); run one TPU compile at a time") from e
        raise TopologyError(f"--topology {name}: libtpu {libtpu_version()} cannot make this "
                            f"topology: {said}; try e.g. v5p:2x2x1, "
                            f"v4:2x2x1, v5e:2x2, v6e:2x2") from e
    # v4 lists both TensorCores of each chip; JAX meshes take one device per chip.
    devices = [d for d in devices if getattr(d, "core_on_chip", 0) == 0]
    _DEVICES[name] = devices
    return devices


def _keep_jax_on_cpu() -> None:
    """Makes JAX run on the CPU when nothing chose a platform yet.

    The TPU devices here are compile-only. Left unset, JAX's first backend start would
    probe for an attached TPU through libtpu: seconds lost and libtpu errors printed.
    """
    import jax

    from ... import _jax

    if not jax.config.jax_platforms and not _jax.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def topology_mesh(axes: dict[str, int], name: str):
    """A mesh with `axes` (name -> size, major to minor) over the topology's first chips."""
    import jax
    from jax.sharding import AxisType

    devices = topology_devices(name)
    count = math.prod(axes.values())
    if count > len(devices):
        chip, _ = parse_topology(name)
        raise TopologyError(f"--mesh {','.join(f'{k}={v}' for k, v in axes.items())} needs "
                            f"{count} chips; topology {name} has {len(devices)}. Use a "
                            f"larger topology (e.g. {chip}:{_example_dims(chip, count)}) "
                            f"or a smaller mesh")
    return jax.make_mesh(tuple(axes.values()), tuple(axes), devices=devices[:count],
                         axis_types=(AxisType.Auto,) * len(axes))


def _example_dims(chip: str, count: int) -> str:
    dims = [1, 1] if chip in ("v5e", "v6e") else [1, 1, 1]
    i = 0
    while math.prod(dims) < count:
        dims[i % len(dims)] *= 2
        i += 1
    return "x".join(map(str, dims))


def topology_of(devices) -> str | None:
    """The topology name of compile-only TPU devices, or None for other devices.

    Devices made by `topology_devices` carry the name they were made with; others are
    named by chip and the bounds of their coordinates.
    """
    devices = list(devices)
    if not devices or devices[0].platform != "tpu":
        return None
    ids = {id(d) for d in devices}
    for name, known in _DEVICES.items():
        if ids <= {id(d) for d in known}:
            return name
    kind = devices[0].device_kind
    coords = [tuple(getattr(d, "coords", ()) or ()) for d in devices]
    chip = _CHIP_OF_KIND.get(kind, kind)
    if not all(coords):
        return chip
    bounds = [max(c[i] for c in coords) + 1 for i in range(len(coords[0]))]
    return f"{chip}:{'x'.join(map(str, bounds))}"
