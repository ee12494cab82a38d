"""The tests' meshes, built in one place: `jax.make_mesh` with one axis type for every axis.

Auto unless a test says otherwise: on Auto axes XLA propagates shardings as it does for
MaxText, while `jax.make_mesh`'s own default (Explicit) makes JAX refuse a sort over a
sharded dimension and reshard a flatten itself (DESIGN.md). Tests about Explicit meshes
pass `AxisType.Explicit`. The mesh most tests analyze on (data=2 x context=4) is also the
`mesh` fixture of tests/conftest.py.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh


def build_mesh(axes: dict[str, int], axis_type: AxisType = AxisType.Auto) -> Mesh:
    """A mesh with `axes` (name -> size, major to minor) over the first devices: the mesh
    the CLI's `--mesh` builds from the same axes."""
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(axis_type,) * len(axes))


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...], axis_type: AxisType = AxisType.Auto) -> Mesh:
    """`build_mesh` with the sizes and the names apart, as test cases list them."""
    return build_mesh(dict(zip(names, shape, strict=True)), axis_type)


def context_mesh(context: int) -> Mesh:
    """data x context over every device (8 simulated, tests/conftest.py): the context
    degree the tests sweep, the rest of the devices on data."""
    return build_mesh({"data": jax.device_count() // context, "context": context})
