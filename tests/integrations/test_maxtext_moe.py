"""shardlint on MaxText's own RoutedMoE (the `maxtext` package from the registry).

MaxText's config, its 12-axis mesh and logical axis rules, small dims, data=2 x context=4
on 8 CPU devices. The dense path (`sparse_matmul=false`) gathers its routing tensors over
the sequence at ops XLA's partitioner cannot split (top_k, the scatter that builds the
[batch, seq, experts] combine weights): those are `lost`, at moe.py's own lines, while its
constraint on the gate logits keeps the sharding and so asks for nothing. The sparse path
flattens inside shard_map (MaxText PR #1788): no activation is gathered, its weight gathers
are `weights`. MaxText's config turns JAX's persistent compilation cache on; the step is
analyzed twice to show that changes nothing.

Runs where MaxText is installed (CI's Python 3.12 environment: `pip install -e '.[test,maxtext]'`).
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed: pip install -e '.[maxtext]' (Python 3.12+)")

import shardlint  # noqa: E402

from support import maxtext_moe  # noqa: E402

pytestmark = pytest.mark.maxtext


def _moe_line(snippet: str) -> int:
    import maxtext.layers.moe as moe

    lines = inspect.getsource(moe).splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if snippet in line]
    assert len(hits) == 1, (snippet, hits)
    return hits[0]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="module")
def dense(cache_dir):
    fn, args = maxtext_moe.make_moe_step(sparse=False, jax_cache_dir=cache_dir)
    return fn, args, shardlint.analyze(fn, *args)


@pytest.fixture(scope="module")
def sparse(cache_dir):
    fn, args = maxtext_moe.make_moe_step(sparse=True, jax_cache_dir=cache_dir)
    return shardlint.analyze(fn, *args)


def _in_moe(source) -> bool:
    return source is not None and source.file.endswith("maxtext/layers/moe.py")


def test_dense_path_routing_gathers_are_lost_at_moe_lines(dense):
    _, _, analysis = dense
    top_k = _moe_line("top_k_weights, top_k_indices = jax.lax.top_k(gate_logits, self.num_experts_per_tok)")
    scatter = _moe_line("update_weights = update_weights.at[index_update].set(safe_weights")
    lost = [f for f in analysis.findings if f.cause == "lost" and "context" in f.axes]
    assert {f.source.line for f in lost} >= {top_k, scatter}
    assert all(_in_moe(f.source) for f in lost)
    # The findings claim every activation gather of the layer, over context and data.
    claimed = {cid for f in analysis.findings for cid in f.collectives}
    routing = [c for c in analysis.all_gathers() if c.cause != "weights"]
    assert len(routing) == 8 and all(c.cause == "lost" and c.id in claimed for c in routing)
    assert {a for c in routing for a in c.axes} == {"context", "data"}
    # Shown through the user's frames, never a site-packages path.
    for f in lost:
        assert not f.source.file.startswith("/") and f.stack[0] == f.source


def test_dense_path_keep_sharded_constraint_is_not_requested(dense):
    _, _, analysis = dense
    constraint = _moe_line('gate_logits = self._maybe_shard_with_logical(gate_logits, '
                           '("activation_batch_moe", "activation_length_moe", None))')
    for r in analysis.requested:
        assert all(s.line != constraint for s in r.stack if _in_moe(s)), r
    # The gate logits' gathers are explained at top_k, with the constraint on the way there.
    assert not analysis.by_cause("requested")


def test_dense_path_weight_gathers_are_weights(dense):
    _, _, analysis = dense
    weights = analysis.by_cause("weights")
    assert len(weights) == 4 and all(c.kind == "all-gather" and c.axes == ("context",) for c in weights)
    assert all(c.cause == "reduction" for c in analysis.collectives if c.kind == "all-reduce")


def test_sparse_path_has_no_lost_gather(sparse):
    assert not [f for f in sparse.findings if f.cause == "lost"]
    gathers = sparse.all_gathers()
    assert gathers and all(c.cause == "weights" for c in gathers)


def test_second_analysis_with_maxtexts_compile_cache_is_the_same(dense):
    fn, args, first = dense
    second = shardlint.analyze(fn, *args)
    assert [(c.kind, c.axes, c.shape, c.cause) for c in second.collectives] == \
        [(c.kind, c.axes, c.shape, c.cause) for c in first.collectives]
    assert [(f.op, f.source) for f in second.findings] == [(f.op, f.source) for f in first.findings]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda c: f"context={c}")
def dense_rewritten(request, cache_dir):
    from shardlint.analyzer.compile._compile import mesh_of

    context = request.param
    fn, args = maxtext_moe.make_moe_step(sparse=False, context=context, data=8 // context,
                                         jax_cache_dir=cache_dir)
    before = shardlint.analyze(fn, *args)
    fixed = shardlint.rewrite(fn, mesh_of(args), args=args, analysis=before)
    return fn, args, before, fixed, shardlint.analyze(fixed, *args)


def test_dense_path_rewrite_removes_the_routing_gathers(dense_rewritten):
    _, _, before, fixed, after = dense_rewritten
    assert fixed.changed is True
    assert [f for f in before.findings if f.cause == "lost"]
    assert after.findings == ()
    assert len(before.by_cause("lost")) > 0 and after.by_cause("lost") == ()
    # The expert weights are still gathered over context inside the layer, as MaxText asks.
    assert [c.cause for c in after.all_gathers()] == [c.cause for c in before.by_cause("weights")]


def test_dense_path_rewrite_keeps_loss_and_gradients(dense_rewritten):
    from shardlint.rewrites import verify_same

    fn, args, _, fixed, _ = dense_rewritten
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-6)


def test_sparse_path_is_returned_unchanged(cache_dir):
    from shardlint.analyzer.compile._compile import mesh_of

    fn, args = maxtext_moe.make_moe_step(sparse=True, jax_cache_dir=cache_dir)
    with pytest.warns(shardlint.NothingToRewrite):
        fixed = shardlint.rewrite(fn, mesh_of(args), args=args)
    assert fixed.changed is False


@pytest.fixture(scope="module")
def dense_in_signatures(cache_dir):
    """MaxText's dense RoutedMoE in the three signatures of tests/support/signature_steps:
    `step(x, *weights)`, `step(params, opt_state, batch, rng)`, `step(batch, params)`."""
    from support.signature_steps import SIGNATURES

    layer, params, x = maxtext_moe.make_moe_layer(sparse=False, jax_cache_dir=cache_dir)
    steps = {sig: wrap(layer, params, x) for sig, wrap in SIGNATURES.items()}
    return {sig: (step, args, shardlint.analyze(step, *args)) for sig, (step, args) in steps.items()}


def test_dense_path_causes_do_not_depend_on_the_signature(dense_in_signatures, dense):
    """Every collective of MaxText's layer gets the cause it gets in `make_moe_step`'s
    `step(params, rest, x)`, wherever the parameters sit; its expert weights' gathers over
    context stay `weights`, its routing gathers `lost`."""
    key = lambda c: (c.kind, c.axes, c.shape, c.needed_by, str(c.source))  # noqa: E731
    causes = {}
    for _, _, analysis in [*dense_in_signatures.values(), dense]:
        for c in analysis.collectives:
            causes.setdefault(key(c), set()).add(c.cause)
    assert {k: v for k, v in causes.items() if len(v) > 1} == {}
    for sig, (_, _, analysis) in dense_in_signatures.items():
        assert [c for c in analysis.all_gathers() if c.cause == "weights" and _in_moe(c.source)], sig
        assert {f.source.line for f in analysis.findings if _in_moe(f.source)} >= {
            f.source.line for f in dense[2].findings if _in_moe(f.source)}, sig


def test_dense_path_is_rewritten_alike_in_every_signature(dense_in_signatures):
    from shardlint.analyzer.compile._compile import mesh_of
    from shardlint.rewrites import verify_same

    for sig, (step, args, analysis) in dense_in_signatures.items():
        fixed = shardlint.rewrite(step, mesh_of(args), args=args, analysis=analysis)
        assert fixed.changed is True, (sig, fixed.notes)
        after = shardlint.analyze(fixed, *args)
        assert not [c for c in after.by_cause("lost") if _in_moe(c.source)], sig
        assert verify_same(step, fixed, args, rtol=1e-5, atol=1e-5)

