"""Every collective gets its cause, on steps written the way users write them.

Each step of `cause_steps` is compiled by the installed JAX on data=2 x context=4 and
data=4 x context=2 (analyzed once per session) and its collectives are checked against
the causes the step's docstring explains: gathers the partitioner placed for a scatter, a
cumsum, a `take` or a top_k are `lost` and claimed by a finding; a constraint that keeps
the sharding requests nothing; Ulysses all-to-alls asked with constraints are `layout`;
FSDP weight gathers are `weights`; a per-shard MoE has no gather at all.
"""

from __future__ import annotations

import functools

import jax
import pytest

import shardlint

from support import build_mesh, cause_steps

MESHES = [(2, 4), (4, 2)]


@functools.cache
def _analysis(name: str, data: int = 2, context: int = 4) -> shardlint.Analysis:
    fn, args = getattr(cause_steps, name)(build_mesh({"data": data, "context": context}))
    return shardlint.analyze(fn, *args)


LOST_STEPS = ["make_scatter_dispatch_step", "make_capacity_cumsum_step", "make_gather_dispatch_step",
              "make_scanned_layers_step", "make_prejitted_step", "make_nnx_step",
              "make_keep_sharded_constraint_step"]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("name", sorted(cause_steps.CAUSES))
def test_each_collective_gets_the_expected_cause(name, mesh):
    if name == "make_nnx_step":
        pytest.importorskip("flax")
    analysis = _analysis(name, *mesh)
    assert {c.cause for c in analysis.collectives} == cause_steps.CAUSES[name]
    claimed = {cid for f in analysis.findings for cid in f.collectives}
    for c in analysis.collectives:
        if c.kind in ("all-gather", "all-to-all") and c.cause == "lost":
            assert c.id in claimed, c
    if "lost" in cause_steps.CAUSES[name]:
        assert analysis.findings and all(f.cause == "lost" for f in analysis.findings)
    else:
        assert analysis.findings == ()


@pytest.mark.parametrize("name, marker, op", [
    ("make_scatter_dispatch_step", "scatter", "scatter"),
    ("make_capacity_cumsum_step", "cumsum", None),
])
def test_the_finding_names_the_op_the_partitioner_could_not_split(name, marker, op):
    analysis = _analysis(name)
    hits = [f for f in analysis.findings if "context" in f.axes and f.collectives
            and f.source.file.endswith("cause_steps.py")
            and f.source.line in _lines_near(cause_steps.marker_line(marker))]
    assert hits, analysis.findings
    if op is not None:
        assert any(f.op.startswith(op) for f in hits), hits


def _lines_near(line: int) -> set[int]:
    # JAX 0.12 names the neighbouring line for some of these gathers (see cause_steps).
    return {line - 4, line - 3, line - 2, line - 1, line}


def test_keep_sharded_constraint_requests_nothing():
    analysis = _analysis("make_keep_sharded_constraint_step")
    keep = {cause_steps.marker_line("keep weights"), cause_steps.marker_line("keep experts")}
    assert not [r for r in analysis.requested if r.source and r.source.line in keep]
    assert not analysis.by_cause("requested")
    plain = _analysis("make_scatter_dispatch_step")
    assert len(analysis.all_gathers()) == len(plain.all_gathers())
    assert all(c.cause == "lost" for c in analysis.all_gathers())


def test_ulysses_all_to_alls_asked_with_constraints_are_layout():
    analysis = _analysis("make_ulysses_step")
    moves = [c for c in analysis.collectives if c.kind == "all-to-all"]
    assert len(moves) == 8 and all(c.cause == "layout" and c.axes == ("context",) for c in moves)


def test_fsdp_weight_gathers_are_weights_on_a_three_axis_mesh():
    mesh = build_mesh({"data": 2, "fsdp": 2, "context": 2})
    fn, args = cause_steps.make_fsdp_step(mesh)
    analysis = shardlint.analyze(fn, *args)
    gathers = analysis.all_gathers()
    assert gathers and all(c.cause == "weights" and c.axes == ("fsdp",) for c in gathers)
    assert analysis.findings == ()


def test_scanned_fsdp_weight_gathers_are_weights(mesh):
    """A loop's carried tuple keeps its elements' marks apart from the first pass on: the
    sliced layer weights are weights, not data because an activation rides in the same
    tuple (MaxText's scanned layers read as `lost` before)."""
    fn, args = cause_steps.make_scanned_fsdp_step(mesh)
    analysis = shardlint.analyze(fn, *args)
    gathers = analysis.all_gathers()
    assert gathers and all(c.in_loop for c in gathers)
    assert all(c.cause == "weights" and c.axes == ("data",) for c in gathers), \
        [(c.cause, c.axes, c.shape) for c in gathers]
    assert analysis.findings == ()


def test_scanned_layers_carry_the_trip_count():
    analysis = _analysis("make_scanned_layers_step")
    looped = [c for c in analysis.collectives if c.in_loop]
    assert looped and all(c.trips == cause_steps.LAYERS for c in looped)
    for f in analysis.findings:
        members = [c for c in analysis.collectives if c.id in f.collectives]
        assert f.bytes == sum(c.bytes * (c.trips or 1) for c in members)
    assert any(c.in_loop and c.cause == "lost" for c in analysis.collectives)


def test_prejitted_and_nnx_steps_analyze_like_the_plain_function():
    pytest.importorskip("flax")
    jitted, nnx_step = _analysis("make_prejitted_step"), _analysis("make_nnx_step")
    for analysis in (jitted, nnx_step):
        assert any(f.op == "reshape" and "context" in f.axes and f.feeds_grouped_matmul
                   for f in analysis.findings)
    # nnx.jit traced itself: the backward pass and its gradient reductions are there.
    assert len(nnx_step.by_cause("reduction")) >= len(jitted.by_cause("reduction")) - 1
    assert jitted.memory.alias_bytes > 0  # donation kept


def test_the_text_report_counts_loop_iterations_and_shows_causes():
    from shardlint.reports import format_text

    text = format_text(_analysis("make_scanned_layers_step"))
    assert f"x{cause_steps.LAYERS} iterations" in text
    assert " lost " in text and " reduction " in text


def test_weights_gathered_in_a_loop_inside_a_scan_are_weights(mesh):
    """ShardedRoutedMoE's pieces are gathered in a loop inside the scan over layers: the
    inner loop's body is walked before the scan's body has bound its carry, and a value
    with no marks yet must not merge the carried tuple's elements when marks arrive (the
    weight pieces read as `requested`, data, before)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardlint import moe

    cfg = moe.MoeConfig(num_experts=8, top_k=2, emb_dim=32, mlp_dim=64)
    layer = moe.ShardedRoutedMoE(cfg, mesh, batch_axes="data", seq_axes="context")
    stacked = jax.tree.map(
        lambda w, s: jax.ShapeDtypeStruct((3,) + w.shape, w.dtype,
                                          sharding=NamedSharding(mesh, P(None, *s))),
        jax.eval_shape(layer.init, jax.random.key(0)), layer.param_specs())
    x = jax.ShapeDtypeStruct((4, 32, 32), jax.numpy.float32,
                             sharding=NamedSharding(mesh, P("data", "context")))

    def loss(params, x):
        h, _ = jax.lax.scan(jax.checkpoint(lambda h, p: (h + layer(p, h), None)), x, params)
        return jax.numpy.mean(h ** 2)

    analysis = shardlint.analyze(jax.value_and_grad(loss), stacked, x, params_argnums=(0,))
    gathers = analysis.all_gathers()
    assert gathers and all(c.in_loop for c in gathers)
    assert all(c.cause == "weights" for c in gathers), [(c.cause, c.shape) for c in gathers]
    assert analysis.findings == ()


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_an_all_to_all_is_attributed_to_the_op_it_reshards_for_not_a_later_one(mesh):
    """The add's operands are sharded along different dimensions: XLA moves one with an
    all-to-all, labelled with the add (forward) and the add_any of the transpose's backward.
    Neither is for the embedding's scatter-add further on, which once claimed them through
    a zero constant XLA shares into their fusion (and, in MaxText, the constraint near the
    embedding then called them requested)."""
    analysis = _analysis("make_embedded_transpose_step", *mesh)
    moves = [c for c in analysis.collectives if c.kind == "all-to-all"]
    assert moves, analysis.collectives
    near = {cause_steps.marker_line("transpose"), cause_steps.marker_line("add")}
    for c in moves:
        assert (c.needed_by, c.source.line, c.cause) in {("add", cause_steps.marker_line("add"), "lost"),
                                                         ("add_any", cause_steps.marker_line("transpose"), "lost")}, c
    findings = [f for f in analysis.findings if set(f.collectives) & {c.id for c in moves}]
    assert {f.op for f in findings} == {c.needed_by for c in moves}
    for f in findings:
        assert f.kind == "resharded-operand" and f.source.line in near
        assert len(f.operand_shapes) == 2 and f.operand_shapes[0] != f.operand_shapes[1], f
        assert "context" in f.operand_shapes[0] and "context" in f.operand_shapes[1]
