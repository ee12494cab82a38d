"""`capacity="per-shard"` on MaxText's dense capacity path in miniature (plain JAX).

`rewrite_steps.maxtext_capacity_moe` has what `RoutedMoE.dense_matmul` and
`generate_masks` have: no flatten of (batch, seq), a constraint that asks for the sequence
unsharded before the cumsum, a capacity from the sequence length, and the dispatch
einsum `BSM,BSEC -> EBCM` that contracts the sequence into capacity slots. Per shard, the
masks, the cumsum, the capacity, the dispatch, the expert einsums and the combine run on
each shard's tokens with that shard's capacity (GShard groups), so nothing is gathered and
temp memory stays flat as the context degree grows with the tokens per device fixed. The
numbers are those of the layer run separately on each shard's tokens
(`support.per_shard_reference`), not the original's: where the capacity binds, a
shard drops other tokens than the whole sequence would.
"""

from __future__ import annotations

import functools
import inspect

import pytest

import shardlint
from shardlint.rewrites import verify_same

from support import context_mesh, rewrite_steps
from support.per_shard_reference import blocks_of, per_shard


@functools.cache
def _rewritten(context: int):
    mesh = context_mesh(context)
    fn, args = rewrite_steps.make_maxtext_capacity_step(mesh)
    before = shardlint.analyze(fn, *args)
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before, capacity="per-shard")
    return mesh, fn, args, fixed, before, shardlint.analyze(fixed, *args)


@pytest.mark.parametrize("context", [2, 4])
def test_the_capacity_path_runs_per_shard_and_gathers_nothing(context):
    *_, fixed, before, after = _rewritten(context)
    assert fixed.changed is True
    assert any(f.cause == "lost" and "context" in f.axes for f in before.findings)
    assert after.findings == ()
    assert after.all_gathers() == ()   # the constraint asking for the whole sequence too


def test_temp_memory_stays_flat_as_the_context_degree_grows():
    """Tokens per device are fixed (batch x seq over 8 devices): the right temp is flat.
    Before, the capacity path's expert activations grow with the context degree."""
    temps = {c: _rewritten(c)[4:] for c in (2, 4)}
    before = {c: b.memory.temp_bytes for c, (b, _) in temps.items()}
    after = {c: a.memory.temp_bytes for c, (_, a) in temps.items()}
    assert before[4] > 2 * after[4]
    assert after[4] <= 1.15 * after[2], after


@pytest.mark.parametrize("context", [2, 4])
def test_numbers_are_the_layer_run_on_each_shards_tokens(context):
    mesh, fn, args, fixed, *_ = _rewritten(context)
    layer = per_shard(functools.partial(rewrite_steps.maxtext_capacity_moe, mesh=mesh),
                      *blocks_of(args[1]), token_args=(1,))
    reference, _ = rewrite_steps.make_maxtext_capacity_step(mesh, layer=layer)
    assert verify_same(reference, fixed, args, rtol=1e-5, atol=1e-6)
    # The capacity binds: the whole sequence's capacity drops other tokens.
    with pytest.raises(shardlint.RewriteError, match="different numbers"):
        verify_same(fn, fixed, args, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layers", ["scan", "scan, remat", "loop"])
def test_stacked_layers_each_run_on_each_shards_tokens(layers, mesh):
    """Every layer of a stack is rewritten, with its own per-shard capacity: in a scan (where
    JAX hoists the one-hot's iota out of the loop, and the forward body saves the capacity
    masks, one shard's size, for the backward body), and in a Python loop over the stack's
    layers (`w[i]`: weights sliced out of the stack are expert weights too)."""
    fn, args = rewrite_steps.make_stacked_capacity_step(mesh, layers)
    fixed = shardlint.rewrite(fn, mesh, args=args, capacity="per-shard")
    layer = per_shard(functools.partial(rewrite_steps.maxtext_capacity_moe, mesh=mesh),
                      *blocks_of(args[1]), token_args=(1,))
    reference, _ = rewrite_steps.make_stacked_capacity_step(mesh, layers, layer=layer)
    assert verify_same(reference, fixed, args, rtol=1e-5, atol=1e-6)
    assert shardlint.analyze(fixed, *args).findings == ()


@pytest.mark.parametrize("leak, line, what", [
    ("positions", "# <- positions", r"a token.s position in its expert, .*\) leaves the routed region"),
    ("dispatched", "# <- dispatch", r"has a dimension sized by one shard's capacity"),
])
def test_a_per_shard_value_leaving_the_layer_is_refused_at_its_line(leak, line, what, mesh):
    source = inspect.getsource(rewrite_steps).splitlines()
    at = next(i + 1 for i, text in enumerate(source) if text.rstrip().endswith(line))
    fn, args = rewrite_steps.make_maxtext_capacity_step(mesh, leak=leak)
    way_out = "(Keep what reads|Contract the capacity)"
    with pytest.raises(shardlint.RewriteError, match=rf"rewrite_steps\.py:{at}\b.*{what}.*{way_out}"):
        shardlint.rewrite(fn, mesh, args=args, capacity="per-shard")


@functools.cache
def _top2(context: int):
    mesh = context_mesh(context)
    fn, args = rewrite_steps.make_top2_capacity_step(mesh)
    before = shardlint.analyze(fn, *args)
    if context == 1:
        return mesh, fn, args, None, before, None
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before, capacity="per-shard")
    return mesh, fn, args, fixed, before, shardlint.analyze(fixed, *args)


@pytest.mark.parametrize("context", [2, 4])
def test_a_dispatch_that_sums_tokens_away_is_a_region_of_its_own(context):
    """MaxText's Mixtral-8x7B on 64 v5p chips in miniature (`top2_capacity_moe`): XLA gathers
    none of the routing, so no routing op is where the analysis found the loss; the
    dispatch that sums the context-sharded sequence into slots is (`contracted-tokens`). It
    starts the region: the layer runs per shard, the numbers are the layer's on each
    shard's tokens, and nothing is contracted over `context` any more."""
    mesh, fn, args, fixed, before, after = _top2(context)
    assert {f.kind for f in before.findings} == {"contracted-tokens"}
    assert fixed.changed is True
    assert after.findings == ()
    assert not [c for c in after.collectives if "context" in c.axes and c.kind == "all-gather"]
    layer = per_shard(functools.partial(rewrite_steps.top2_capacity_moe, mesh=mesh),
                      *blocks_of(args[1]), token_args=(1,))
    reference, _ = rewrite_steps.make_top2_capacity_step(mesh, layer=layer)
    assert verify_same(reference, fixed, args, rtol=1e-5, atol=1e-6)


def test_a_contracting_dispatch_rewritten_keeps_temp_and_flops_flat():
    """Tokens per device fixed: at context 2 and 4 the rewritten step needs at most 1.15x the
    temp and 1.1x the FLOPs per device of context 1 (the goal of the real-size issue);
    before, both grow with the context degree."""
    first = _top2(1)[4].memory
    for context in (2, 4):
        before, after = _top2(context)[4].memory, _top2(context)[5].memory
        assert before.temp_bytes > 1.3 * first.temp_bytes and before.flops > 1.3 * first.flops
        assert after.temp_bytes <= 1.15 * first.temp_bytes, (context, after.temp_bytes, first.temp_bytes)
        assert after.flops <= 1.1 * first.flops, (context, after.flops, first.flops)
