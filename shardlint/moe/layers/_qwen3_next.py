"""Qwen3NextSparseMoeBlock: routed experts plus a sigmoid-gated shared expert.

As in Hugging Face's Qwen3NextSparseMoeBlock: y = routed(x) + sigmoid(x @ g) * shared(x),
with a dense SwiGLU shared expert of width `cfg.shared_dim` and a [D, 1] gate. The routed
part is RoutedMoE when `mesh` is None and ShardedRoutedMoE on a mesh (keyword arguments
go to it), so the same block shows the bug and the fix. The shared expert works on x_BSD
without any reshape, so XLA keeps its batch/seq sharding by itself; on a mesh it runs in
its own `shard_map` with the routed layer's token axes, so that its weights take the same
layout (`weight_axes`: D sharded, gathered on entry) and only weights are ever gathered.
Qwen3-Next routes with `softmax_before_topk=True, norm_topk_prob=True`; set those in the
config.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import Mesh

from .. import _compat
from . import _layout
from ._config import MoeConfig
from ._experts import Params, init_moe_params, normal_params, swiglu
from ._reference import RoutedMoE
from ._ring import IN_PLACE, WeightSlices, matmul
from ._sharded import ShardedRoutedMoE


@functools.partial(jax.jit, static_argnums=1)
def _init_shared(key: jax.Array, cfg: MoeConfig) -> Params:
    D, Fs = cfg.emb_dim, cfg.shared_dim
    p = normal_params(key, {"wi_0": ((D, Fs), D), "wi_1": ((D, Fs), D), "wo": ((Fs, D), Fs),
                            "gate": ((D, 1), D)}, cfg.dtype)
    return {"shared_expert": {k: p[k] for k in ("wi_0", "wi_1", "wo")},
            "shared_expert_gate": p["gate"]}


@dataclasses.dataclass(frozen=True, init=False)
class Qwen3NextSparseMoeBlock:
    """`Qwen3NextSparseMoeBlock(cfg, mesh=None, **sharded_kwargs)`.

    Parameters: {"moe": RoutedMoE params, "shared_expert": {"wi_0": [D, Fs],
    "wi_1": [D, Fs], "wo": [Fs, D]}, "shared_expert_gate": [D, 1]}. On a mesh,
    `param_specs()` / `param_shardings()` give their layout: the routed layer's, and the
    shared expert's embed dimension over the same `weight_axes`.
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
        k_moe, k_shared = jax.random.split(key)
        return {"moe": init_moe_params(k_moe, self.cfg), **_init_shared(k_shared, self.cfg)}

    def param_specs(self) -> dict[str, Any]:
        """PartitionSpecs of `init`'s params on the block's mesh."""
        if self.mesh is None:
            raise TypeError("Qwen3NextSparseMoeBlock without a mesh has no layout: build "
                            "it with mesh=... to get its param_specs()")
        w = self.routed.weight_axes
        return {"moe": self.routed.param_specs(),
                **jax.tree.map(lambda dim: _layout.spec(2, dim, w),
                               _layout.SHARED_EMBED_DIMS)}

    def param_shardings(self) -> dict[str, Any]:
        """`param_specs()` as NamedShardings on the block's mesh."""
        return _layout.to_shardings(self.mesh, self.param_specs())

    def __call__(self, params: Params, x_BSD: jax.Array) -> jax.Array:
        routed_BSD = self.routed(params["moe"], x_BSD)
        shared = {"shared_expert": params["shared_expert"],
                  "shared_expert_gate": params["shared_expert_gate"]}
        if self.mesh is None:
            return routed_BSD + _shared_expert(shared, x_BSD)
        x_spec = self.routed.token_axes(x_BSD).x_spec
        specs = {k: v for k, v in self.param_specs().items() if k in shared}
        per_shard = _compat.shard_map(
            functools.partial(_shared_expert, slices=self.routed.weight_slices),
            mesh=self.mesh, in_specs=(specs, x_spec), out_specs=x_spec)
        return routed_BSD + per_shard(_layout.placed(shared, self.mesh, specs), x_BSD)


def _shared_expert(shared: Params, x_BSD: jax.Array, *,
                   slices: WeightSlices = IN_PLACE) -> jax.Array:
    """sigmoid(x @ gate) * SwiGLU(x): the shared expert's share of the output. `slices`:
    the weights hold this device's slice of D; one dense matrix each, they are gathered
    whole whatever schedule `slices` gives the routed experts."""
    slices = slices.whole
    with jax.named_scope("moe/shared_expert"):
        w = shared["shared_expert"]
        shared_BSD = swiglu(x_BSD, w["wi_0"], w["wi_1"], w["wo"], slices=slices)
        gate_BS1 = jax.nn.sigmoid(slices.contract(matmul, x_BSD, shared["shared_expert_gate"]))
        return gate_BS1 * shared_BSD
