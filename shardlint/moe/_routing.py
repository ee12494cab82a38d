"""The router: token logits -> top-k experts and their combine weights.

One function serves the reference layer and every shard of the sharded layer, so the two
can only differ in which tokens they see, never in how a token is routed. Routing is
per-token (no cross-token state), which is what lets the sharded layer route a local
block with the same result as routing the whole batch.
"""

from __future__ import annotations

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
    """`jax.lax.top_k` of each token's scores, the values' gradient flowing through a
    one-hot selection rather than top_k's own transpose: that is a scatter-add into
    [T, E], 0.44 ms of RoutedMoE's training step on a v5e (`benchmarks/tpu_moe_profile.py`),
    where the selection's transpose is an elementwise product fused with its neighbours.
    The values are the same numbers (each is one score, selected)."""
    _, experts_TK = jax.lax.top_k(jax.lax.stop_gradient(scores_TE), k)
    chosen_TKE = experts_TK[..., None] == jnp.arange(scores_TE.shape[-1], dtype=experts_TK.dtype)
    values_TK = jnp.sum(jnp.where(chosen_TKE, scores_TE[..., None, :], 0), axis=-1)
    return values_TK, experts_TK
