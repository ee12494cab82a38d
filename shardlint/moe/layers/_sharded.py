"""ShardedRoutedMoE: the routed MoE that keeps the token axis sharded.

The reference flattens (batch, seq) of the global array, which XLA can only do by
all-gathering a sharded sequence. This layer instead enters `shard_map` with the
activations' own sharding and flattens the *local* block, so every device routes, sorts
and multiplies only its own tokens, with the same functions the reference uses
(`moe_tokens`, `route`, `grouped_swiglu`, `dense_dispatch`, ...). Communication happens
only where a parallelism needs it:

  expert parallelism (`expert_axis`, weights' E dimension sharded):
    - expert axis also shards the tokens (the usual case): tokens travel to the devices of
      their experts and back with `jax.lax.all_to_all` in fixed-size buckets. Sparse: one
      bucket per destination device of T * min(K, E / ep) rows, the most one block can
      send to one device, so nothing is ever dropped. Dense: the [E, C, D] slots, split
      over experts (GShard). `ragged_all_to_all` is avoided: XLA:CPU cannot compile it.
    - expert axis does not shard the tokens: each device runs its own experts on all its
      tokens (others' rows are padding) and the outputs are psummed over the expert axis.
  tensor parallelism (`tensor_axis`, F sharded): each device produces a partial sum over
    its slice of F; psum over the tensor axis. If the tensor axis also shards the tokens
    (sequence parallelism), the block is all-gathered over it on entry and the output is
    psum-scattered back.
  weights sharded over the token axes (`weight_axes`, D sharded; see `_layout`): the
    router's kernel is all-gathered for its product and again for its gradient, which is
    reduce-scattered; so is each expert matrix, a piece at a time
    (`weight_gather="whole"`), or its slices pass round the weight axes one at a time
    (`"ring"`); see `_ring`.

Dense strategy: capacity is per *local* token group (the block a device routes, after
the sequence-parallel gather if any), so this equals the reference only when the capacity
drops nothing (`capacity_factor <= 0`, or large enough); with drops it behaves like
MaxText with one group per shard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _compat, kernels
from . import _layout
from ..._token_axes import TokenAxes, as_axes
from ._axes import MoeShardingError, check_layout, infer_token_axes, static_problems
from ._config import MoeConfig
from ._experts import (Params, batched_swiglu, combine_rows, dense_combine, dense_dispatch,
                       grouped_swiglu, init_moe_params, moe_tokens, sparse_experts)
from ._ring import IN_PLACE, WeightSlices
from ._routing import route

_PARAM_KEYS = tuple(_layout.EMBED_DIMS)
WEIGHT_GATHERS = ("whole", "ring")
# The whole gather takes each expert matrix in this many pieces per weight device, one at a
# time: a piece gathered whole and its gradient are together the size of a device's own
# slice. Measured on the TPU compiler (v5p, bf16, emb 2048, mlp 1024, 64 experts, seq 8192;
# benchmarks/moe_vs_maxtext.py), temp per chip on 2 / 4 / 8 weight devices: in one piece
# 1.07 / 0.85 GiB, in 2n pieces 0.92 / 0.46 / 0.25, the ring 1.88 / 0.85 / 0.42.
PIECES_PER_DEVICE = 2


def _axes_arg(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    return None if value is None else as_axes(value)


@dataclasses.dataclass(frozen=True)
class ShardedRoutedMoE:
    """RoutedMoE that routes, sorts and multiplies per shard inside `shard_map`.

    `ShardedRoutedMoE(cfg, mesh, *, batch_axes=None, seq_axes=None, expert_axis=None,
    tensor_axis=None, weight_axes=None)`; `layer(params, x_BSD)` with the RoutedMoE
    parameter pytree.
    Equal to RoutedMoE in outputs and gradients (the dense strategy: when its capacity
    drops nothing).

    Token axes (which mesh axes shard batch and seq of x) come from, in order:
    `batch_axes=`/`seq_axes=` if either is given; a concrete x's NamedSharding on this
    mesh; `jax.typeof(x).sharding` when the mesh axes are Explicit; otherwise (a tracer
    under jit on Auto axes carries no sharding) the rule: mesh axes in order, skipping
    size-1 axes and `tensor_axis`, go to batch while the batch size stays divisible and
    no axis went to seq yet, then to seq while the sequence stays divisible, else are
    left replicated. Under jit on Auto meshes, pass the axes explicitly.

    `expert_axis`: mesh axis sharding the weights' expert dimension (all-to-all when it
    also shards the tokens, psum otherwise). `tensor_axis`: mesh axis sharding F
    (psum of the output, or all-gather + psum-scatter when it also shards tokens).

    `weight_axes`: mesh axes sharding the weights' embed dimension D, gathered inside the
    layer (see `_layout`); every one must shard the tokens of a call. None (default) is
    the memory-lean layout: `batch_axes + seq_axes` when given, else every mesh axis of
    size > 1 other than `expert_axis` and `tensor_axis`. `()`: weights whole on every
    token shard (what `shardlint.rewrite`'s swap route uses: the caller's parameters come in
    the layout chosen for RoutedMoE).
    `param_specs()` gives the PartitionSpecs of that layout, `param_shardings()` the same
    as NamedShardings on the mesh (put `init`'s params there).

    `weight_gather`: how a shard gets the expert matrices whole along D. `"whole"`
    (default): all-gathered for the products in 2n pieces (n: the weight devices), one
    piece at a time, gathered again for the backward pass (so a stack of layers keeps no
    layer's whole matrices between the two) and each piece's gradient reduce-scattered;
    a device holds a piece and its gradient, 1/n of a matrix, besides its own slice (see
    `PIECES_PER_DEVICE`). `"ring"`: their slices pass from device to device round the
    weight axes while the grouped matmuls run on the slice in hand, and the gradients'
    slices travel back to their owners the same way (`_ring`); 2/n of a matrix and as
    much of its gradient. The whole gather measured less on the TPU compiler at 2, 4
    and 8 devices. The router's small kernel is gathered whole, in one piece, either way.
    """

    cfg: MoeConfig
    mesh: Mesh
    batch_axes: str | Sequence[str] | None = dataclasses.field(default=None, kw_only=True)
    seq_axes: str | Sequence[str] | None = dataclasses.field(default=None, kw_only=True)
    expert_axis: str | None = dataclasses.field(default=None, kw_only=True)
    tensor_axis: str | None = dataclasses.field(default=None, kw_only=True)
    weight_axes: str | Sequence[str] | None = dataclasses.field(default=None, kw_only=True)
    weight_gather: str = dataclasses.field(default="whole", kw_only=True)
    _fns: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                   compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_axes", _axes_arg(self.batch_axes))
        object.__setattr__(self, "seq_axes", _axes_arg(self.seq_axes))
        weight_axes = _axes_arg(self.weight_axes)
        if weight_axes is None:
            given = (None if self.batch_axes is None and self.seq_axes is None
                     else (self.batch_axes or ()) + (self.seq_axes or ()))
            weight_axes = _layout.default_weight_axes(self.mesh, given, self.expert_axis,
                                                      self.tensor_axis)
        object.__setattr__(self, "weight_axes", weight_axes)
        problems = static_problems(self.cfg, self.mesh, self.expert_axis, self.tensor_axis)
        problems += _layout.weight_axes_problems(self.mesh, weight_axes, self.cfg.emb_dim,
                                                 self.expert_axis, self.tensor_axis)
        if self.weight_gather not in WEIGHT_GATHERS:
            problems.append(f"weight_gather={self.weight_gather!r} is not one of "
                            f"{WEIGHT_GATHERS}")
        elif self.weight_gather == "ring" and not weight_axes:
            problems.append("weight_gather='ring' passes the weights' slices round the "
                            "weight axes, and weight_axes=() shards them over none")
        if problems:
            raise MoeShardingError(f"ShardedRoutedMoE on mesh {dict(self.mesh.shape)}:\n  - "
                                   + "\n  - ".join(problems))

    def init(self, key: jax.Array) -> Params:
        return init_moe_params(key, self.cfg)

    def param_specs(self) -> dict[str, P]:
        """The PartitionSpecs of `init`'s params in this layer's layout."""
        e, t, w = self.expert_axis, self.tensor_axis, self.weight_axes
        others = {"gate": {}, "wi_0": {0: e, 2: t}, "wi_1": {0: e, 2: t}, "wo": {0: e, 1: t}}
        return {k: _layout.spec(2 if k == "gate" else 3, dim, w, others[k])
                for k, dim in _layout.EMBED_DIMS.items()}

    def param_shardings(self) -> dict[str, NamedSharding]:
        """`param_specs()` as NamedShardings on the layer's mesh."""
        return _layout.to_shardings(self.mesh, self.param_specs())

    def token_axes(self, x_BSD: jax.Array) -> TokenAxes:
        return infer_token_axes(x_BSD, self.mesh, batch_axes=self.batch_axes,
                                seq_axes=self.seq_axes, tensor_axis=self.tensor_axis)

    def __call__(self, params: Params, x_BSD: jax.Array) -> jax.Array:
        axes = self.token_axes(x_BSD)
        check_layout(self.cfg, self.mesh, x_BSD.shape, axes, self.expert_axis,
                     self.tensor_axis, self.weight_axes)
        params = _layout.placed({k: params[k] for k in _PARAM_KEYS}, self.mesh,
                                self.param_specs())
        return self._sharded_fn(axes)(params, x_BSD)

    def _sharded_fn(self, axes: TokenAxes):
        """The jitted shard_map for these token axes and grouped-matmul kernel scope
        (`kernels.grouped_kernel`, read when it traces), built once (eager calls then hit
        the jit cache; under an outer jit it is inlined). Keyed by the scope too: jit's
        cache would otherwise keep the kernel of the first call's scope for every later
        one."""
        key = (axes.batch, axes.seq, kernels.scope())
        if key not in self._fns:
            self._fns[key] = jax.jit(_compat.shard_map(
                functools.partial(self._block, axes=axes), mesh=self.mesh,
                in_specs=(self.param_specs(), axes.x_spec), out_specs=axes.x_spec))
        return self._fns[key]

    # ---- inside shard_map: one device's block ----

    def _size(self, axis: str | None) -> int:
        return 1 if axis is None else self.mesh.shape[axis]

    def _weight_degree(self) -> int:
        return math.prod(self.mesh.shape.get(a, 1) for a in self.weight_axes)

    @property
    def weight_slices(self) -> WeightSlices:
        """How the weights' slices of D come whole for their products (the router's kernel
        and the Qwen3-Next shared expert take `.whole` of it themselves)."""
        if not self.weight_axes:
            return IN_PLACE
        devices = self._weight_degree()
        return WeightSlices(self.weight_axes, devices, ring=self.weight_gather == "ring",
                            pieces=PIECES_PER_DEVICE * devices)

    def _block(self, params: Params, x_bsD: jax.Array, axes: TokenAxes) -> jax.Array:
        b, s, D = x_bsD.shape
        with jax.named_scope("moe/flatten"):
            x_TD = x_bsD.reshape(b * s, D)
        tp_axis, ep_axis = self.tensor_axis, self.expert_axis
        seq_parallel = tp_axis is not None and tp_axis in axes.all
        if seq_parallel:
            with jax.named_scope("moe/sp_all_gather"):
                x_TD = jax.lax.all_gather(x_TD, tp_axis, axis=0, tiled=True)
        reduce_axes = []
        if self._size(ep_axis) == 1:
            y_TD = moe_tokens(x_TD, params, self.cfg, slices=self.weight_slices)
            if ep_axis is not None and ep_axis not in axes.all:
                # One device along it moves no data, but the weights sharded over it make
                # the result vary over it as shard_map types values: reduce it as below.
                reduce_axes.append(ep_axis)
        else:
            weights_TK, experts_TK = route(x_TD, params["gate"], self.cfg,
                                           slices=self.weight_slices)
            if ep_axis in axes.all:
                y_TD = self._experts_all_to_all(x_TD, weights_TK, experts_TK, params)
            else:
                y_TD = self._experts_local(x_TD, weights_TK, experts_TK, params)
                reduce_axes.append(ep_axis)
        if tp_axis is not None and not seq_parallel:
            reduce_axes.append(tp_axis)
        with jax.named_scope("moe/reduce"):
            if reduce_axes:
                y_TD = jax.lax.psum(y_TD, tuple(reduce_axes))
            if seq_parallel:
                y_TD = jax.lax.psum_scatter(y_TD, tp_axis, scatter_dimension=0, tiled=True)
        return y_TD.reshape(b, s, D)

    def _experts_all_to_all(self, x_TD, weights_TK, experts_TK, params) -> jax.Array:
        """Expert parallelism with the expert axis sharding tokens: all-to-all both ways."""
        cfg, axis = self.cfg, self.expert_axis
        ep = self._size(axis)
        E_loc = cfg.num_experts // ep
        T, K = experts_TK.shape
        D = x_TD.shape[-1]
        a2a = lambda v, split, concat: jax.lax.all_to_all(v, axis, split, concat, tiled=True)
        if cfg.strategy == "dense":
            x_ECD, combine_TEC = dense_dispatch(x_TD, weights_TK, experts_TK,
                                                cfg.num_experts, cfg.capacity(T))
            with jax.named_scope("moe/all_to_all"):
                x_LND = a2a(x_ECD, 0, 1)  # [E/ep, ep*C, D]: my experts, every source
            y_LND = batched_swiglu(x_LND, params["wi_0"], params["wi_1"], params["wo"],
                                   slices=self.weight_slices)
            with jax.named_scope("moe/all_to_all"):
                y_ECD = a2a(y_LND, 1, 0)
            return dense_combine(y_ECD, combine_TEC)
        M, cap = T * K, T * min(K, E_loc)
        with jax.named_scope("moe/dispatch"):
            expert_M = experts_TK.reshape(M)
            dev_M = expert_M // E_loc
            onehot_MP = jax.nn.one_hot(dev_M, ep, dtype=jnp.int32)
            pos_M = jnp.sum(jnp.cumsum(onehot_MP, axis=0) * onehot_MP, axis=-1) - 1
            send_PCD = jnp.zeros((ep, cap, D), x_TD.dtype).at[dev_M, pos_M].set(
                x_TD[jnp.arange(M) // K], unique_indices=True)
            ids_PC = jnp.full((ep, cap), E_loc, jnp.int32).at[dev_M, pos_M].set(
                expert_M % E_loc, unique_indices=True)
        with jax.named_scope("moe/all_to_all"):
            recv_PCD, rids_PC = a2a(send_PCD, 0, 0), a2a(ids_PC, 0, 0)
        y_ND = grouped_swiglu(recv_PCD.reshape(ep * cap, D), rids_PC.reshape(ep * cap),
                              E_loc, params["wi_0"], params["wi_1"], params["wo"],
                              slices=self.weight_slices)
        with jax.named_scope("moe/all_to_all"):
            back_PCD = a2a(y_ND.reshape(ep, cap, D), 0, 0)
        with jax.named_scope("moe/undispatch"):
            y_MD = back_PCD[dev_M, pos_M]
        return combine_rows(y_MD, weights_TK)

    def _experts_local(self, x_TD, weights_TK, experts_TK, params) -> jax.Array:
        """Expert parallelism over an axis that does not shard tokens: my experts on all
        my tokens; the caller psums over the expert axis."""
        cfg = self.cfg
        E_loc = cfg.num_experts // self._size(self.expert_axis)
        first = jax.lax.axis_index(self.expert_axis) * E_loc
        T, K = experts_TK.shape
        if cfg.strategy == "dense":
            x_ECD, combine_TEC = dense_dispatch(x_TD, weights_TK, experts_TK,
                                                cfg.num_experts, cfg.capacity(T))
            x_LCD = jax.lax.dynamic_slice_in_dim(x_ECD, first, E_loc, axis=0)
            y_LCD = batched_swiglu(x_LCD, params["wi_0"], params["wi_1"], params["wo"],
                                   slices=self.weight_slices)
            combine_TLC = jax.lax.dynamic_slice_in_dim(combine_TEC, first, E_loc, axis=1)
            return dense_combine(y_LCD, combine_TLC)
        local_TK = experts_TK - first
        local_TK = jnp.where((local_TK >= 0) & (local_TK < E_loc), local_TK, E_loc)
        # a choice of another device's expert: group E_loc, no slot, adds nothing
        return sparse_experts(x_TD, weights_TK, local_TK, params, E_loc,
                              slices=self.weight_slices)
