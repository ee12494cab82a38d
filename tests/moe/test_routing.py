"""The shared per-block functions against plain numpy oracles (single device, cheap)."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardlint import moe
from shardlint.moe.layers import _experts
from shardlint.moe.layers import _routing

# One XLA program per (shape, config) instead of one per primitive in eager mode.
_moe_tokens = jax.jit(_experts.moe_tokens, static_argnums=2)


def _cfg(**kw):
    fields = dict(num_experts=8, top_k=2, emb_dim=16, mlp_dim=32)
    fields.update(kw)
    return moe.MoeConfig(**fields)


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def _route_oracle(x, w, cfg):
    logits = x.astype(np.float64) @ w.astype(np.float64)
    scores = _softmax(logits) if cfg.softmax_before_topk else logits
    experts = np.argsort(-scores, axis=-1, kind="stable")[:, :cfg.top_k]
    picked = np.take_along_axis(scores, experts, -1)
    weights = picked if cfg.softmax_before_topk else _softmax(picked)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    if cfg.routed_scaling_factor is not None:
        weights = weights * cfg.routed_scaling_factor
    return weights, experts


def _silu(z):
    return z / (1 + np.exp(-z))


def _moe_oracle(x_TD, params, cfg, capacity=None):
    """Per-token loop; with `capacity`, slots go in token order then choice order."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    weights, experts = _route_oracle(np.asarray(x_TD), p["gate"], cfg)
    used = np.zeros(cfg.num_experts, int)
    y = np.zeros(x_TD.shape, np.float64)
    for t, xt in enumerate(np.asarray(x_TD, np.float64)):
        for j, e in enumerate(experts[t]):
            used[e] += 1
            if capacity is not None and used[e] > capacity:
                continue
            h = _silu(xt @ p["wi_0"][e]) * (xt @ p["wi_1"][e])
            y[t] += weights[t, j] * (h @ p["wo"][e])
    return y


@pytest.mark.parametrize("before,norm,scale", [(False, False, None), (True, False, None),
                                               (True, True, None), (True, True, 2.5),
                                               (False, False, 0.5)])
def test_route_matches_numpy(before, norm, scale):
    cfg = _cfg(softmax_before_topk=before, norm_topk_prob=norm, routed_scaling_factor=scale)
    x = jax.random.normal(jax.random.key(0), (24, 16))
    w = jax.random.normal(jax.random.key(1), (16, 8))
    weights, experts = jax.jit(moe.route, static_argnums=2)(x, w, cfg)
    want_w, want_e = _route_oracle(np.asarray(x), np.asarray(w), cfg)
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-5, atol=1e-6)
    assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32


@pytest.mark.parametrize("k", [1, 3])
def test_top_k_gradient_equals_lax_top_k_bit_for_bit_with_no_scatter(k):
    """The router's top_k: values, indices and gradient equal `jax.lax.top_k`'s exactly,
    and its gradient is no scatter (XLA's, as compiled here)."""
    scores = jax.random.normal(jax.random.key(2), (40, 8))
    weights = jnp.arange(1.0, k + 1.0)

    def loss(top_k):
        return lambda s: jnp.sum(jnp.cos(top_k(s, k)[0]) * weights)
    for a, b in zip(_routing.top_k(scores, k), jax.lax.top_k(scores, k)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    grad, lax_grad = (jax.jit(jax.grad(loss(f))).lower(scores).compile()
                      for f in (_routing.top_k, jax.lax.top_k))
    np.testing.assert_array_equal(np.asarray(grad(scores)), np.asarray(lax_grad(scores)))
    scatter = re.compile(r"\bscatter\(")   # the op, not a name that mentions it
    assert scatter.search(lax_grad.as_text())
    assert not scatter.search(grad.as_text())


def test_grouped_swiglu_padding_rows_are_zero_and_others_exact():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((10, 16)), jnp.float32)
    w0, w1, wo = (jnp.asarray(rng.standard_normal(shape) / 4, jnp.float32)
                  for shape in ((3, 16, 8), (3, 16, 8), (3, 8, 16)))
    group = jnp.array([2, 3, 0, 1, 3, 2, 0, 0, 3, 1])  # 3 == padding
    y = np.asarray(jax.jit(_experts.grouped_swiglu, static_argnums=2)(x, group, 3, w0, w1, wo))
    for m, g in enumerate(np.asarray(group)):
        if g == 3:
            np.testing.assert_array_equal(y[m], 0.0)
        else:
            h = _silu(np.asarray(x[m]) @ np.asarray(w0[g])) * (np.asarray(x[m]) @ np.asarray(w1[g]))
            np.testing.assert_allclose(y[m], h @ np.asarray(wo[g]), rtol=1e-5, atol=1e-5)


@settings(max_examples=6, deadline=None)
@given(num_experts=st.integers(1, 8), data=st.data(), tokens=st.sampled_from([4, 8, 12]),
       before=st.booleans())
def test_sparse_and_dense_match_the_per_token_oracle(num_experts, data, tokens, before):
    top_k = data.draw(st.integers(1, min(num_experts, 3)), label="top_k")
    cfg = _cfg(num_experts=num_experts, top_k=top_k, softmax_before_topk=before,
               norm_topk_prob=before)
    params = moe.init_moe_params(jax.random.key(3), cfg)
    x = jax.random.normal(jax.random.key(4), (tokens, 16))
    want = _moe_oracle(x, params, cfg)
    for strategy in ("sparse", "dense"):
        got = _moe_tokens(x, params, dataclasses.replace(cfg, strategy=strategy))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5,
                                   err_msg=strategy)


def test_dense_drops_tokens_over_capacity_in_token_then_choice_order():
    cfg = _cfg(num_experts=4, top_k=2, strategy="dense", capacity_factor=0.5)
    x = jax.random.normal(jax.random.key(5), (16, 16))
    params = moe.init_moe_params(jax.random.key(6), cfg)
    capacity = cfg.capacity(16)
    assert capacity == math.ceil(16 * 2 / 4 * 0.5) == 4
    want = _moe_oracle(x, params, cfg, capacity=capacity)
    got = np.asarray(_moe_tokens(x, params, cfg))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    no_drop = _moe_oracle(x, params, cfg)
    assert not np.allclose(got, no_drop, atol=1e-3), "capacity 4 should drop something here"


def test_reference_layer_is_moe_tokens_over_the_flattened_batch():
    cfg = _cfg()
    layer = moe.RoutedMoE(cfg)
    params = layer.init(jax.random.key(7))
    assert {k: v.shape for k, v in params.items()} == {
        "gate": (16, 8), "wi_0": (8, 16, 32), "wi_1": (8, 16, 32), "wo": (8, 32, 16)}
    x = jax.random.normal(jax.random.key(8), (2, 6, 16))
    want = _moe_oracle(x.reshape(12, 16), params, cfg).reshape(2, 6, 16)
    got = jax.jit(layer)(params, x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_capacity():
    assert _cfg(capacity_factor=0.0).capacity(10) == 10
    assert _cfg(capacity_factor=1.0).capacity(16) == 4          # 16 * 2 / 8
    assert _cfg(capacity_factor=1.25).capacity(10) == 4         # ceil(3.125)
    assert _cfg(capacity_factor=100.0).capacity(10) == 10       # never above the group


def test_config_rejects_top_k_over_experts_with_sizes_and_way_out():
    with pytest.raises(ValueError, match=r"top_k=9 > num_experts=8") as err:
        _cfg(top_k=9)
    assert "lower top_k to at most 8" in str(err.value)
    assert isinstance(err.value, moe.MoeConfigError)


def test_config_reports_every_problem_at_once():
    with pytest.raises(moe.MoeConfigError) as err:
        moe.MoeConfig(num_experts=2, top_k=3, emb_dim=0, mlp_dim=8, strategy="fast")
    text = str(err.value)
    for needle in ("emb_dim=0", "top_k=3 > num_experts=2", "strategy='fast'"):
        assert needle in text
