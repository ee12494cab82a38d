"""The HLO text parser and the collective table, on modules the installed JAX produced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint import HloParseError
from shardlint.analyzer import MeshInfo, collectives_of, parse_hlo
from shardlint.analyzer.parse._devices import parse_tuple_sharding
from shardlint.analyzer.parse._hlo_text import _parse_attrs
from shardlint.analyzer.graph._trips import trip_count

from support import collective_steps, make_mesh

# (mesh shape, names, all-to-all axis, reduce-scatter axis, permute axis, all-reduce axis)
MESHES = [
    ((2, 4), ("data", "context"), "context", "context", "data", "data"),
    ((2, 2, 2), ("data", "context", "expert"), "expert", "context", "data", "data"),
    ((4, 2), ("fsdp", "tensor"), "fsdp", "tensor", "fsdp", "tensor"),
]


def _compiled(shape, names, *axes):
    mesh = make_mesh(shape, names)
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


def _typed_ops(x, y, idx):
    c = jnp.cumsum(x, axis=1)
    s = jnp.sort(c, axis=1)
    b = jnp.einsum("bij,bjk->bik", s.reshape(2, 4, 16), y)
    scattered = x.at[idx].add(1.0)
    gathered = x[idx]
    top, _ = jax.lax.top_k(x, 2)
    return b, scattered, gathered, top


@pytest.fixture(scope="module")
def typed_module():
    args = (jnp.ones((8, 16)), jnp.ones((2, 16, 4)), jnp.array([1, 3]))
    return parse_hlo(jax.jit(_typed_ops).lower(*args).compile().as_text())


def _one(module, opcode):
    found = [i for i in module.instructions() if i.opcode == opcode]
    assert found, (opcode, sorted({i.opcode for i in module.instructions()}))
    return found[0]


def test_typed_attributes_of_a_real_compile(typed_module):
    # XLA:CPU keeps a cumsum over 16 as one reduce-window (longer ones it splits in blocks).
    cumsum = _one(typed_module, "reduce-window")
    assert cumsum.window_sizes == (1, 16)
    assert cumsum.window_padding == ((0, 0), (15, 0)) and cumsum.window_strides == (1, 1)
    assert _one(typed_module, "sort").dimensions == (1,)
    dot = next(i for i in typed_module.instructions() if i.opcode == "dot" and i.lhs_batch_dims)
    assert (dot.lhs_batch_dims, dot.rhs_batch_dims) == ((0,), (0,))
    assert (dot.lhs_contracting_dims, dot.rhs_contracting_dims) == ((2,), (1,))
    scatter = _one(typed_module, "scatter")
    assert scatter.update_window_dims == (1, 2) and scatter.inserted_window_dims == ()
    assert scatter.scatter_dims_to_operand_dims == (0,) and scatter.index_vector_dim == 1
    gather = _one(typed_module, "gather")
    assert (gather.offset_dims, gather.collapsed_slice_dims, gather.start_index_map) == ((1, 2), (), (0,))
    assert gather.index_vector_dim == 1 and gather.slice_sizes == (1, 16)
    top_k = _one(typed_module, "custom-call")
    assert top_k.custom_call_target == "TopK"
    assert _one(typed_module, "sort").custom_call_target == "" and scatter.known_trip_count is None


def test_parameter_numbers_and_tuple_indices(typed_module):
    entry = typed_module.entry
    assert sorted(i.parameter_number for i in entry.instructions if i.opcode == "parameter") == [0, 1, 2]
    assert all(i.parameter_number is None for i in entry.instructions if i.opcode != "parameter")
    elements = [i for i in typed_module.instructions() if i.opcode == "get-tuple-element"]
    assert elements and all(i.tuple_index == int(i.attrs["index"]) for i in elements)


def _scan_of_4(x):
    def body(carry, row):
        return carry + row, carry

    return jax.lax.scan(body, x[0], x[:4])[0]


def test_trip_count_of_a_scan_of_4(tmp_path, mesh):
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", "context")))
    compiled = jax.jit(_scan_of_4).lower(x).compile(compiler_options={
        "xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "shardy-xla|sharding-propagation"})
    partitioned = parse_hlo(compiled.as_text())
    (loop,) = [i for i in partitioned.instructions() if i.opcode == "while"]
    assert loop.known_trip_count == 4 and trip_count(partitioned, loop) == 4
    # The propagated module has no annotation; the count is read from the loop itself.
    dumps = sorted(p for p in tmp_path.iterdir() if p.suffix == ".txt"
                   and (".after_shardy-xla." in p.name or ".after_sharding-propagation." in p.name))
    propagated = parse_hlo(dumps[-1].read_text())
    (loop,) = [i for i in propagated.instructions() if i.opcode == "while"]
    assert loop.known_trip_count is None and trip_count(propagated, loop) == 4
    # Every operand names an instruction of its computation, also where newer XLA writes a
    # tuple element inline (`%while.1#1`, JAX 0.12) instead of a get-tuple-element.
    for comp in propagated.computations.values():
        names = {i.name for i in comp.instructions}
        assert all(set(i.operands) <= names for i in comp.instructions), comp.name


def test_inline_tuple_elements_name_the_tuple_and_its_index():
    text = """HloModule m

ENTRY %main (p: (s32[], f32[4])) -> f32[4] {
  %p = (s32[], f32[4]{0}) parameter(0)
  ROOT %out = f32[4]{0} negate(%p#1)
}
"""
    (param, out) = parse_hlo(text).entry.instructions
    assert param.parameter_number == 0 and param.operands == ()
    assert out.operands == ("p",) and out.operand_indices == (1,)


def test_a_computation_closed_with_its_attributes_is_read():
    """XLA:TPU ends SparseCore computations with `}, execution_thread="sparsecore"` (the
    partitioned module of a v5p:2x2x2 decoder has 28 of them)."""
    text = """HloModule m

%on_sparsecore (p: s32[4]) -> s32[4] {
  %p = s32[4]{0} parameter(0)
  ROOT %c = s32[4]{0} copy(%p)
}, execution_thread="sparsecore"

ENTRY %main (q: s32[4]) -> s32[4] {
  %q = s32[4]{0} parameter(0)
  ROOT %out = s32[4]{0} call(%q), to_apply=%on_sparsecore
}
"""
    module = parse_hlo(text)
    assert set(module.computations) == {"on_sparsecore", "main"}
    assert [i.name for i in module.computations["on_sparsecore"].instructions] == ["p", "c"]
    with pytest.raises(HloParseError, match="HLO line 6"):
        parse_hlo(text.replace('}, execution_thread="sparsecore"', "}, sparsecore"))


def test_an_unknown_element_type_is_refused_by_name():
    text = """HloModule m

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %q = f7e1m1[4]{0} convert(%p)
}
"""
    with pytest.raises(HloParseError, match=r"HLO line 5: expected an element type whose size is known "
                                            r"for %q, not 'f7e1m1'"):
        parse_hlo(text)
    assert parse_hlo(text.replace("f7e1m1", "f8e4m3fn")).entry.root.result[0].nbytes == 4


def _narrow_types(x):
    return (x.astype(jnp.bfloat16), x.astype(jnp.float8_e4m3fn), x.astype(jnp.float8_e5m2),
            x.astype(jnp.int4), x.astype(jnp.uint4), x > 0, x.astype(jnp.int8),
            x.astype(jnp.uint32), x.astype(jnp.complex64), x.astype(jnp.float16))


def test_the_element_types_xla_prints_are_known():
    module = parse_hlo(jax.jit(_narrow_types).lower(jnp.ones((8, 16))).compile().as_text())
    root = module.entry.root
    assert {a.dtype for a in root.result} == {"bf16", "f8e4m3fn", "f8e5m2", "s4", "u4", "pred", "s8",
                                               "u32", "c64", "f16"}
    assert sum(a.nbytes for a in root.result) == 8 * 16 * (2 + 1 + 1 + 1 + 1 + 1 + 1 + 4 + 8 + 2)


def test_an_attribute_value_over_several_lines_is_one_instruction():
    """libtpu 0.0.50.1 prints MaxText's Pallas kernels with
    `frontend_attributes={kernel_metadata={` and the metadata on the lines below."""
    text = """HloModule m

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %k = f32[4]{0} custom-call(%p), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
  "name": "flash {attention}"
}}, metadata={op_name="jit(step)/pallas_call"}
}
"""
    (param, kernel) = parse_hlo(text).entry.instructions
    assert kernel.custom_call_target == "tpu_custom_call" and kernel.operands == ("p",)
    assert kernel.op_name == "jit(step)/pallas_call"
    assert 'flash {attention}' in kernel.attrs["frontend_attributes"]
    with pytest.raises(HloParseError, match="HLO line 5"):
        parse_hlo(text.replace("}}, metadata", "}, metadata"))


# ---------------------------------------------------------------- text that is not a module


def _line_of(text: str, fragment: str) -> int:
    """1-based number of the first line of `text` holding `fragment`."""
    return next(n for n, line in enumerate(text.splitlines(), 1) if fragment in line)


@pytest.mark.parametrize("text", [
    "",
    "BufferAssignment:\nallocation 0: size 8192, parameter 0, shape |f32[8,256]| at ShapeIndex {}:\n",
    'module @jit_step attributes {mhlo.num_partitions = 8 : i32} {\n  func.func public @main() {\n',
    '{"hlo_module": {"name": "jit_step"}}\n',
], ids=["empty", "buffer-assignment", "stablehlo", "json"])
def test_text_that_is_not_hlo_names_line_1(text):
    with pytest.raises(HloParseError, match=r"^HLO line 1: expected `HloModule NAME`") as e:
        parse_hlo(text)
    assert e.value.line == 1 and "\n" not in str(e.value)


def test_a_module_cut_short_names_the_computation_left_open():
    cut = ASYNC_TEXT[:ASYNC_TEXT.rindex("}")]  # the ENTRY's closing brace is gone
    with pytest.raises(HloParseError) as e:
        parse_hlo(cut)
    last = len(cut.splitlines())
    opened = _line_of(cut, "ENTRY %main")
    assert e.value.line == last
    assert str(e.value).startswith(f"HLO line {last}: expected `}}` closing computation %main "
                                   f"(line {opened}); found the end of the text")


def test_a_module_without_entry_says_so():
    cut = ASYNC_TEXT[:ASYNC_TEXT.index("ENTRY")]  # only the `%add` computation is left
    with pytest.raises(HloParseError, match="expected an ENTRY computation; found the end") as e:
        parse_hlo(cut)
    assert e.value.line == len(cut.splitlines())


@pytest.mark.parametrize("after, unknown", [
    ("%p1 = f32[8]{0} parameter(1)", "  schedule_annotation %p1 before %p0"),  # in a computation
    ("%p1 = f32[8]{0} parameter(1)", "  %cp-start = (f32[8]{0}) collective-permute-start"),
    ('1 "moe"', "HloStatistics"),  # between the stack-frame tables
], ids=["not-an-instruction", "no-operands", "outside-computations"])
def test_a_line_of_an_unknown_xla_version_is_refused_with_its_number(after, unknown):
    lines = ASYNC_TEXT.splitlines()
    at = _line_of(ASYNC_TEXT, after)
    text = "\n".join(lines[:at] + [unknown] + lines[at:])
    with pytest.raises(HloParseError) as e:
        parse_hlo(text)
    assert e.value.line == at + 1 and str(e.value).startswith(f"HLO line {at + 1}: expected ")
    assert repr(unknown.strip()) in str(e.value)


def test_a_dropped_line_leaves_an_operand_undefined():
    text = "\n".join(l for l in ASYNC_TEXT.splitlines() if "%all-gather-start = " not in l)
    with pytest.raises(HloParseError, match="expected operand %all-gather-start to be an "
                                            "instruction of computation %main") as e:
        parse_hlo(text)
    assert e.value.line == _line_of(text, "%all-gather-done = ")


@pytest.mark.parametrize("groups", ["[2,4]<=[9]", "{{0,1,2,3},{4,5,6,9}}", "[2,4]<=[8]T(1,1)",
                                    "mesh['data'=2,'ctx'=4] {'context'}", "{{0,1},{2,x}}"])
def test_a_malformed_replica_group_names_the_collective_line(groups):
    text = ASYNC_TEXT.replace("replica_groups=[2,4]<=[8]", f"replica_groups={groups}")
    module = parse_hlo(text)  # attribute values are read when a reader asks for them
    with pytest.raises(HloParseError, match=r"; found ['\"]replica_groups=") as e:
        collectives_of(module, MeshInfo(("data", "context"), (2, 4)))
    line = _line_of(text, "%all-gather-start = ")
    assert e.value.line == line and str(e.value).startswith(f"HLO line {line}: expected ")


def test_a_malformed_attribute_names_the_line_when_read():
    text = ASYNC_TEXT.replace("dimensions={1}", "dimensions={1,a}")
    gather = parse_hlo(text).entry.get("all-gather-start")
    with pytest.raises(HloParseError, match=r"expected `dimensions=\{N,...\}`, a list of integers; "
                                            r"found 'dimensions=\{1,a\}'") as e:
        gather.dimensions
    assert e.value.line == _line_of(text, "%all-gather-start = ")


def test_tuple_sharding_elements_after_an_index_comment_decode():
    # XLA prints `/*index=5*/` before every fifth element of a tuple (a while loop's carry).
    text = "{{replicated}, {replicated}, {replicated}, {replicated}, {replicated}, " \
           "/*index=5*/{devices=[2,4]<=[8]}}"
    shardings = parse_tuple_sharding(text, MeshInfo(("data", "context"), (2, 4)), [0] * 5 + [2])
    assert shardings[5].dims == (("data",), ("context",))


def test_called_computations_in_braces_are_named_without_the_brace():
    text = """HloModule m

%cmp (a: f32[], b: f32[]) -> pred[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %sorted = f32[8]{0} custom-call(%p), custom_call_target="Sort", called_computations={%cmp}
}
"""
    assert parse_hlo(text).entry.root.called == ("cmp",)
