"""`verify_same` knows the precision a step computes in: a correct rewrite of a routed layer
whose expert matmuls write bfloat16 passes, as one in float32 does, and a wrong one fails in
both (tests/support/precision_steps.py): a token sent to the wrong expert, a dropped combine
weight, a missing psum, a capacity one larger. Float32's fixed tolerance alone refused the
correct bfloat16 rewrite (issue 41).
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest

import shardlint
from shardlint.rewrites import verify_same
from shardlint.rewrites._verify import Tolerance, tolerance_of
from support import precision_steps as ps
from support.per_shard_reference import blocks_of, per_shard

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# One output named, by how much it differs and against what, then the tolerance in words.
REFUSAL = (r"the rewritten step computes different numbers; left unchanged\. output\[\d\](\['w_\w+'\])? "
           r"float32\[[\d, ]*\]: differs by [\d.e+-]+( at \[[\d, ]+\])? \(original [\d.e+-]+, rewrite "
           r"[\d.e+-]+\) where the tolerance is [\d.e+-]+; \d+ of \d+ element\(s\) past it.*Tolerance: rtol/atol")


@pytest.fixture(scope="module", params=list(DTYPES))
def moe(request, mesh):
    """(dtype, mesh, step, args, the step rewritten by shardlint)."""
    dtype = DTYPES[request.param]
    step, args = ps.make_moe_step(mesh, dtype)
    return dtype, mesh, step, args, shardlint.rewrite(step, mesh, args=args)


def test_the_tolerance_is_float32s_plus_the_rounding_of_the_precision_the_step_writes(moe):
    dtype, _, step, args, _ = moe
    tolerance = tolerance_of(step, args)
    if dtype == jnp.float32:
        assert tolerance == Tolerance(rtol=1e-5, atol=1e-5, parts=8) and tolerance.units == 0
    else:
        assert tolerance.precision == np.dtype(jnp.bfloat16) and tolerance.parts == 8
        assert tolerance.units == pytest.approx(2**-7 * (1 + math.sqrt(8)) / 2)


def test_a_correct_rewrite_passes(moe):
    _, mesh, step, args, fixed = moe
    assert fixed.changed
    assert verify_same(step, fixed, args)
    by_hand, _ = ps.make_per_shard_step(mesh, moe[0])
    assert verify_same(step, by_hand, args)


def test_float32s_tolerance_alone_refuses_the_correct_bfloat16_rewrite(moe):
    dtype, _, step, args, fixed = moe
    if dtype == jnp.float32:
        assert verify_same(step, fixed, args, rtol=1e-5, atol=1e-5)
    else:
        with pytest.raises(shardlint.RewriteError, match=REFUSAL):
            verify_same(step, fixed, args, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fault", [*ps.FAULTS, "missing psum"])
def test_a_wrong_rewrite_fails_naming_the_output_and_the_tolerance(moe, fault):
    dtype, mesh, step, args, _ = moe
    wrong = (ps.make_per_shard_step(mesh, dtype, psum=False) if fault == "missing psum"
             else ps.make_moe_step(mesh, dtype, fault))[0]
    with pytest.raises(shardlint.RewriteError, match=REFUSAL) as info:
        verify_same(step, wrong, args)
    words = tolerance_of(step, args).words()
    assert str(info.value).endswith(f"Tolerance: {words}")
    if dtype == jnp.bfloat16:
        assert "plus 0.015 times each output's largest |value| (the step writes bfloat16" in words


@pytest.fixture(scope="module")
def capacity(moe):
    """GShard capacity per shard: the reference (the layer run on each shard's tokens), the
    rewrite with capacity='per-shard', and the reference with a capacity one larger."""
    dtype, mesh, *_ = moe
    step, args = ps.make_capacity_step(mesh, dtype, capacity_factor=1.0)

    def reference(capacity_factor):   # per shard 64 tokens x 2 choices / 4 experts: 32 x factor
        layer = per_shard(ps.capacity_layer(dtype, capacity_factor), *blocks_of(args[1]), token_args=(1,))
        return ps.make_capacity_step(mesh, dtype, layer=layer)[0]

    fixed = shardlint.rewrite(step, mesh, args=args, capacity="per-shard")
    return args, reference(1.0), fixed, reference(33 / 32)


def test_per_shard_capacity_passes_and_a_capacity_one_larger_fails(capacity):
    args, reference, fixed, one_larger = capacity
    assert fixed.changed and verify_same(reference, fixed, args)
    with pytest.raises(shardlint.RewriteError, match=REFUSAL):
        verify_same(reference, one_larger, args)


def test_a_refusal_names_each_output_that_differs(moe):
    _, mesh, step, args, _ = moe
    with pytest.raises(shardlint.RewriteError) as info:
        verify_same(step, ps.make_per_shard_step(mesh, moe[0], psum=False)[0], args)
    named = re.findall(r"output\[1\]\['(w_\w+)'\]", str(info.value))
    assert named == ["w_gate", "w_in", "w_out"]   # every gradient lacks the other shards' parts


def test_what_the_step_takes_a_root_of_is_drawn_non_negative():
    """An optimizer's second moments, found by what the step does with them (a square root,
    through elementwise ops), not by their name: Keras keeps its velocities in a plain list.
    Drawn negative, Adam's update is NaN in both steps, and NaN compares equal to nothing."""
    import jax

    from shardlint.rewrites._verify import random_like, rooted_leaves

    @jax.jit   # the moments updated in a call of their own, the root taken after it (optax, MaxText)
    def moments(m_DF, v_DF, g_DF):
        return 0.9 * m_DF + 0.1 * g_DF, (0.999 * v_DF + 0.001 * g_DF * g_DF).reshape(v_DF.shape)

    def adam_like(state, x_BD):
        w_DF, m_DF, v_DF = state
        g_DF = jax.grad(lambda w: jnp.sum(jnp.tanh(x_BD @ w)))(w_DF)
        m_DF, v_DF = moments(m_DF, v_DF, g_DF)
        return w_DF - 0.01 * m_DF / (jnp.sqrt(v_DF) + 1e-8), m_DF, v_DF

    sds = jax.ShapeDtypeStruct
    args = ([sds((4, 8), jnp.float32)] * 3, sds((2, 4), jnp.float32))
    assert rooted_leaves(adam_like, args) == {2}
    (w, m, v), _ = random_like(args, non_negative=rooted_leaves(adam_like, args))
    assert float(jnp.min(v)) >= 0 and float(jnp.min(w)) < 0 and float(jnp.min(m)) < 0
    assert not np.isnan(np.asarray(jax.jit(adam_like)(*random_like(args, rooted_leaves(adam_like, args)))[0])).any()
