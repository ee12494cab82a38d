"""Device notations -> mesh axes: every printed form decodes to the same axes.

Real sharding strings come from the installed JAX's propagated module (named shardings on
JAX 0.12, iota tile assignments on 0.10); the other forms are checked to decode to the
same groups as the real ones.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint.analyzer import MeshInfo, parse_replica_groups, parse_sharding
from shardlint.analyzer.compile._compile import compile_step
from shardlint import HloParseError
from shardlint.analyzer.parse._devices import axes_of_groups, replica_group_axes
from shardlint.analyzer.parse._hlo import parse_hlo

from support import make_mesh

MESH_2x4 = MeshInfo(("data", "context"), (2, 4))
MESH_2x2x2 = MeshInfo(("data", "context", "expert"), (2, 2, 2))


def _groups_over(mesh: MeshInfo, axes) -> list[list[int]]:
    ids = np.arange(mesh.num_devices).reshape(mesh.axis_sizes)
    keep = [mesh.axis_names.index(a) for a in axes]
    rest = [i for i in range(len(mesh.axis_sizes)) if i not in keep]
    return ids.transpose(rest + keep).reshape(-1, int(np.prod([mesh.axis_sizes[k] for k in keep]))).tolist()


@pytest.mark.parametrize("mesh", [MESH_2x4, MESH_2x2x2], ids=["2x4", "2x2x2"])
def test_every_axis_subset_round_trips_through_each_form(mesh):
    for r in range(1, len(mesh.axis_names) + 1):
        for axes in itertools.combinations(mesh.axis_names, r):
            groups = _groups_over(mesh, axes)
            explicit = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"
            assert axes_of_groups(mesh, parse_replica_groups(explicit, mesh.num_devices)) == axes
            printed = ("mesh[" + ",".join(f"'{n}'={s}" for n, s in zip(mesh.axis_names, mesh.axis_sizes))
                       + "] {" + ",".join(f"'{a}'" for a in axes) + "}")
            assert axes_of_groups(mesh, parse_replica_groups(printed, mesh.num_devices)) == axes
            # XLA 0.10 names the axes itself and may split them: axis_0.. over the same ids.
            xla_named = ("mesh[" + ",".join(f"'axis_{i}'={s}" for i, s in enumerate(mesh.axis_sizes))
                         + "] {" + ",".join(f"'axis_{mesh.axis_names.index(a)}'" for a in axes) + "}")
            assert axes_of_groups(mesh, parse_replica_groups(xla_named, mesh.num_devices)) == axes


def test_iota_replica_groups_with_transpose():
    # [4,2]<=[2,4]T(1,0): groups {0,4},{1,5},{2,6},{3,7}: they vary along `data` on 2x4.
    groups = parse_replica_groups("[4,2]<=[2,4]T(1,0)", 8)
    assert groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axes_of_groups(MESH_2x4, groups) == ("data",)
    assert axes_of_groups(MESH_2x4, parse_replica_groups("[2,4]<=[8]", 8)) == ("context",)


def test_a_sub_axis_of_a_printed_mesh_groups_part_of_the_axis():
    """libtpu 0.0.50 (JAX 0.12) prints a collective over part of an axis in Shardy's
    sub-axis notation: `'context':(1)2` is the major half of context (4 = 1 x 2 x 2)."""
    text = "mesh['data'=2,'context'=4] {'context':(1)2}"
    groups = parse_replica_groups(text, 8)
    assert groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axes_of_groups(MESH_2x4, groups) is None and replica_group_axes(text) == ("context",)
    assert parse_replica_groups("mesh['data'=2,'context'=4] {'data', 'context':(2)2}", 8) == \
        [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(HloParseError, match="sub-axis"):
        parse_replica_groups("mesh['data'=2,'context'=4] {'context':(2)3}", 8)


def test_partial_axis_groups_are_not_named_as_whole_axes():
    assert axes_of_groups(MESH_2x4, [[0, 1], [2, 3], [4, 5], [6, 7]]) is None


@pytest.mark.parametrize("text, dims", [
    ("{devices=[2,4,1]<=[8]}", (("data",), ("context",), ())),
    ("{devices=[2,1,1,4]<=[8] last_tile_dim_replicate}", (("data",), (), ())),
    ("{devices=[1,4,2]<=[2,4]T(1,0)}", ((), ("context",), ("data",))),
    ("{devices=[8,1,1]<=[8]}", (("data", "context"), (), ())),
    ("{devices=[8,1,1]<=[2,4]T(1,0)}", (("context", "data"), (), ())),
    ("{devices=[2,4,1]0,1,2,3,4,5,6,7}", (("data",), ("context",), ())),
    ("{replicated}", ((), (), ())),
    ("{mesh['data'=2,'context'=4], [{'data'}, {'context'}, {}]}", (("data",), ("context",), ())),
    ("{mesh['data'=2,'context'=4], [{'context', 'data'}, {}, {}]}", (("context", "data"), (), ())),
    ("{mesh[], replicated}", ((), (), ())),
    ("{mesh[], [{}, {}, {}]}", ((), (), ())),   # JAX 0.11.2's empty mesh (MaxText's rewritten step)
    ("{mesh['data'=2,'context'=4], [{}, {}, {}]}", ((), (), ())),
])
def test_sharding_forms(text, dims):
    assert parse_sharding(text, MESH_2x4, 3).dims == dims


def test_manual_sharding_is_marked():
    assert parse_sharding("{manual}", MESH_2x4, 2).manual


@pytest.mark.parametrize("shape, names, spec", [
    ((2, 4), ("data", "context"), P("data", "context", None)),
    ((2, 4), ("data", "context"), P(("data", "context"), None, None)),
    ((2, 2, 2), ("data", "context", "expert"), P("data", ("context", "expert"), None)),
    ((2, 2, 2), ("data", "context", "expert"), P("expert", None, "context")),
])
def test_parameter_shardings_that_jax_printed_decode_to_the_spec(shape, names, spec):
    mesh = make_mesh(shape, names)
    x = jax.ShapeDtypeStruct((8, 8, 8), jnp.float32, sharding=NamedSharding(mesh, spec))
    compiled = compile_step(lambda x: x * 2, (x,))
    module = parse_hlo(compiled.dumped.propagated)
    param = next(i for i in module.entry.instructions if i.opcode == "parameter")
    decoded = parse_sharding(param.sharding, MeshInfo.from_mesh(mesh), 3)
    want = tuple(() if s is None else (s,) if isinstance(s, str) else tuple(s) for s in spec)
    assert decoded.dims == want, (param.sharding, decoded)
