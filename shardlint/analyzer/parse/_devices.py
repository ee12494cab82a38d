"""Decodes XLA's device notation (`sharding=`, `replica_groups=`) into the user's mesh axes.

XLA prints device groups in several forms that changed across versions: explicit lists
(`{{0,1},{2,3}}`), iota tile assignments (`[2,4]<=[4,2]T(1,0)`), meshes whose axes carry
XLA's own names (`mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`, JAX 0.10) or the user's names
(`mesh['data'=2,'context'=4] {'context'}`, JAX 0.12), and named shardings
(`{mesh[...], [{'data'}, {}]}`). Each is turned into plain device-id arrays first and then
matched against the real mesh, so nothing depends on how XLA chose to name or factor the
axes. Logical device id `i` is position `i` of the mesh's flattened device array, which is
the device assignment JAX compiles with.

Text that none of these forms reads, or that names devices the mesh does not have, raises
`HloParseError`; the text `_hlo.Instruction` hands over (`_hlo.AttrText`) carries its key
and line for the message. A sharding in a form this module does not know at all is None,
as before: the analysis then reads that op as unknown.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np

from ..._errors import HloParseError
from ._hlo import AttrText

Axes = tuple[str, ...]

_INTS = r"\d+(?:,\d+)*"
_IOTA_GROUPS_RE = re.compile(rf"\[({_INTS})\]<=\[({_INTS})\](?:T\(({_INTS})\))?")
_GROUP = r"\{\s*(?:\d+(?:\s*,\s*\d+)*)?\s*\}"
_LIST_GROUPS_RE = re.compile(rf"\{{\s*(?:{_GROUP}(?:\s*,\s*{_GROUP})*)?\s*\}}")
_PAIRS_RE = re.compile(r"\{\s*(?:\{\d+,\d+\}(?:\s*,\s*\{\d+,\d+\})*)?\s*\}")
_TILED_RE = re.compile(rf"devices=\[({_INTS})\](?:<=\[({_INTS})\](?:T\(({_INTS})\))?|({_INTS}))(.*)",
                       re.DOTALL)
# `mesh['data'=2,'context'=4]`, optionally `, device_ids=[...]` or `, device_ids=([..]T(..))`.
_MESH_RE = re.compile(r"mesh\[((?:'[^']+'=\d+(?:,\s*'[^']+'=\d+)*)?)\]"
                      r"(?:,\s*device_ids=(?:\[(\s*\d+(?:\s*,\s*\d+)*\s*)\]"
                      rf"|\(\[({_INTS})\](?:T\(({_INTS})\))?\)))?")
# The axes after a printed mesh, `{'context'}`, or sub-axes of Shardy's notation,
# `{'context':(1)4}`: axis context split as (1, 4, rest), its middle part.
_AXES_RE = re.compile(r"\s*(?:\{\s*((?:'[^']+'(?::\(\d+\)\d+)?(?:\s*,\s*'[^']+'(?::\(\d+\)\d+)?)*)?)\s*\})?")
_SUB_AXIS_RE = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")
_DIM_LIST_RE = re.compile(r"\[\s*(?:\{[^{}]*\}(?:\s*,\s*\{[^{}]*\})*)?\s*\]")
_NAMED_DIM_RE = re.compile(r"\s*(?:'[^']+'(?::\(\d+\)\d+)?(?:\s*,\s*'[^']+'(?::\(\d+\)\d+)?)*)?\s*")


@dataclasses.dataclass(frozen=True)
class MeshInfo:
    """The mesh as the analysis sees it: axis names and sizes, major to minor."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    @classmethod
    def from_mesh(cls, mesh) -> MeshInfo:
        return cls(tuple(mesh.axis_names), tuple(int(s) for s in mesh.devices.shape))

    @property
    def num_devices(self) -> int:
        return math.prod(self.axis_sizes)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    def coords(self) -> np.ndarray:
        """[num_devices, num_axes] mesh coordinates of each logical device id."""
        return np.stack(np.unravel_index(np.arange(self.num_devices), self.axis_sizes), -1)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Per-dimension mesh axes of one array; `manual` inside shard_map bodies."""

    dims: tuple[Axes, ...]
    manual: bool = False

    def axes(self) -> set[str]:
        return {a for d in self.dims for a in d}



def axes_of_index(mesh: MeshInfo, index: np.ndarray) -> Axes | None:
    """The ordered mesh axes whose linearised coordinates equal `index[device]`."""
    count = int(index.max()) + 1 if index.size else 1
    if count == 1:
        return ()
    coords = mesh.coords()
    for r in range(1, len(mesh.axis_names) + 1):
        for perm in itertools.permutations(range(len(mesh.axis_names)), r):
            sizes = [mesh.axis_sizes[p] for p in perm]
            if math.prod(sizes) != count:
                continue
            linear = np.ravel_multi_index(tuple(coords[:, p] for p in perm), sizes)
            if np.array_equal(linear, index):
                return tuple(mesh.axis_names[p] for p in perm)
    return None


def axes_of_groups(mesh: MeshInfo, groups: list[list[int]]) -> Axes | None:
    """The mesh axes along which the devices of each group differ (a partition)."""
    if not groups:
        return tuple(mesh.axis_names)
    coords = mesh.coords()
    varying = set()
    for group in groups:
        c = coords[np.asarray(group)]
        varying |= {mesh.axis_names[a] for a in range(c.shape[1]) if len(set(c[:, a])) > 1}
    size = math.prod(mesh.as_dict()[a] for a in varying)
    if any(len(g) != size for g in groups):
        return None  # groups cover part of an axis: not expressible in whole axes
    return tuple(a for a in mesh.axis_names if a in varying)


# ---------------------------------------------------------------- replica groups


def parse_replica_groups(text: str, num_devices: int) -> list[list[int]]:
    """Device-id groups from any of XLA's `replica_groups=` / pair notations."""
    body = text.strip()
    if body.startswith("mesh["):
        names, sizes, devices, rest = _printed_mesh(text, body, num_devices)
        m = _AXES_RE.fullmatch(rest)
        listed = _SUB_AXIS_RE.findall(m.group(1) or "") if m else None
        if listed is None or not {n for n, _, _ in listed} <= set(names):
            raise _unreadable(text, f"the collective's axes after the mesh, `{{'name',...}}` of "
                                    f"{', '.join(names)}")
        return _groups_over(text, names, sizes, devices, listed)
    m = _IOTA_GROUPS_RE.fullmatch(body)
    if m:
        shape = _ints(m.group(1))
        arr = _iota(text, m.group(2), m.group(3))
        if 0 in shape or math.prod(shape) != arr.size:
            raise _unreadable(text, f"groups `[G,S]<=[N]` of as many devices as the iota ({arr.size})")
        groups = arr.reshape(-1, shape[-1]).tolist()
    elif _LIST_GROUPS_RE.fullmatch(body):
        groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", body)]
        groups = [g for g in groups if g]
    else:
        raise _unreadable(text, "replica groups `{{0,1},...}`, `[G,S]<=[N]` or `mesh[...] {...}`")
    _check_devices(text, [d for g in groups for d in g], num_devices)
    return groups or [list(range(num_devices))]


def axes_of_pairs(mesh: MeshInfo, text: str) -> Axes | None:
    """Mesh axes a collective-permute moves data along (`source_target_pairs`)."""
    if text.strip() and not _PAIRS_RE.fullmatch(text.strip()):
        raise _unreadable(text, "source-target pairs `{{0,1},{1,0},...}`")
    pairs = [(int(src), int(dst)) for src, dst in re.findall(r"\{(\d+),(\d+)\}", text)]
    _check_devices(text, [d for pair in pairs for d in pair], mesh.num_devices)
    coords = mesh.coords()
    varying = set()
    for src, dst in pairs:
        diff = coords[src] != coords[dst]
        varying |= {mesh.axis_names[a] for a in np.nonzero(diff)[0]}
    return tuple(a for a in mesh.axis_names if a in varying)


# ---------------------------------------------------------------- shardings


def parse_sharding(text: str | None, mesh: MeshInfo, rank: int) -> Sharding | None:
    """Decodes one array's `sharding={...}`; None when absent or not decodable."""
    if text is None:
        return None
    body = text.strip()
    if re.match(r"\{\s*\{", body):
        return None  # tuple sharding: use `parse_tuple_sharding`
    body = body[1:-1].strip() if body.startswith("{") else body
    if body.startswith("replicated") or body.startswith("maximal"):
        return Sharding(((),) * rank)
    if body.startswith("manual"):
        return Sharding(((),) * rank, manual=True)
    if body.startswith("mesh["):
        return _named_sharding(text, body, mesh, rank)
    if not body.startswith("devices="):
        return None
    m = _TILED_RE.fullmatch(body)
    if not m:
        raise _unreadable(text, "a tiled sharding `devices=[A,B]<=[N]` or `devices=[A,B]0,1,...`")
    tile = _ints(m.group(1))
    if m.group(4) is None:
        devices = _iota(text, m.group(2), m.group(3))
    else:
        devices = np.array(_ints(m.group(4)))
    # The devices may be fewer than the mesh's: passes after GSPMD's partitioner print
    # `devices=[2,1,2]<=[4]` on 8 devices (JAX 0.10.2, spmd-cleanup).
    if devices.size != math.prod(tile) or len(tile) < rank:
        raise _unreadable(text, f"a tile assignment `devices=[...]` of as many devices as tiles, "
                                f"with a dimension for each of the array's {rank}")
    _check_devices(text, devices.tolist(), mesh.num_devices)
    devices = devices.reshape(tile)
    tail = m.group(5)
    manual = "manual" in tail
    dims = []
    for d in range(rank):
        index = np.zeros(mesh.num_devices, dtype=np.int64)
        moved = np.moveaxis(devices, d, 0)
        for t in range(tile[d]):
            index[moved[t].ravel()] = t
        axes = axes_of_index(mesh, index)
        dims.append(axes if axes is not None else (f"?{tile[d]}",))
    return Sharding(tuple(dims), manual=manual)


def parse_tuple_sharding(text: str | None, mesh: MeshInfo, ranks: list[int]) -> list[Sharding | None]:
    """One Sharding per result array: a tuple sharding `{{...}, {...}}` gives one each, a
    single sharding applies to every array."""
    if text is None:
        return [None] * len(ranks)
    body = text.strip()
    if not re.match(r"\{\s*\{", body):
        return [parse_sharding(text, mesh, r) for r in ranks]
    if not body.endswith("}"):
        raise _unreadable(text, "a tuple sharding `{{...}, {...}}`")
    # XLA marks every fifth element with `/*index=5*/`; the element follows the comment.
    parts = [_located(text, re.sub(r"^/\*index=\d+\*/", "", p)) for p in _top_level_parts(body[1:-1])]
    return [parse_sharding(p, mesh, r) for p, r in zip(parts, ranks)] + [None] * (len(ranks) - len(parts))


def _named_sharding(text: str, body: str, mesh: MeshInfo, rank: int) -> Sharding | None:
    # JAX 0.12: `mesh['data'=2,'context'=4], [{'data'}, {}]` (optionally `replicated=...`);
    # a fully replicated value prints as `mesh[], replicated`.
    close = body.find("]", body.index("mesh[")) + 1
    if close == 0:
        raise _unreadable(text, "a printed mesh `mesh['name'=N,...]`")
    if "[" not in body[close:]:
        return Sharding(((),) * rank, manual="manual" in body[close:])
    names, sizes, devices, rest = _printed_mesh(text, body, mesh.num_devices)
    m = _DIM_LIST_RE.search(rest)
    if m is None or rest[:m.start()].strip(", "):
        raise _unreadable(text, "the mesh axes of each dimension after the mesh, `[{'name'}, {}, ...]`")
    per_dim = re.findall(r"\{([^}]*)\}", m.group())
    if not all(_NAMED_DIM_RE.fullmatch(d) for d in per_dim) or not {
            n for d in per_dim for n in re.findall(r"'([^']+)'", d)} <= set(names):
        raise _unreadable(text, f"dimensions sharded over axes of the printed mesh {names}")
    if not any(re.findall(r"'([^']+)'", d) for d in per_dim):
        # No dimension names an axis: replicated. JAX 0.11.2 prints a scalar's or a
        # replicated value's empty mesh so, `{mesh[], [{}]}`.
        return Sharding(((),) * rank, manual="manual" in rest[m.end():])
    ids = dict(zip(names, sizes))
    coords = np.stack(np.unravel_index(np.arange(devices.size), devices.shape), -1)
    device_of_pos = devices.ravel()
    dims: list[Axes] = []
    for d in range(rank):
        listed = re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", per_dim[d]) if d < len(per_dim) else []
        if not listed:
            dims.append(())
            continue
        if any(sub for _, sub, _ in listed):
            dims.append(tuple(f"{n}:({s}){k}" if s else n for n, s, k in listed))
            continue
        sel = [names.index(n) for n, _, _ in listed]
        linear = np.ravel_multi_index(tuple(coords[:, s] for s in sel), [ids[names[s]] for s in sel])
        index = np.zeros(mesh.num_devices, dtype=np.int64)
        index[device_of_pos] = linear
        axes = axes_of_index(mesh, index)
        dims.append(axes if axes is not None else tuple(n for n, _, _ in listed))
    return Sharding(tuple(dims), manual="manual" in rest[m.end():])


def _groups_over(text: str, names: list[str], sizes: list[int], devices: np.ndarray,
                 listed: list[tuple[str, str, str]]) -> list[list[int]]:
    """The device groups of a collective over whole axes or Shardy sub-axes: each axis
    split into its parts (a sub-axis `(pre)size` of an axis of size n is the middle of
    (pre, size, n / (pre * size))), the listed parts varying within a group."""
    factors, keep = [], []
    for i, (name, n) in enumerate(zip(names, sizes)):
        subs = [(int(pre), int(size)) for listed_name, pre, size in listed if listed_name == name and size]
        whole = any(listed_name == name and not size for listed_name, _, size in listed)
        if len(subs) > 1 or (subs and n % (subs[0][0] * subs[0][1])):
            raise _unreadable(text, f"one sub-axis `'{name}':(pre)size` of axis {name} ({n}) that divides it")
        if subs:
            pre, size = subs[0]
            parts = [pre, size, n // (pre * size)]
            keep.append(len(factors) + 1)
            factors += parts
        else:
            if whole:
                keep.append(len(factors))
            factors.append(n)
    grid = devices.reshape(factors)
    rest = [i for i in range(len(factors)) if i not in keep]
    width = math.prod(factors[i] for i in keep)
    return grid.transpose(rest + keep).reshape(-1, width).tolist()


def replica_group_axes(text: str | None) -> tuple[str, ...]:
    """The mesh axes a printed mesh's collective names, sub-axes by their axis
    (`{'context':(1)4}` -> ('context',)); () for other notations."""
    body = (text or "").strip()
    if not body.startswith("mesh[") or "]" not in body:
        return ()
    tail = body[body.index("]") + 1:]
    return tuple(dict.fromkeys(n for n, _, _ in _SUB_AXIS_RE.findall(tail)))


def _printed_mesh(text: str, body: str, num_devices: int) -> tuple[list[str], list[int], np.ndarray, str]:
    """A printed mesh at the start of `body`: axis names, sizes, the device ids laid over it
    (`device_ids=[...]`, a transposed iota `device_ids=([2,2,2]T(1,0,2))` as JAX 0.10.2
    prints on a 3-axis mesh, or the plain iota) and the text after it."""
    m = _MESH_RE.match(body)
    if m is None:
        raise _unreadable(text, "a printed mesh `mesh['name'=N,...]`")
    pairs = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names, sizes = [n for n, _ in pairs], [int(s) for _, s in pairs]
    count = math.prod(sizes)
    if len(set(names)) != len(names) or 0 in sizes or count > num_devices:
        raise _unreadable(text, f"a printed mesh of distinct axes over at most the mesh's "
                                f"{num_devices} devices")
    if m.group(2) is not None:
        devices = np.array(_ints(m.group(2).replace(" ", "")))
    elif m.group(3) is not None:
        devices = _iota(text, m.group(3), m.group(4))
    else:
        devices = np.arange(count)
    if devices.size != count:
        raise _unreadable(text, f"`device_ids` of the printed mesh's {count} devices")
    _check_devices(text, devices.tolist(), num_devices)
    return names, sizes, devices.reshape(sizes), body[m.end():]


def _iota(text: str, reshape: str, perm: str | None) -> np.ndarray:
    dims = _ints(reshape)
    arr = np.arange(math.prod(dims)).reshape(dims)
    if perm:
        order = _ints(perm)
        if sorted(order) != list(range(len(dims))):
            raise _unreadable(text, f"an iota `[{reshape}]T(...)` transposed by a permutation of its "
                                    f"{len(dims)} dimensions")
        arr = arr.transpose(order)
    return arr.ravel()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _check_devices(text: str, ids: list[int], num_devices: int) -> None:
    if any(i >= num_devices for i in ids):
        raise _unreadable(text, f"device ids below {num_devices}, the number of devices of the mesh")


def _located(text: str, part: str) -> str:
    """`part` of an attribute's text, with the key and line the whole text carries."""
    return AttrText(part, text.key, text.line) if isinstance(text, AttrText) else part


def _unreadable(text: str, expected: str) -> HloParseError:
    """The error for attribute text that cannot be read, naming its line when it knows it."""
    if isinstance(text, AttrText):
        return HloParseError(expected, f"{text.key}={text}", text.line)
    return HloParseError(expected, text, None)


def _top_level_parts(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts
