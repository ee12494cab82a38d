"""Qwen3NextSparseMoeBlock: routed experts plus a sigmoid-gated shared expert.

As in Hugging Face's Qwen3NextSparseMoeBlock: y = routed(x) + sigmoid(x @ g) * shared(x),
with a dense SwiGLU shared expert of width `cfg.shared_dim` and a [D, 1] gate. The routed
part is RoutedMoE when `mesh` is None and ShardedRoutedMoE on a mesh (keyword arguments
go to it), so the same block shows the bug and the fix. The shared expert works on x_BSD
without any reshape, so XLA keeps its batch/seq sharding by itself. Qwen3-Next routes with
`softmax_before_topk=True, norm_topk_prob=True`; set those in the config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ._config import MoeConfig
from ._experts import Params, swiglu
from ._reference import RoutedMoE
from ._sharded import ShardedRoutedMoE


@dataclasses.dataclass(frozen=True, init=False)
class Qwen3NextSparseMoeBlock:
    """`Qwen3NextSparseMoeBlock(cfg, mesh=None, **sharded_kwargs)`.

    Parameters: {"moe": RoutedMoE params, "shared_expert": {"wi_0": [D, Fs],
    "wi_1": [D, Fs], "wo": [Fs, D]}, "shared_expert_gate": [D, 1]}.
    """

    cfg: MoeConfig
    mesh: Mesh | None
    routed: Any

    def __init__(self, cfg: MoeConfig, mesh: Mesh | None = None, **sharded_kwargs: Any):
        if mesh is None and sharded_kwargs:
            raise TypeError(f"{sorted(sharded_kwargs)} only apply with a mesh")
        routed = RoutedMoE(cfg) if mesh is None else ShardedRoutedMoE(cfg, mesh,
                                                                      **sharded_kwargs)
        object.__setattr__(self, "cfg", cfg)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "routed", routed)

    def init(self, key: jax.Array) -> Params:
        D, Fs, dtype = self.cfg.emb_dim, self.cfg.shared_dim, self.cfg.dtype
        k_moe, k0, k1, ko, kg = jax.random.split(key, 5)
        normal = lambda k, shape, fan_in: (jax.random.normal(k, shape, jnp.float32)
                                           * fan_in ** -0.5).astype(dtype)
        return {
            "moe": self.routed.init(k_moe),
            "shared_expert": {"wi_0": normal(k0, (D, Fs), D), "wi_1": normal(k1, (D, Fs), D),
                              "wo": normal(ko, (Fs, D), Fs)},
            "shared_expert_gate": normal(kg, (D, 1), D),
        }

    def __call__(self, params: Params, x_BSD: jax.Array) -> jax.Array:
        routed_BSD = self.routed(params["moe"], x_BSD)
        with jax.named_scope("moe/shared_expert"):
            shared = params["shared_expert"]
            shared_BSD = swiglu(x_BSD, shared["wi_0"], shared["wi_1"], shared["wo"])
            gate_BS1 = jax.nn.sigmoid(jnp.einsum("bsd,dg->bsg", x_BSD,
                                                 params["shared_expert_gate"]))
        return routed_BSD + gate_BS1 * shared_BSD
