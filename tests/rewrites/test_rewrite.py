"""shardlint.rewrite on code shardlint did not write (the jaxpr route): the lossy flatten
is gone, no activation is all-gathered, and loss and every gradient are unchanged."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardlint
from shardlint.examples import steps
from shardlint.rewrites import RewrittenStep, verify_same
from shardlint.rewrites._verify import random_like

from support import context_mesh

SIZES = steps.Sizes(batch=8)  # two batch rows per device at every mesh below
CONTEXTS = [2, 4, 8]


@functools.cache
def _case(make_name: str, context: int):
    mesh = context_mesh(context)
    fn, args = getattr(steps, make_name)(mesh, SIZES)
    before = shardlint.analyze(fn, *args)
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before)
    after = shardlint.analyze(fixed, *args)
    return mesh, fn, args, fixed, before, after


@pytest.mark.parametrize("make_name", ["make_step", "make_qwen3_style_step"])
@pytest.mark.parametrize("context", CONTEXTS)
def test_rewritten_step_keeps_tokens_sharded_and_equal(make_name, context):
    mesh, fn, args, fixed, before, after = _case(make_name, context)
    assert isinstance(fixed, RewrittenStep)
    assert any(f.op == "reshape" and "context" in f.axes for f in before.findings)
    assert before.all_gathers(), "the original must show the bug"
    assert after.findings == ()
    assert after.all_gathers() == ()
    # Loss and every gradient, on random inputs of the real shapes and shardings.
    values = random_like(args)
    want = jax.jit(fn)(*values)
    got = fixed(*values)
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("context", CONTEXTS)
def test_per_device_memory_falls_with_context(context):
    *_, before, after = _case("make_step", context)
    # The rewritten step's temp memory is per shard: it does not stay at the global size.
    assert after.memory.temp_bytes < before.memory.temp_bytes / 2


def test_verify_passes_on_a_correct_rewrite():
    _, fn, args, fixed, *_ = _case("make_step", 4)
    assert verify_same(fn, fixed, args) is True


def test_verify_fails_loudly_when_numbers_differ():
    _, fn, args, *_ = _case("make_step", 4)

    def wrong(params, x):
        loss, grads = fn(params, x)
        return loss * 1.01, grads

    with pytest.raises(shardlint.RewriteError, match=r"different numbers.*output\[0\]"):
        verify_same(fn, wrong, args)


def test_global_capacity_is_refused_with_the_reason(mesh):
    fn, args = steps.make_capacity_step(mesh, SIZES)
    with pytest.raises(shardlint.RewriteError, match=r"cumsum over the token dimension at .* couples all tokens") as info:
        shardlint.rewrite(fn, mesh, args=args)
    assert "steps.py" in str(info.value) and "dropless" in str(info.value)


def test_nothing_to_rewrite_is_said_and_runs_the_step_as_it_is(mesh):
    fn, args = steps.make_per_shard_step(mesh, SIZES)
    messages = []
    with pytest.warns(shardlint.NothingToRewrite, match="nothing to rewrite") as caught:
        fixed = shardlint.rewrite(fn, mesh, args=args, progress=messages.append)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert fixed.changed is False
    assert str(jax.make_jaxpr(fixed)(*args)) == str(jax.make_jaxpr(jax.jit(fn))(*args))
    assert any("nothing to rewrite" in m for m in messages)


def test_forward_function_differentiated_later_by_the_user(mesh):
    _, (params, x) = steps.make_step(mesh, SIZES)

    def forward(params, x):
        return steps.routed_moe(params, x, SIZES.top_k)

    fixed = shardlint.rewrite(forward, mesh, args=(params, x), batch_axes=("data",), seq_axes=("context",))
    values = random_like((params, x))

    def loss(f, p, x):
        return jnp.mean(f(p, x) ** 2)

    want = jax.jit(jax.value_and_grad(functools.partial(loss, forward)))(*values)
    got = jax.jit(jax.value_and_grad(functools.partial(loss, fixed)))(*values)
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    lowered = jax.jit(jax.grad(functools.partial(loss, fixed))).lower(*values).as_text()
    assert "shard_map" in lowered or "manual" in lowered


def test_jaxpr_route_on_the_decoder_with_constraints_and_inner_jits(mesh):
    # Code with NamedSharding constraints, jitted helpers (silu, argsort) and a
    # cross-entropy over all tokens: only the routed regions are re-emitted, and the
    # numbers are unchanged. (The CLI would take the shardlint.moe swap route here.)
    from shardlint.examples import decoder
    from shardlint.rewrites import TokenAxes

    fn, args = decoder.make_step(mesh, decoder.DecoderConfig(layers=1))
    messages = []
    fixed = RewrittenStep(fn, mesh, axes=TokenAxes(("data",), ("context",)), progress=messages.append)
    assert verify_same(fn, fixed, args)
    assert any("rewrote 2 routed region(s)" in m for m in messages)  # forward and backward
    after = shardlint.analyze(fixed, *args)
    assert after.findings == ()
    assert all(c.source.file.endswith("decoder.py") for c in after.all_gathers())  # K/V only
