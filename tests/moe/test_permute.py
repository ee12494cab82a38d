"""The gather-only permutations of the Pallas path (`_permute`): values and gradients equal
to a dense reference, padding rows reading and receiving zeros."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from shardlint.moe import _permute

T, K, D, G, TM = 24, 2, 16, 4, 8


def _dense(x_TD, w_TK, experts):
    """Each token's K choices through `experts`, combined by weight, with no permutation."""
    return jnp.einsum("tkd,tk->td", experts(jnp.repeat(x_TD[:, None], K, 1)), w_TK)


def test_permute_and_combine_match_the_dense_reference_in_values_and_gradients():
    group_M = jnp.asarray(np.random.default_rng(1).integers(0, G, T * K), jnp.int32)
    lay = _permute.padded_layout(group_M, G, TM)
    x = jax.random.normal(jax.random.key(2), (T, D))
    w = jax.nn.softmax(jax.random.normal(jax.random.key(3), (T, K)))
    experts = lambda v: jnp.tanh(v) * 2.0   # noqa: E731 (stands for the grouped SwiGLU)

    def permuted(x, w):
        x_PD = _permute.permute_rows(x, lay.src_P // K, lay.pos_M.reshape(T, K))
        y_PD = experts(x_PD)
        return _permute.gather_combine(y_PD, lay.pos_M.reshape(T, K), lay.src_P, w)

    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))   # noqa: E731
    np.testing.assert_allclose(permuted(x, w), _dense(x, w, experts), rtol=1e-6, atol=1e-6)
    got = jax.grad(loss(permuted), (0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: _dense(x, w, experts)), (0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_padding_rows_read_zeros_and_get_zero_gradients():
    """Rows of the padding group (id G: expert parallelism's empty bucket slots) have no
    slot: they come back zero and receive no gradient, and the padding slots of the layout
    (NaN here, as a kernel may leave them) never reach a result."""
    group_M = jnp.asarray([0, G, 1, 1, G, 0, 2, G], jnp.int32)
    lay = _permute.padded_layout(group_M, G, TM)
    x = jax.random.normal(jax.random.key(4), (group_M.shape[0], D))
    real = np.asarray(group_M) < G

    def roundtrip(x):
        x_PD = _permute.permute_rows(x, lay.src_P, lay.pos_M[:, None])
        slot_used = (lay.src_P < group_M.shape[0])[:, None]
        y_PD = jnp.where(slot_used, 3.0 * x_PD, jnp.nan)
        return _permute.permute_rows(y_PD, lay.pos_M, lay.src_P[:, None])

    y, back = jax.vjp(roundtrip, x)
    np.testing.assert_allclose(np.asarray(y)[real], 3.0 * np.asarray(x)[real], rtol=1e-6)
    assert np.all(np.asarray(y)[~real] == 0)
    (dx,) = back(jnp.ones_like(y))
    np.testing.assert_allclose(np.asarray(dx)[real], 3.0, rtol=1e-6)
    assert np.all(np.asarray(dx)[~real] == 0)
