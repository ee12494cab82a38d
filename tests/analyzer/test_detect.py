"""Lost-sharding findings on steps the installed JAX compiled, over several meshes.

Each step is analyzed once per mesh (module-scoped cache) and shared by the tests.
"""

from __future__ import annotations

import inspect
import json

import jax
import pytest
from jax.sharding import AxisType

import shardlint
from shardlint.examples import steps

from support import build_mesh, context_mesh, example_analyses, partitioners

CONTEXTS = [2, 4, 8]


_analysis = example_analyses.analysis
SIZES = example_analyses.SIZES


def _line_of(function, text: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


FLATTEN = "tokens_TD = x_BSD.reshape(b * s, d)"


@pytest.mark.parametrize("context", CONTEXTS)
def test_flatten_outside_shard_map_is_found_at_its_own_line(context):
    analysis = _analysis("make_step", context)
    line = _line_of(steps.routed_moe, FLATTEN)
    hits = [f for f in analysis.findings if f.op == "reshape" and "context" in f.axes]
    assert len(hits) == 1, analysis.findings
    finding = hits[0]
    assert finding.source.line == line and finding.source.file.endswith("examples/steps.py")
    assert finding.feeds_grouped_matmul
    assert finding.op_path.endswith("reshape")
    # The all-gather XLA emitted for it is linked, over context, with its bytes.
    linked = [c for c in analysis.collectives if c.id in finding.collectives]
    assert linked and all(c.kind == "all-gather" and "context" in c.axes for c in linked)
    assert finding.bytes == sum(c.bytes for c in linked) > 0
    assert all(c.source is not None and c.source.line == line for c in linked)


@pytest.mark.parametrize("context", CONTEXTS)
def test_every_finding_of_the_naive_step_is_a_root_cause_op(context):
    analysis = _analysis("make_step", context)
    # The flatten and the global argsort drop axes in the propagated module; XLA:CPU's
    # partitioner also gathers the data-sharded router logits for its TopK custom call,
    # which only the partitioned module shows.
    assert {f.op for f in analysis.findings} <= {"reshape", "sort", "top_k"}
    sort_line = _line_of(steps._experts, "jnp.argsort")
    top_k_line = _line_of(steps._route, "jax.lax.top_k")
    for f in analysis.findings:
        assert f.cause == "lost" and f.needed_by == f.op
        if f.op == "sort":  # a global argsort over tokens that are sharded over data
            assert "data" in f.axes and set(f.axes) <= {"data", "context"}
            assert f.source.line == sort_line
        if f.op == "top_k":
            assert f.source.line == top_k_line and f.collectives
    # Every gather of the step is a lost activation and is some finding's.
    claimed = {cid for f in analysis.findings for cid in f.collectives}
    for c in analysis.all_gathers():
        assert c.cause == "lost" and c.id in claimed, c


@pytest.mark.parametrize("context", CONTEXTS)
def test_flatten_per_shard_inside_shard_map_is_clean(context):
    analysis = _analysis("make_per_shard_step", context)
    assert analysis.findings == ()
    assert analysis.all_gathers() == ()


@pytest.mark.parametrize("context", CONTEXTS)
def test_flatten_before_dense_mlp_does_not_feed_a_grouped_matmul(context):
    analysis = _analysis("make_dense_step", context)
    [finding] = analysis.findings
    assert finding.op == "reshape" and finding.axes == ("context",)
    assert finding.source.line == _line_of(steps.dense_mlp, FLATTEN)
    assert not finding.feeds_grouped_matmul


@pytest.mark.parametrize("context", CONTEXTS)
def test_split_heads_and_requested_kv_gather_are_not_findings(context):
    analysis = _analysis("make_attention_step", context)
    assert analysis.findings == ()
    gathers = analysis.all_gathers()
    assert len(gathers) >= 2 and all("context" in g.axes for g in gathers)
    kv_lines = {_line_of(steps.attention_kv_gather, "k = (x_BSD"), _line_of(steps.attention_kv_gather, "v = (x_BSD")}
    assert {r.source.line for r in analysis.requested} == kv_lines
    assert all(r.axes == ("context",) for r in analysis.requested)
    assert all(g.cause == "requested" for g in gathers)


def test_json_document_follows_the_schema():
    analysis = _analysis("make_step", 4)
    doc = json.loads(json.dumps(analysis.to_json()))
    assert doc["schema"] == "shardlint.analysis/3"
    assert doc["mesh"] == {"data": 2, "context": 4}
    assert {"argument_bytes", "output_bytes", "temp_bytes", "peak_bytes"} <= set(doc["memory"])
    for c in doc["collectives"]:
        assert {"id", "kind", "axes", "bytes", "shape", "op_path", "source", "cause", "needed_by",
                "stack", "trips"} <= set(c)
        assert c["cause"] in shardlint.analyzer.CAUSES
    for f in doc["findings"]:
        assert {"kind", "op", "axes", "feeds_grouped_matmul", "source", "op_path", "collectives",
                "bytes", "message", "cause", "needed_by", "stack"} <= set(f)
        assert set(f["collectives"]) <= {c["id"] for c in doc["collectives"]}
    assert shardlint.Analysis.from_json(doc) == analysis


def test_memory_and_flops_come_from_xla():
    analysis = _analysis("make_step", 4)
    assert analysis.memory.temp_bytes > 0 and analysis.memory.argument_bytes > 0
    assert analysis.memory.flops and analysis.memory.flops > 0


def test_gspmd_propagation_gives_the_same_finding():
    partitioners.skip_without_gspmd()
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        fn, args = steps.make_step(context_mesh(4), SIZES)
        analysis = shardlint.analyze(fn, *args)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    assert analysis.partitioner == "gspmd"
    line = _line_of(steps.routed_moe, FLATTEN)
    assert any(f.op == "reshape" and "context" in f.axes and f.source.line == line
               and f.feeds_grouped_matmul and f.collectives for f in analysis.findings)


def test_explicit_axis_mesh_works():
    # Under Explicit axes JAX itself refuses the naive flatten; code written for it
    # (here the per-shard MoE) analyzes as on an Auto mesh.
    mesh = build_mesh({"data": 2, "context": 4}, AxisType.Explicit)
    fn, args = steps.make_per_shard_step(mesh, SIZES)
    analysis = shardlint.analyze(fn, *args)
    assert analysis.mesh == {"data": 2, "context": 4}
    assert analysis.findings == () and analysis.all_gathers() == ()
    assert analysis.collectives and all(c.axes for c in analysis.collectives)


def test_arguments_on_two_meshes_are_an_error():
    fn, args_a = steps.make_dense_step(context_mesh(2))
    _, args_b = steps.make_dense_step(context_mesh(4))
    with pytest.raises(shardlint.AnalysisError, match="different meshes"):
        shardlint.analyze(fn, args_a[0], args_b[1])


def test_tracing_failure_is_an_analysis_error():
    _, args = steps.make_dense_step(context_mesh(2))

    def broken(params, x):
        return x @ x  # shapes do not match

    with pytest.raises(shardlint.AnalysisError, match="tracing the step failed"):
        shardlint.analyze(broken, *args)


@pytest.mark.parametrize("spec, shapes, transpose, expected", [
    ("bsd,edf->bsef", ((2, 8, 4), (3, 4, 5)), None, True),       # dense dispatch: every expert
    ("bsd,dhk->bshk", ((2, 8, 4), (4, 3, 5)), None, False),      # attention's query kernel
    ("bshk,hkd->bsd", ((2, 8, 3, 5), (3, 5, 4)), None, False),   # attention's output kernel
    ("bsd,edf->bsef", ((2, 8, 4), (3, 5, 4)), (0, 2, 1), True),  # [E, F, D] stored, transposed
    # One layer's weights out of a stack over layers (`w[1]` in a Python loop over layers)
    ("bsd,edf->bsef", ((2, 8, 4), (6, 3, 4, 5)), "layer 1", True),
    ("bsd,dhk->bshk", ((2, 8, 4), (6, 4, 3, 5)), "layer 1", False),
    ("bsd,df->bsf", ((2, 8, 4), (6, 4, 5)), "layer 1", False),   # a dense MLP's kernel
])
def test_expert_weights_are_stacked_weights_whose_leading_dim_is_kept(spec, shapes, transpose, expected):
    """A matmul reads expert weights when a rank-3 input keeps its leading (expert) dim;
    attention's 3-D kernels contract theirs; activations (token values) are not weights."""
    import jax.numpy as jnp

    from shardlint.jaxpr import reads_expert_weights

    def f(x, w):
        if transpose == "layer 1":
            return jnp.einsum(spec, x, w[1])
        return jnp.einsum(spec, x, w.transpose(transpose) if transpose else w)

    jaxpr = jax.make_jaxpr(f)(*(jnp.zeros(s) for s in shapes)).jaxpr
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    dot = next(e for e in jaxpr.eqns if e.primitive.name == "dot_general")
    x, w = jaxpr.invars
    assert reads_expert_weights(dot, jaxpr.eqns, producer, tokens={x}) is expected
    assert reads_expert_weights(dot, jaxpr.eqns, producer, tokens={x, w}) is False
