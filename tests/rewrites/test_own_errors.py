"""Values a jitted helper makes and a reshape folds (a causal mask from `jnp.tril`, reshaped
to `[1, 1, 1, S, S]`), met at one shard's size in a layer with a routed MoE: made again at
that size, plain and in `lax.scan` with remat, with the same numbers. And where shardlint's
own pass fails while doing so, the error names the op it was working on and its line, as
shardlint's bug, with the failure as its cause: never a bare KeyError."""

from __future__ import annotations

import pytest

import jax
import jax.numpy as jnp

import shardlint
from shardlint.examples.steps import routed_moe

from support.cause_steps import LAYERS, TOP_K, _batch, _moe_params


def attention(x_BSD):
    """Grouped-query attention in miniature, causal by a mask `jnp.tril` makes (a jit)."""
    b, s, d = x_BSD.shape
    q_BSKGH = x_BSD.reshape(b, s, 2, 2, d // 4)
    scores_BKGST = jnp.einsum("bskgh,btkgh->bkgst", q_BSKGH, q_BSKGH)
    mask_11 = jnp.tril(jnp.ones((s, s), dtype=bool)).reshape(1, 1, 1, s, s)   # <- mask
    probs_BKGST = jax.nn.softmax(jnp.where(mask_11, scores_BKGST, -1e9), axis=-1)
    return jnp.einsum("bkgst,btkgh->bskgh", probs_BKGST, q_BSKGH).reshape(b, s, d)


def make_step(mesh, scanned: bool):
    def layer(x_BSD, params):
        x_BSD = x_BSD + attention(x_BSD)
        return x_BSD + routed_moe(params, x_BSD, TOP_K), None

    def step(params, x_BSD):
        def loss(params):
            if scanned:
                out_BSD, _ = jax.lax.scan(jax.checkpoint(layer), x_BSD, params)
            else:
                out_BSD, _ = layer(x_BSD, params)
            return jnp.mean(out_BSD ** 2)
        return jax.value_and_grad(loss)(params)

    return step, (_moe_params(mesh, layers=(LAYERS,) if scanned else ()), _batch(mesh))


@pytest.mark.parametrize("scanned", [False, True], ids=["plain", "scan+remat"])
def test_a_jitted_helpers_mask_is_made_again_at_one_shards_size(mesh, scanned):
    fn, args = make_step(mesh, scanned)
    fixed = shardlint.rewrite(fn, mesh, args=args)     # verified on random inputs
    assert fixed.changed is True
    moe = routed_moe.__code__.co_filename.split("/shardlint/", 1)[1]
    assert not [f for f in shardlint.analyze(fixed, *args).findings if f.source and f.source.file.endswith(moe)]


def test_shardlint_failing_in_its_shape_pass_names_the_op_and_line(mesh, monkeypatch):
    from shardlint.rewrites.trace import _origins

    def sources(self, var, shape, shapes):
        raise KeyError(var)

    sources.__code__ = sources.__code__.replace(co_filename=_origins.__file__)   # raised in shardlint
    monkeypatch.setattr(_origins.Graph, "_sources", sources)
    fn, args = make_step(mesh, scanned=False)
    with pytest.raises(shardlint.RewriteError) as raised:
        shardlint.rewrite(fn, mesh, args=args)
    message = str(raised.value)
    assert message.startswith("shardlint failed making the operands of select_n at tests/rewrites/test_own_errors.py:")
    assert "KeyError" in message and "bug of shardlint's" in message
    assert isinstance(raised.value.__cause__, KeyError)
