"""Where the MoE weights live on the mesh, and how a shard gets them whole.

The memory-lean layout shards the weights' embed dimension D over the mesh axes that
shard the tokens (fsdp, data, context), on top of the expert dimension over `expert_axis`
and the hidden dimension over `tensor_axis`. Inside `shard_map` each layer gets its own
weights whole over those axes for each product, by the schedule of `_ring`: gathered in
pieces, and gathered again for the backward pass, or passed round the weight axes (the
expert matrices only). The gradients leave the layer sharded like the weights. No
activation moves for it: the tokens stay where they are and the weights come to them
(FSDP / ZeRO-3, as MaxText shards its experts' embed dimension over fsdp and context).

Every weight axis must also shard the tokens of the call: a shard that holds tokens
replicated over a weight axis would compute the same partial gradient as its neighbours
and the reduce-scatter would add them up (JAX's type check refuses it first). `()` keeps
the weights whole on every token shard (the layout before this option existed).

One table (`EMBED_DIMS`) says where D is in each parameter; the specs, the gathers and
the checks all read it, so a new parameter is one entry.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# The embed dimension D of each parameter, as a pytree of the params' structure
# (RoutedMoE's params, and the Qwen3-Next shared expert's, which has no expert dimension).
EMBED_DIMS: dict[str, int] = {"gate": 0, "wi_0": 1, "wi_1": 1, "wo": 2}
SHARED_EMBED_DIMS: dict[str, Any] = {"shared_expert": {"wi_0": 0, "wi_1": 0, "wo": 1},
                                     "shared_expert_gate": 0}


def entry(axes: Sequence[str]) -> tuple[str, ...] | None:
    """A PartitionSpec entry for these mesh axes (None when there are none)."""
    return tuple(axes) if axes else None


def default_weight_axes(mesh: Mesh, token_axes: Sequence[str] | None,
                        expert_axis: str | None, tensor_axis: str | None) -> tuple[str, ...]:
    """The memory-lean default: the token axes the layer was given, else every mesh axis
    of size > 1 that shards neither the experts nor the hidden dimension."""
    taken = {expert_axis, tensor_axis}
    names = mesh.axis_names if token_axes is None else token_axes
    return tuple(a for a in names if a not in taken and mesh.shape.get(a, 1) > 1)


def weight_axes_problems(mesh: Mesh, weight_axes: tuple[str, ...], emb_dim: int,
                         expert_axis: str | None, tensor_axis: str | None) -> list[str]:
    problems = []
    unknown = [a for a in weight_axes if a not in mesh.shape]
    if unknown:
        problems.append(f"weight_axes {unknown} are not mesh axes {dict(mesh.shape)}")
    taken = [a for a in weight_axes if a in (expert_axis, tensor_axis)]
    if taken:
        problems.append(f"weight_axes {taken} already shard the experts or the hidden "
                        f"dimension (expert_axis={expert_axis!r}, tensor_axis="
                        f"{tensor_axis!r}); the embed dimension takes other axes")
    if len(set(weight_axes)) != len(weight_axes):
        problems.append(f"weight_axes {weight_axes} name an axis twice")
    if not unknown:
        degree = math.prod(mesh.shape[a] for a in weight_axes)
        if emb_dim % degree:
            problems.append(
                f"emb_dim={emb_dim} is not divisible by {degree}, the size of weight_axes "
                f"{weight_axes} (sizes {tuple(mesh.shape[a] for a in weight_axes)}); "
                f"shard the weights over fewer axes (weight_axes=...) or () to keep them whole")
    return problems


def spec(ndim: int, embed_dim: int, weight_axes: Sequence[str],
         others: Mapping[int, str | None] | None = None) -> P:
    """PartitionSpec of one weight: D over `weight_axes`, `others` {dim: axis} besides."""
    entries: list[Any] = [(others or {}).get(d) for d in range(ndim)]
    entries[embed_dim] = entry(weight_axes)
    return P(*entries)


def to_shardings(mesh: Mesh, specs: Any) -> Any:
    """A pytree of PartitionSpecs as the NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, P))


def placed(params: Any, mesh: Mesh, specs: Any) -> Any:
    """The params in the layer's layout where JAX does not move them by itself.

    On Auto axes XLA reshards a shard_map's inputs to its `in_specs`; on Explicit axes
    shard_map refuses a mismatch instead, so the weights are `jax.reshard`ed there (a
    no-op for weights already in the layout, a local slice for replicated ones).
    """
    if AxisType.Explicit not in tuple(getattr(mesh, "axis_types", ())):
        return params
    return jax.reshard(params, to_shardings(mesh, specs))
