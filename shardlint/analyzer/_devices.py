"""Decodes XLA's device notation (`sharding=`, `replica_groups=`) into the user's mesh axes.

XLA prints device groups in several forms that changed across versions: explicit lists
(`{{0,1},{2,3}}`), iota tile assignments (`[2,4]<=[4,2]T(1,0)`), meshes whose axes carry
XLA's own names (`mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`, JAX 0.10) or the user's names
(`mesh['data'=2,'context'=4] {'context'}`, JAX 0.12), and named shardings
(`{mesh[...], [{'data'}, {}]}`). Each is turned into plain device-id arrays first and then
matched against the real mesh, so nothing depends on how XLA chose to name or factor the
axes. Logical device id `i` is position `i` of the mesh's flattened device array, which is
the device assignment JAX compiles with.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np

Axes = tuple[str, ...]


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
    text = text.strip()
    if text.startswith("mesh["):
        ids, axes_listed = _printed_mesh(text)
        names = list(ids.keys())
        arr = _iota_devices(text, [ids[n] for n in names])
        keep = [i for i, n in enumerate(names) if n in axes_listed]
        rest = [i for i in range(len(names)) if i not in keep]
        arr = arr.transpose(rest + keep).reshape(-1, math.prod(ids[names[i]] for i in keep) if keep else 1)
        return arr.tolist()
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        arr = _iota(m.group(2), m.group(3)).reshape(shape)
        return arr.reshape(-1, shape[-1]).tolist()
    groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text)]
    groups = [g for g in groups if g]
    return groups or [list(range(num_devices))]


def axes_of_pairs(mesh: MeshInfo, text: str) -> Axes | None:
    """Mesh axes a collective-permute moves data along (`source_target_pairs`)."""
    coords = mesh.coords()
    varying = set()
    for src, dst in re.findall(r"\{(\d+),(\d+)\}", text):
        diff = coords[int(src)] != coords[int(dst)]
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
        return _named_sharding(body, mesh, rank)
    m = re.match(r"devices=\[([\d,]+)\]((?:<=\[[\d,]+\](?:T\([\d,]+\))?)|[\d,]+)(.*)$", body)
    if not m:
        return None
    tile = [int(x) for x in m.group(1).split(",")]
    assign = m.group(2)
    if assign.startswith("<="):
        mm = re.match(r"<=\[([\d,]+)\](?:T\(([\d,]+)\))?", assign)
        devices = _iota(mm.group(1), mm.group(2)).reshape(tile)
    else:
        devices = np.array([int(x) for x in assign.split(",")]).reshape(tile)
    tail = m.group(3)
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
        return [parse_sharding(body, mesh, r) for r in ranks]
    # XLA marks every fifth element with `/*index=5*/`; the element follows the comment.
    parts = [re.sub(r"^/\*index=\d+\*/", "", p) for p in _top_level_parts(body[1:-1])]
    return [parse_sharding(p, mesh, r) for p, r in zip(parts, ranks)] + [None] * (len(ranks) - len(parts))


def _named_sharding(body: str, mesh: MeshInfo, rank: int) -> Sharding | None:
    # JAX 0.12: `mesh['data'=2,'context'=4], [{'data'}, {}]` (optionally `replicated=...`);
    # a fully replicated value prints as `mesh[], replicated`.
    close = body.index("]", body.index("mesh[")) + 1
    if "[" not in body[close:]:
        return Sharding(((),) * rank, manual="manual" in body[close:])
    ids, _ = _printed_mesh(body)
    names = list(ids)
    devices = _iota_devices(body, [ids[n] for n in names])
    rest = body[close:]
    lb = rest.index("[")
    dim_list = rest[lb:_bracket_end(rest, lb) + 1]
    per_dim = re.findall(r"\{([^}]*)\}", dim_list)
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
    return Sharding(tuple(dims), manual="manual" in rest[_bracket_end(rest, lb):])


def _printed_mesh(text: str) -> tuple[dict[str, int], set[str]]:
    start = text.index("mesh[") + 5
    end = text.index("]", start)
    ids = {n: int(s) for n, s in re.findall(r"'([^']+)'=(\d+)", text[start:end])}
    # The axes a collective runs over are the last `{...}` after the mesh, which follows
    # the device order when that is not the iota (`device_ids=[..]` or `device_ids=([..]T(..))`).
    groups = re.findall(r"\{([^{}]*)\}", text[end + 1:])
    listed = set(re.findall(r"'([^']+)'", groups[-1])) if groups else set()
    return ids, listed


def _iota_devices(text: str, shape: list[int]) -> np.ndarray:
    """Device ids laid over a printed mesh (`device_ids=[...]` or iota)."""
    m = re.search(r"device_ids=\[([\d,\s]+)\]", text)
    if m:
        return np.array([int(x) for x in m.group(1).split(",")]).reshape(shape)
    # A transposed iota, `device_ids=([2,2,2]T(1,0,2))` (JAX 0.10.2 on a 3-axis mesh).
    m = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", text)
    if m:
        return _iota(m.group(1), m.group(2)).reshape(shape)
    return np.arange(math.prod(shape)).reshape(shape)


def _iota(reshape: str, perm: str | None) -> np.ndarray:
    dims = [int(x) for x in reshape.split(",")]
    arr = np.arange(math.prod(dims)).reshape(dims)
    if perm:
        arr = arr.transpose([int(x) for x in perm.split(",")])
    return arr.ravel()


def _bracket_end(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "[":
            depth += 1
        elif text[i] == "]":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


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
