"""Findings say only what XLA's compiled program says (issue 41, "Why 4"), on steps written
as users write them, compiled by the installed JAX on several meshes:

- a flatten whose result keeps `context` on another dimension (XLA moves it there with
  all-to-alls) is that move, with its all-to-all, and no "drops context" without one;
- an all-to-all is "moved", never "gathered";
- "feeds a grouped matmul" only along the routed layer's own path to an expert matmul
  (attention's K/V gathers do not), through a capacity dispatch einsum too;
- a gather is put on the op that needed it, not on the op that made its operand;
- a finding and its collectives name one line, and each collective counts for one finding;
- backward findings say so;
- a way out names `--rewrite` only where the rewrite's planner runs the op per shard.

Each step is analyzed once per mesh and shared (`_analysis`).
"""

from __future__ import annotations

import functools
import inspect
import json

import pytest

import shardlint
from shardlint.examples import steps
from shardlint.reports import format_text

from support import build_mesh, cause_steps, noise_steps, rewrite_steps

MESHES = [{"data": 2, "context": 4}, {"data": 4, "context": 2}]
_LIBRARIES = {"noise": noise_steps, "cause": cause_steps, "rewrite": rewrite_steps}


@functools.cache
def _cached(library: str, name: str, axes: tuple) -> shardlint.Analysis:
    fn, args = getattr(_LIBRARIES[library], name)(build_mesh(dict(axes)))
    return shardlint.analyze(fn, *args)


def _analysis(step: str, mesh: dict) -> shardlint.Analysis:
    library, name = step.split(":")
    return _cached(library, name, tuple(mesh.items()))


def _line_of(function, text: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _at(analysis, file_end: str, line: int):
    return [f for f in analysis.findings if f.source and f.source.file.endswith(file_end)
            and f.source.line == line]


def _members(analysis, f):
    return [c for c in analysis.collectives if c.id in f.collectives]


def _mesh_id(mesh: dict) -> str:
    return "x".join(f"{k}{v}" for k, v in mesh.items())


FLATTEN = _line_of(steps.routed_moe, "x_BSD.reshape(b * s, d)")
TOP_K = _line_of(steps._route, "jax.lax.top_k")
ARGSORT = _line_of(steps._experts, "jnp.argsort")
UNFLATTEN = _line_of(steps.routed_moe, "out_TD.reshape(b, s, d)")


@pytest.mark.parametrize("mesh", MESHES, ids=_mesh_id)
def test_a_flatten_that_moves_context_to_another_dimension_is_that_move(mesh):
    """Its weights' embed dimension sharded over context, the routed MoE's flatten keeps
    context on the embed dimension: XLA moves the shards with all-to-alls and gathers
    nothing. Before: "reshape drops context" with no collective, plus "reshape cannot be
    split: its inputs are gathered over context" for the all-to-all, on the same line."""
    analysis = _analysis("noise:make_embed_context_step", mesh)
    [f] = _at(analysis, "examples/steps.py", FLATTEN)
    members = _members(analysis, f)
    assert (f.kind, f.op, f.axes) == ("resharded-operand", "reshape", ("context",)), f
    assert members and all(c.kind == "all-to-all" and c.axes == ("context",) for c in members)
    assert f.result_shape.endswith("P('data', 'context')")
    assert "gather" not in f.message and "moves" in f.message
    index = analysis.findings.index(f) + 1
    [line] = [x for x in format_text(analysis).splitlines() if x.startswith(f"  [{index}] ")]
    assert "moved over context" in line and "gather" not in line
    assert not [g for g in analysis.findings if g.kind == "lost-sharding" and not g.collectives]


WORDED = ["noise:make_embed_context_step", "cause:make_embedded_transpose_step", "noise:make_decoder_step"]


@pytest.mark.parametrize("mesh", MESHES, ids=_mesh_id)
@pytest.mark.parametrize("step", WORDED)
def test_words_match_the_collectives(step, mesh):
    """An all-to-all moves shards: no finding made of all-to-alls says "gather"; one made of
    all-gathers says "gather"."""
    analysis = _analysis(step, mesh)
    text = format_text(analysis).splitlines()
    checked = 0
    for i, f in enumerate(analysis.findings, 1):
        kinds = {c.kind for c in _members(analysis, f)}
        [headline] = [x for x in text if x.startswith(f"  [{i}] ")]
        if kinds == {"all-to-all"}:
            assert "gather" not in f.message + headline and "moved" in headline, (f.message, headline)
            checked += 1
        elif kinds == {"all-gather"} and f.kind != "lost-sharding":   # a drop is said as one
            assert "gather" in f.message and "gathered" in headline and "moved" not in headline
            checked += 1
    assert checked


ATTENTION = [noise_steps.marker_line("scores"), noise_steps.marker_line("values")]
CAPACITY_TOP_K = _line_of(cause_steps._capacity_moe, "jax.lax.top_k")
MAXTEXT_TOP_K = _line_of(rewrite_steps.maxtext_capacity_moe, "jax.lax.top_k")


@pytest.mark.parametrize("mesh", MESHES, ids=_mesh_id)
@pytest.mark.parametrize("step, file_end, lines, feeds", [
    # attention's K/V gathers reach the experts only through its own contractions
    ("noise:make_decoder_step", "noise_steps.py", ATTENTION, False),
    ("noise:make_scanned_decoder_step", "noise_steps.py", ATTENTION, False),
    ("noise:make_decoder_step", "examples/steps.py", [FLATTEN, TOP_K, ARGSORT], True),
    ("noise:make_scanned_decoder_step", "examples/steps.py", [FLATTEN, TOP_K, ARGSORT], True),
    # routing that reaches the expert einsums through a capacity dispatch einsum
    ("cause:make_capacity_cumsum_step", "cause_steps.py",
     [CAPACITY_TOP_K, cause_steps.marker_line("cumsum")], True),
    ("rewrite:make_maxtext_capacity_step", "rewrite_steps.py", [MAXTEXT_TOP_K], True),
    # dense dispatch without capacity: every expert runs on every token, top_k and the
    # scatter only weight the combine after the expert matmuls (a forward op is followed
    # through the forward pass only; the backward's matmuls are reached by every value)
    ("cause:make_scatter_dispatch_step", "cause_steps.py",
     [_line_of(cause_steps._scatter_moe, "jax.lax.top_k"), cause_steps.marker_line("scatter")], False),
], ids=lambda v: v.split(":")[-1] if isinstance(v, str) and ":" in v else None)
def test_feeds_a_grouped_matmul_only_along_the_routed_path(step, file_end, lines, feeds, mesh):
    analysis = _analysis(step, mesh)
    found = [f for line in lines for f in _at(analysis, file_end, line)]
    assert {f.source.line for f in found} == set(lines), analysis.findings
    assert all(f.feeds_grouped_matmul is feeds for f in found), \
        [(f.op, f.source.line, f.feeds_grouped_matmul) for f in found]


@pytest.mark.parametrize("mesh", MESHES, ids=_mesh_id)
def test_a_gather_is_put_on_the_op_that_needs_it(mesh):
    """XLA gathers the router's logits over context and data for top_k (JAX 0.12 labels the
    first gather with the router's matmul, which made them, and the chain runs through the
    partitioner's copies); the scatter's and its backward gather's inputs likewise. The
    router's matmul stays sharded: no finding names it."""
    analysis = _analysis("cause:make_scatter_dispatch_step", mesh)
    top_k_line = _line_of(cause_steps._scatter_moe, "jax.lax.top_k")
    [top_k] = _at(analysis, "cause_steps.py", top_k_line)
    assert top_k.op == "top_k" and set(top_k.axes) == {"context", "data"}
    assert not [f for f in analysis.findings if f.op == "dot_general"]
    lost = [c for c in analysis.collectives if c.cause == "lost"]
    assert lost and {c.needed_by for c in lost} <= {"top_k", "scatter", "gather"}


@pytest.mark.parametrize("mesh", MESHES, ids=_mesh_id)
@pytest.mark.parametrize("step", ["noise:make_decoder_step", "noise:make_scanned_decoder_step"])
def test_attentions_gathers_are_for_its_einsums(step, mesh):
    """K and V are gathered over context for the score and value einsums, whichever op
    XLA's label names (JAX 0.12: the head-splitting reshape that made them)."""
    analysis = _analysis(step, mesh)
    found = [f for line in ATTENTION for f in _at(analysis, "noise_steps.py", line)]
    assert found and all(f.op == "dot_general" and f.axes == ("context",) for f in found), found
    assert not [f for f in analysis.findings if f.op in ("reshape", "squeeze", "mul")
                and f.source.file.endswith("noise_steps.py")]


ALL_STEPS = ["noise:make_embed_context_step", "noise:make_decoder_step", "noise:make_scanned_decoder_step",
             "cause:make_scanned_layers_step", "cause:make_scatter_dispatch_step"]


@pytest.mark.parametrize("mesh", MESHES, ids=_mesh_id)
@pytest.mark.parametrize("step", ALL_STEPS)
def test_a_finding_and_its_collectives_name_one_line_and_each_counts_once(step, mesh):
    """The table shows a collective at the line of the finding it belongs to (a scanned
    step's flatten once showed its gather at the line that read it), and layers that share
    their lines (a Python loop) do not share their gathers."""
    analysis = _analysis(step, mesh)
    owners: dict[str, int] = {}
    for i, f in enumerate(analysis.findings):
        for c in _members(analysis, f):
            assert (c.source, c.stack, c.op_path) == (f.source, f.stack, f.op_path), (f, c)
            assert c.id not in owners, (c.id, analysis.findings[owners[c.id]], f)
            owners[c.id] = i
    doc = json.loads(json.dumps(analysis.to_json()))
    for f in doc["findings"]:
        for c in (c for c in doc["collectives"] if c["id"] in f["collectives"]):
            assert (c["source"], c["stack"]) == (f["source"], f["stack"])


@pytest.mark.parametrize("mesh", MESHES, ids=_mesh_id)
@pytest.mark.parametrize("step, backward", [
    ("noise:make_scanned_decoder_step", {("reshape", UNFLATTEN), ("dot_general", ATTENTION[0]),
                                         ("dot_general", ATTENTION[1])}),
    # jax.checkpoint: the backward recomputes the forward's flatten, top_k and argsort
    ("cause:make_scanned_layers_step", {("reshape", FLATTEN), ("reshape", UNFLATTEN), ("sort", ARGSORT),
                                        ("top_k", TOP_K)}),
])
def test_backward_findings_are_labelled_backward(step, backward, mesh):
    """Forward and backward ops of one line are findings of their own; the backward ones say
    so in the records, the JSON and the text."""
    analysis = _analysis(step, mesh)
    text = format_text(analysis).splitlines()
    for i, f in enumerate(analysis.findings, 1):
        assert f.backward is ("transpose(" in f.op_path.split(";")[0]), f
        [headline] = [x for x in text if x.startswith(f"  [{i}] ")]
        assert ("(backward)" in headline) is f.backward
    assert {(f.op, f.source.line) for f in analysis.findings if f.backward} >= backward
    assert [f["backward"] for f in analysis.to_json()["findings"]] == [f.backward for f in analysis.findings]


@pytest.mark.parametrize("step, mesh, op, line, rewrite", [
    # only the batch sharded (README's model.py at --mesh data=8): top_k and the argsort lose
    # data; the rewrite's planner runs routing ops that feed the experts per shard
    ("noise:make_batch_only_step", {"data": 8}, "top_k", TOP_K, True),
    ("noise:make_batch_only_step", {"data": 8}, "sort", ARGSORT, True),
    ("noise:make_batch_only_step", {"data": 4, "context": 2}, "top_k", TOP_K, True),
    # attention's contractions: no routing op, nothing the rewrite runs
    ("noise:make_decoder_step", {"data": 2, "context": 4}, "dot_general", ATTENTION[0], False),
    # a cumulative sum over tokens: only with per-shard capacity
    ("cause:make_capacity_cumsum_step", {"data": 2, "context": 4}, None, cause_steps.marker_line("cumsum"),
     "--per-shard-capacity"),
], ids=str)
def test_the_way_out_promises_only_what_the_rewrite_does(step, mesh, op, line, rewrite):
    analysis = _analysis(step, mesh)
    found = [f for f in analysis.findings if f.source and f.source.line == line and (op is None or f.op == op)]
    assert found, analysis.findings
    for f in found:
        assert ("--rewrite" in f.way_out) is bool(rewrite), f.way_out
        if isinstance(rewrite, str):
            assert rewrite in f.way_out
