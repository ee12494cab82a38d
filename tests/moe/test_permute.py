"""The gather-only permutations of the Pallas path (`_permute`): values and gradients equal
to a dense reference, padding rows reading and receiving zeros."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlint.moe.kernels import _permute

T, K, D, G, TM = 24, 2, 16, 4, 8


def _dense(x_TD, w_TK, experts):
    """Each token's K choices through `experts`, combined by weight, with no permutation."""
    return jnp.einsum("tkd,tk->td", experts(jnp.repeat(x_TD[:, None], K, 1)), w_TK)


def _case():
    group_M = jnp.asarray(np.random.default_rng(1).integers(0, G, T * K), jnp.int32)
    lay = _permute.padded_layout(group_M, G, TM)
    x = jax.random.normal(jax.random.key(2), (T, D))
    w = jax.nn.softmax(jax.random.normal(jax.random.key(3), (T, K)))
    return lay, x, w


def test_permute_and_combine_match_the_dense_reference_in_values_and_gradients():
    """Rows to the slots, an elementwise stand-in for the experts, `combine` back: equal to
    the dense reference, and so are the gradients of x (through `permute_rows`' gather-only
    VJP) and of the weights."""
    lay, x, w = _case()
    experts = lambda v: jnp.tanh(v) * 2.0   # noqa: E731 (stands for the grouped SwiGLU)

    def permuted(x, w):
        x_PD = _permute.permute_rows(x, lay.src_P // K, lay.pos_M.reshape(T, K))
        return _permute.combine(experts(x_PD), lay.pos_M.reshape(T, K), w)

    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))   # noqa: E731
    np.testing.assert_allclose(permuted(x, w), _dense(x, w, experts), rtol=1e-6, atol=1e-6)
    dx, dw = jax.grad(loss(permuted), (0, 1))(x, w)
    dx_want, dw_want = jax.grad(loss(lambda x, w: _dense(x, w, experts)), (0, 1))(x, w)
    np.testing.assert_allclose(dx, dx_want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, dw_want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_and_weights_carries_each_slots_weight_exactly(dtype):
    """One gather gives each slot its token's row of g and its own weight, bit for bit in
    float32 also when g is bfloat16 (the weight's bits ride as two bfloat16 columns);
    padding slots get weight zero."""
    lay, x, w = _case()
    w = w * 1.0001   # bits a bfloat16 could not hold
    g_PX, w_P = _permute.rows_and_weights(x.astype(dtype), w, lay.src_P)
    g_PD = g_PX[:, :D]
    src = np.asarray(lay.src_P)
    used = src < T * K
    assert g_PD.dtype == dtype and w_P.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(w_P)[used], np.asarray(w).reshape(-1)[src[used]])
    assert np.all(np.asarray(w_P)[~used] == 0)
    np.testing.assert_array_equal(np.asarray(g_PD)[used],
                                  np.asarray(x.astype(dtype))[src[used] // K])


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


def test_permute_rows_inside_shard_map_where_only_the_indices_vary():
    """Inside shard_map, indices that vary over an axis x does not (expert parallelism
    without tokens over the expert axis: each device takes its own experts' rows of the
    same tokens) give x the sum of every device's gradient, as a plain gather does. The
    custom VJP used to return that gradient typed as varying over the expert axis, for an
    x that does not, and JAX refused the program."""
    from jax.sharding import PartitionSpec as P

    from shardlint.moe import _compat
    from support import make_mesh

    mesh = make_mesh((2, 4), ("data", "expert"))
    N = T // 2   # rows per data shard

    def rows(x_ND, gather):
        mine_M = (jnp.arange(N) + jax.lax.axis_index("expert")) % (G + 1)   # G: no slot
        lay = _permute.padded_layout(mine_M.astype(jnp.int32), G, TM)
        return gather(x_ND, lay)

    def custom(x_ND, lay):
        return _permute.permute_rows(x_ND, lay.src_P, lay.pos_M[:, None])

    def plain(x_ND, lay):
        valid_P = (lay.src_P < N)[:, None]
        return jnp.where(valid_P, x_ND[jnp.minimum(lay.src_P, N - 1)], 0.0)

    def loss(gather):
        def per_shard(x_ND):
            y = jnp.sum(jnp.sin(rows(x_ND, gather)) * jnp.arange(1.0, D + 1.0))
            return jax.lax.psum(y, ("data", "expert"))
        return _compat.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P())

    x = jax.random.normal(jax.random.key(5), (T, D))
    value, dx = jax.value_and_grad(loss(custom))(x)
    value_want, dx_want = jax.value_and_grad(loss(plain))(x)
    np.testing.assert_allclose(value, value_want, rtol=1e-6)
    np.testing.assert_allclose(dx, dx_want, rtol=1e-5, atol=1e-6)
