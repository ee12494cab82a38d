"""The fix touches only the region it fixes: the step's Python is traced once, at its
global shapes, and only the routed region's own equations run at one shard's shapes.

Code outside the region that checks its shapes against the mesh (a kernel wrapper in its
own shard_map, as MaxText's flash attention is) stays as the user wrote it; numbers the
step's Python computed from the global sizes (a token count in a sort key) keep their
values inside the region; and where an op inside the region cannot run per shard, the
refusal names that op and its line."""

from __future__ import annotations

import jax
import pytest

import shardlint
from shardlint.rewrites import verify_same

from support import rewrite_steps
from support.markers import marker_line

STEPS = rewrite_steps.__file__


def _moe_findings(analysis):
    return [f for f in analysis.findings if f.source and f.source.file.endswith("examples/steps.py")]


def test_a_kernel_wrapper_that_checks_the_global_batch_stays_global(mesh):
    fn, args = rewrite_steps.make_kernel_wrapper_step(mesh)
    before = shardlint.analyze(fn, *args)
    assert _moe_findings(before)
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before, verify=False)
    assert fixed.changed is True
    after = shardlint.analyze(fixed, *args)
    assert _moe_findings(after) == []
    # The wrapper's own shard_map is bound as it was traced: its K/V gathers are still there.
    kv = lambda a: sorted((c.kind, c.axes) for c in a.collectives if c.cause == "layout" or c.cause == "requested")  # noqa: E731
    assert kv(after) == kv(before)
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("positions", ["iota", "constant"])
def test_a_region_whose_constants_carry_the_global_token_count(positions, mesh):
    fn, args = rewrite_steps.make_token_key_step(mesh, positions=positions)
    before = shardlint.analyze(fn, *args)
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before, verify=False)
    assert fixed.changed is True
    assert shardlint.analyze(fixed, *args).findings == ()
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-6)


def test_a_statistic_over_all_tokens_leaves_the_region_summed(mesh):
    """A load-balancing loss's sums over every token (keras-hub's Qwen3-MoE, Switch) arrange
    no token: each shard's part is summed across shards, and the maximum and ratios taken of
    them run on the global sums as written (before, the region took them in, and refused)."""
    fn, args = rewrite_steps.make_balance_loss_step(mesh)
    before = shardlint.analyze(fn, *args)
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before)   # verified by default
    assert fixed.changed is True
    assert _moe_findings(shardlint.analyze(fixed, *args)) == []
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-6)


def test_an_op_inside_the_region_that_cannot_run_per_shard_is_named(mesh):
    fn, args = rewrite_steps.make_configured_slice_step(mesh)
    line = marker_line(STEPS, "configured half")
    with pytest.raises(shardlint.RewriteError,
                       match=rf"dynamic_slice at tests/support/rewrite_steps\.py:{line} in the routed region"):
        shardlint.rewrite(fn, mesh, args=args)


def test_the_steps_python_runs_once_at_its_global_shapes(mesh, monkeypatch):
    """Whatever the step's Python checks, it checks at the shapes it was written for: every
    call of the attention's check sees the global batch."""
    fn, args = rewrite_steps.make_kernel_wrapper_step(mesh)
    seen = []
    original = jax.shard_map

    def spying(f, *a, **k):
        mapped = original(f, *a, **k)
        return lambda *xs: (seen.append(xs[0].shape), mapped(*xs))[1]

    monkeypatch.setattr(jax, "shard_map", spying)
    shardlint.rewrite(fn, mesh, args=args, verify=False)
    assert seen and {shape[0] for shape in seen} == {args[1].shape[0]}


def test_a_bug_of_shardlints_own_in_the_shape_pass_is_said_as_one(mesh, monkeypatch):
    """The shape pass goes on past an op JAX refuses at one shard's shapes, but not past an
    error of shardlint's own code: that is a RewriteError to report, never an op quietly
    taken for one that does not bind (and a step left 'with nothing to rewrite')."""
    from shardlint.rewrites.shard import _binder
    from shardlint.rewrites.shard import _shape_rules as _shard_shapes

    fn, args = rewrite_steps.make_kernel_wrapper_step(mesh)
    # A broadcast's shape worked out by the slice rule: a KeyError inside shardlint.
    monkeypatch.setattr(_binder, "broadcast_shape", _shard_shapes.slice_limits)
    with pytest.raises(shardlint.RewriteError, match=r"KeyError: 'limit_indices'.*report it"):
        shardlint.rewrite(fn, mesh, args=args, verify=False)
