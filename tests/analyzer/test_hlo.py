"""The HLO text parser and the collective table, on modules the installed JAX produced."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType

from shardlint.analyzer import MeshInfo, collectives_of, parse_hlo
from shardlint.analyzer._hlo import _parse_attrs

from . import collective_steps

# (mesh shape, names, all-to-all axis, reduce-scatter axis, permute axis, all-reduce axis)
MESHES = [
    ((2, 4), ("data", "context"), "context", "context", "data", "data"),
    ((2, 2, 2), ("data", "context", "expert"), "expert", "context", "data", "data"),
    ((4, 2), ("fsdp", "tensor"), "fsdp", "tensor", "fsdp", "tensor"),
]


def _compiled(shape, names, *axes):
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
    fn, args = collective_steps.make_collectives_step(mesh, *axes)
    text = jax.jit(fn).lower(*args).compile().as_text()
    return mesh, text


@pytest.fixture(scope="module", params=MESHES, ids=lambda m: "x".join(map(str, m[0])))
def compiled(request):
    shape, names, a2a, scatter, permute, total = request.param
    mesh, text = _compiled(shape, names, a2a, scatter, permute, total)
    expected = {"all-to-all": (a2a,), "reduce-scatter": (scatter,), "collective-permute": (permute,),
                "all-reduce": (total,), "all-gather": (total,)}
    return mesh, text, expected


def test_every_kind_found_with_its_mesh_axes(compiled):
    mesh, text, expected = compiled
    found = collectives_of(parse_hlo(text), MeshInfo.from_mesh(mesh))
    by_kind = {}
    for c in found:
        by_kind.setdefault(c.kind, []).append(c)
    for kind, axes in expected.items():
        assert kind in by_kind, f"{kind} missing from {[c.kind for c in found]}"
        assert any(c.axes == axes for c in by_kind[kind]), (kind, [c.axes for c in by_kind[kind]])


def test_source_lines_come_from_stack_frame_tables(compiled):
    mesh, text, expected = compiled
    assert "StackFrames" in text or "source_line=" in text
    found = collectives_of(parse_hlo(text), MeshInfo.from_mesh(mesh))
    for kind in expected:
        want = collective_steps.marker_line(kind)
        # XLA's own label, decoded from the stack-frame tables.
        lines = {c.xla_source.line for c in found if c.kind == kind and c.xla_source}
        assert want in lines, (kind, want, lines)
        files = {c.xla_source.file for c in found if c.kind == kind and c.xla_source}
        assert any(f.endswith("collective_steps.py") for f in files)


def test_tuple_shaped_results_and_bytes(compiled):
    mesh, text, _ = compiled
    module = parse_hlo(text)
    found = collectives_of(module, MeshInfo.from_mesh(mesh))
    all_reduce = next(c for c in found if c.kind == "all-reduce" and "," in c.shape)
    instr = next(i for i in module.instructions() if i.name == all_reduce.id)
    assert instr.is_tuple and len(instr.result) == 2
    assert all_reduce.result_bytes == sum(a.nbytes for a in instr.result)
    n = mesh.shape[all_reduce.axes[0]]
    assert all_reduce.bytes == 2 * all_reduce.result_bytes * (n - 1) // n
    gather = next(c for c in found if c.kind == "all-gather")
    n = mesh.shape[gather.axes[0]]
    assert gather.bytes == gather.result_bytes * (n - 1) // n


def test_every_instruction_parses():
    mesh, text = _compiled(*MESHES[0][:2], *MESHES[0][2:])
    module = parse_hlo(text)
    body_lines = [l for l in text.splitlines() if " = " in l and l.startswith("  ")]
    assert sum(len(c.instructions) for c in module.computations.values()) == len(body_lines)
    assert module.entry.instructions[-1].is_root


ASYNC_TEXT = """HloModule jit_step, is_scheduled=true

FileNames
1 "/src/model.py"

FunctionNames
1 "moe"

FileLocations
1 {file_name_id=1 function_name_id=1 line=212 end_line=212 column=8 end_column=8}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main (p0: bf16[2,64,16], p1: f32[8]) -> bf16[2,256,16] {
  %p0 = bf16[2,64,16]{2,1,0:T(8,128)(2,1)} parameter(0), sharding={devices=[2,4,1]<=[8]}
  %p1 = f32[8]{0} parameter(1)
  %all-gather-start = (bf16[2,64,16]{2,1,0}, bf16[2,256,16]{2,1,0}) all-gather-start(bf16[2,64,16]{2,1,0} %p0), channel_id=1, replica_groups=[2,4]<=[8], dimensions={1}, use_global_device_ids=true, metadata={op_name="jit(step)/jvp()/reshape" stack_frame_id=1}
  %all-gather-done = bf16[2,256,16]{2,1,0} all-gather-done(%all-gather-start)
  %all-reduce-start = f32[8]{0} all-reduce-start(%p1), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add, metadata={op_name="jit(step)/psum" source_file="/src/model.py" source_line=99}
  %all-reduce-done = f32[8]{0} all-reduce-done(%all-reduce-start)
  %cp-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%p1), channel_id=3, source_target_pairs={{0,4},{4,0}}
  %cp-done = f32[8]{0} collective-permute-done(%cp-start)
  ROOT %out = bf16[2,256,16]{2,1,0} copy(%all-gather-done)
}
"""


def test_async_pairs_count_once_with_their_outputs():
    # CPU compiles collectives synchronously; TPU and GPU print async pairs like this.
    mesh = MeshInfo(("data", "context"), (2, 4))
    found = {c.kind: c for c in collectives_of(parse_hlo(ASYNC_TEXT), mesh)}
    assert sorted(found) == ["all-gather", "all-reduce", "collective-permute"]
    gather = found["all-gather"]
    assert gather.is_async and gather.shape == "bf16[2,256,16]" and gather.axes == ("context",)
    assert gather.xla_source.line == 212 and gather.xla_source.function == "moe"
    assert found["all-reduce"].axes == ("data",)
    assert found["all-reduce"].xla_source.line == 99  # inline source_file/source_line form
    assert found["collective-permute"].axes == ("data",)
    assert found["collective-permute"].shape == "f32[8]"


def test_attribute_values_keep_nested_braces_and_quotes():
    attrs = _parse_attrs(', sharding={{devices=[2,1]0,1}, {replicated}}, metadata={op_name="a, b{c}" '
                         'stack_frame_id=3}, dimensions={1}')
    assert attrs["sharding"] == "{{devices=[2,1]0,1}, {replicated}}"
    assert attrs["metadata"] == '{op_name="a, b{c}" stack_frame_id=3}'
    assert attrs["dimensions"] == "{1}"
