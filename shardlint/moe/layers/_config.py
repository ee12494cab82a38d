"""MoeConfig: the static description of a routed Mixture-of-Experts layer (and `Sizes`, the
shape of a step around one).

A frozen dataclass so it can be a static argument, a dict key and a jit cache key. It
validates itself on construction and reports every problem at once, because a config with
two mistakes should not take two runs to fix. The field names follow MaxText's RoutedMoE
and Hugging Face's Qwen3-Next where they overlap.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from ..._errors import ShardlintError

STRATEGIES = ("sparse", "dense")


class MoeConfigError(ShardlintError, ValueError):
    """A MoeConfig whose fields cannot describe a layer (e.g. top_k > num_experts)."""


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Routed MoE hyper-parameters.

    Attributes:
      num_experts: E, routed experts.
      top_k: K, experts per token (distinct).
      emb_dim: D, model width.
      mlp_dim: F, hidden width of each SwiGLU expert.
      strategy: "sparse" (dropless: sort by expert, `jax.lax.ragged_dot`, unsort) or
        "dense" (one-hot dispatch/combine masks, expert-batched einsums, fixed capacity).
      capacity_factor: dense only. Capacity per expert per token group is
        ``min(T, ceil(T * K / E * capacity_factor))`` for a group of T tokens; tokens over
        capacity are dropped (their contribution for that expert is zero), earlier tokens
        and earlier choices first. ``<= 0`` means capacity T: nothing is ever dropped.
      softmax_before_topk: False: top-k of the logits, softmax over the K picked logits
        (MaxText's default). True: softmax over all E, then top-k of the probabilities
        (Qwen3-Next, Mixtral-in-HF).
      norm_topk_prob: renormalise the K weights to sum to one (only changes anything
        with softmax_before_topk).
      routed_scaling_factor: multiply the K weights by this, if set.
      shared_expert_dim: hidden width of the Qwen3-Next shared expert (None: mlp_dim).
      dtype: parameter and activation dtype (routing runs in float32 regardless).
    """

    num_experts: int
    top_k: int
    emb_dim: int
    mlp_dim: int
    strategy: str = "sparse"
    capacity_factor: float = 0.0
    softmax_before_topk: bool = False
    norm_topk_prob: bool = False
    routed_scaling_factor: float | None = None
    shared_expert_dim: int | None = None
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        problems = []
        for name in ("num_experts", "top_k", "emb_dim", "mlp_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a positive int")
        if (isinstance(self.top_k, int) and isinstance(self.num_experts, int)
                and self.top_k > self.num_experts):
            problems.append(
                f"top_k={self.top_k} > num_experts={self.num_experts}: a token cannot pick "
                f"more distinct experts than exist; lower top_k to at most "
                f"{self.num_experts} or raise num_experts")
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy={self.strategy!r} must be one of {STRATEGIES}")
        if self.shared_expert_dim is not None and self.shared_expert_dim < 1:
            problems.append(f"shared_expert_dim={self.shared_expert_dim!r} must be positive")
        if problems:
            raise MoeConfigError("invalid MoeConfig:\n  - " + "\n  - ".join(problems))

    @property
    def shared_dim(self) -> int:
        return self.mlp_dim if self.shared_expert_dim is None else self.shared_expert_dim

    def capacity(self, num_tokens: int) -> int:
        """Dense strategy: slots per expert for a group of `num_tokens` tokens."""
        if self.capacity_factor <= 0:
            return num_tokens
        wanted = math.ceil(num_tokens * self.top_k / self.num_experts * self.capacity_factor)
        return max(1, min(num_tokens, wanted))


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shape of a training step around one routed MoE layer: global batch, sequence,
    model and expert widths, experts and experts per token. The example steps
    (`shardlint.examples.steps`) and MaxText's layer (`tests/support/maxtext_moe.py`) are
    built from it."""

    batch: int = 4
    seq: int = 64
    emb: int = 16
    mlp: int = 32
    experts: int = 4
    top_k: int = 2
