"""The router: token logits -> top-k experts and their combine weights.

One function serves the reference layer and every shard of the sharded layer, so the two
can only differ in which tokens they see, never in how a token is routed. Routing is
per-token (no cross-token state), which is what lets the sharded layer route a local
block with the same result as routing the whole batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._config import MoeConfig
from ._ring import IN_PLACE, WeightSlices, matmul


def route(x_TD: jax.Array, w_gate_DE: jax.Array, cfg: MoeConfig, *,
          slices: WeightSlices = IN_PLACE) -> tuple[jax.Array, jax.Array]:
    """Returns (weights_TK float32, experts_TK int32) for tokens x_TD.

    K experts per token are distinct. Semantics (MaxText RoutedMoE):
      softmax_before_topk=False: top-k of the logits, softmax over those K;
      softmax_before_topk=True: softmax over all experts, top-k of the probabilities,
        optionally renormalised (norm_topk_prob);
      then the weights are scaled by routed_scaling_factor when it is set.
    `slices`: the kernel holds this device's slice of D; it is small, so it is gathered
    whole whatever schedule `slices` gives the expert matrices.
    """
    with jax.named_scope("moe/route"):
        logits_TE = slices.whole.contract(matmul, x_TD.astype(jnp.float32), w_gate_DE)
        if cfg.softmax_before_topk:
            probs_TE = jax.nn.softmax(logits_TE, axis=-1)
            weights_TK, experts_TK = top_k(probs_TE, cfg.top_k)
            if cfg.norm_topk_prob:
                weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
        else:
            top_logits_TK, experts_TK = top_k(logits_TE, cfg.top_k)
            weights_TK = jax.nn.softmax(top_logits_TK, axis=-1)
        if cfg.routed_scaling_factor is not None:
            weights_TK = weights_TK * cfg.routed_scaling_factor
        return weights_TK, experts_TK.astype(jnp.int32)



def top_k(scores_TE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k`, its gradient written as a sum of K selections: d scores[t, e] =
    g[t, j] where experts[t, j] == e. top_k's own transpose is a scatter-add into [T, E]
    (0.44 ms of RoutedMoE's training step on a v5e, `benchmarks/tpu_moe_profile.py`); the
    selections fuse with their neighbours and hold no [T, K, E] buffer (a one-hot product
    held one on XLA:CPU: 16 MiB at T=8192, E=64, K=8). They read the K choices as rows
    (K-major): columns of [T, K] would each be laid out as a [T, 128] tile column on a
    TPU. The same gradient, bit for bit: each score is picked at most once."""
    return _top_k(scores_TE, k, scores_TE.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _top_k(scores_TE, k, num_experts):
    return _top_k_fwd(scores_TE, k, num_experts)[0]


def _top_k_fwd(scores_TE, k, num_experts):
    values_TK, experts_TK = jax.lax.top_k(scores_TE, k)
    return (values_TK, experts_TK), experts_TK


def _top_k_bwd(k, num_experts, experts_TK, cotangents):
    g_TK, _ = cotangents   # the indices' cotangent is float0
    ids_E = jnp.arange(num_experts, dtype=experts_TK.dtype)
    experts_KT, g_KT = jnp.moveaxis(experts_TK, -1, 0), jnp.moveaxis(g_TK, -1, 0)
    return (sum(jnp.where(experts_KT[j][..., None] == ids_E, g_KT[j][..., None], 0)
                for j in range(k)),)


_top_k.defvjp(_top_k_fwd, _top_k_bwd)
