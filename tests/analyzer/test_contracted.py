"""Tokens un-sharded by a contraction: a capacity dispatch that sums the context-sharded
sequence into slots is a finding, with what it costs.

`rewrite_steps.top2_capacity_moe` is MaxText's capacity path routed the way XLA keeps
sharded at MaxText's Mixtral-8x7B size on 64 v5p chips: nothing of its routing is gathered;
the dispatch einsum's partial sums are all-reduced over `context`, and the expert matmuls
after it run on every capacity slot of the whole sequence on each context shard. Each step
is compiled by the installed JAX on data x context meshes of the 8 simulated devices, with
the tokens per device fixed (batch x seq over 8 devices).
"""

from __future__ import annotations

import functools
import math

import pytest

import shardlint
from shardlint._op_paths import members_of
from shardlint.analyzer import FindingKind
from shardlint.reports import format_text

from support import context_mesh, rewrite_steps
from support.cause_steps import BATCH, EMB, EXPERTS, MLP, SEQ, TOP_K
from support.markers import marker_line

F32 = 4


@functools.cache
def _analysis(context: int) -> shardlint.Analysis:
    fn, args = rewrite_steps.make_top2_capacity_step(context_mesh(context))
    return shardlint.analyze(fn, *args)


def _lines() -> tuple[int, int]:
    path = rewrite_steps.__file__
    return marker_line(path, "top-2 dispatch"), marker_line(path, "top-2 combine")


@pytest.mark.parametrize("context", [2, 4])
def test_the_dispatch_and_the_combines_transpose_are_the_findings(context):
    """Forward: the dispatch `BSM,BSEC -> EBCM`; backward: the combine's transpose, which
    contracts the sequence of the output's gradient into slots. Nothing else is lost: the
    cumsum's gather over context was asked for (a constraint)."""
    analysis = _analysis(context)
    dispatch, combine = _lines()
    found = sorted((f.source.line, f.backward) for f in analysis.findings)
    assert found == [(dispatch, False), (combine, True)]
    for f in analysis.findings:
        assert f.kind == FindingKind.CONTRACTED and f.cause == "lost"
        assert f.axes == ("context",) and f.op == "dot_general" and f.feeds_grouped_matmul
        assert f.operand_spec == (("data",), ("context",), ())   # the tokens' (batch, seq, emb)
    assert [c.cause for c in analysis.all_gathers()] == ["requested"]


@pytest.mark.parametrize("context", [2, 4])
def test_the_all_reduces_of_its_partial_sums_are_claimed_as_lost(context):
    """XLA labels the all-reduce over `context` with the dispatch (alone) and with the
    combine's transpose (combined with the router's gradient into one): each is the
    finding's, lost, not an ordinary reduction."""
    analysis = _analysis(context)
    by_id = {c.id: c for c in analysis.collectives}
    for f in analysis.findings:
        assert len(f.collectives) == 1
        c = by_id[f.collectives[0]]
        assert c.kind == "all-reduce" and "context" in c.axes and c.cause == "lost"
        assert any(p.endswith("/dot_general") and "BSEC" in p for p in members_of(c.xla_op_path))
        assert f.bytes == c.step_bytes > 0
    assert not [c for c in analysis.collectives if "context" in c.axes and c.cause == "reduction"]


@pytest.mark.parametrize("context", [2, 4])
def test_its_cost_is_the_expert_matmuls_replicated_over_context(context):
    """Per device: the dispatched `[E, B, C, M]` and the two expert matmuls' results (split
    over `data` only), and the matmuls' FLOPs beyond a context shard's share, computed here
    from the step's sizes."""
    data = 8 // context
    capacity = int(math.ceil(SEQ * TOP_K / EXPERTS) * 1.25)
    slots = EXPERTS * BATCH * capacity
    held = (slots * EMB + slots * MLP + slots * EMB) * F32 // data
    flops = 2 * (2 * slots * EMB * MLP) / data
    for f in _analysis(context).findings:
        assert f.replicated_bytes == held
        assert f.repeated_flops == pytest.approx(flops * (1 - 1 / context))


def test_nothing_is_contracted_where_the_sequence_is_not_sharded():
    assert _analysis(1).findings == ()


def test_the_finding_round_trips_through_json_and_reads_in_the_terminal():
    analysis = _analysis(4)
    assert shardlint.Analysis.from_json(analysis.to_json()) == analysis
    text = format_text(analysis)
    assert "dot_general sums the tokens away: the expert matmuls after it are replicated over context" in text
    assert "--per-shard-capacity" in text


def test_members_of_a_combined_collective_name():
    assert members_of("jit(step)/(jvp()/reduce_sum:transpose(jvp(a,b->c))/dot_general)") == (
        "jit(step)/jvp()/reduce_sum", "jit(step)/transpose(jvp(a,b->c))/dot_general")
    assert members_of("jit(step)/jvp()/mul;jit(step)/jvp()/add") == ("jit(step)/jvp()/mul", "jit(step)/jvp()/add")
    assert members_of("jit(step)/jvp(BSM,BSEC -> EBCM)/dot_general") == ("jit(step)/jvp(BSM,BSEC -> EBCM)/dot_general",)
