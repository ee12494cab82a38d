"""Which mesh axes shard the tokens, and whether a layout can run at all.

ShardedRoutedMoE runs its per-block code inside `shard_map`, and the `in_specs` of the
activations must say which mesh axes shard batch and which shard sequence. That is read,
in order of trust, from:

  1. explicit `batch_axes=` / `seq_axes=` given to the layer;
  2. a concrete array's `NamedSharding` on the layer's mesh;
  3. the abstract type (`jax.typeof(x).sharding`) when the mesh axes are Explicit;
  4. a rule, because under `jit` with Auto axes a tracer carries no sharding: walking
     the mesh axes in order, skipping size-1 axes and the tensor axis, an axis goes to
     batch while batch still divides (and no axis has gone to seq yet), otherwise to seq
     if seq divides, otherwise nowhere (the block is then replicated over it, which is
     correct but computes redundantly). The expert axis takes part, since MaxText shards
     the activations' batch over it too.

The rule can disagree with how the caller actually sharded x (XLA then reshards at the
layer's boundary); pass the axes explicitly under jit to avoid that.

`check_layout` gathers every reason a (config, mesh, shape, axes) combination cannot run
and raises once, naming sizes and the way out.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

from ..._errors import ShardlintError
from ..._token_axes import TokenAxes, as_axes, degree
from ._config import MoeConfig


class MoeShardingError(ShardlintError, ValueError):
    """The input, config and mesh do not fit together for ShardedRoutedMoE."""


def _spec_from_input(x: Any, mesh: Mesh) -> tuple[Any, str] | None:
    if not isinstance(x, jax.core.Tracer):
        sharding = getattr(x, "sharding", None)
        if (isinstance(sharding, NamedSharding)
                and dict(sharding.mesh.shape) == dict(mesh.shape)):
            return sharding.spec, "array"
        return None
    try:
        sharding = jax.typeof(x).sharding
    except (AttributeError, TypeError):
        return None
    abstract = getattr(sharding, "mesh", None)
    types = getattr(abstract, "axis_types", ())
    if (isinstance(sharding, NamedSharding) and AxisType.Explicit in tuple(types)
            and dict(abstract.shape) == dict(mesh.shape)):
        return sharding.spec, "type"
    return None


def rule_axes(mesh: Mesh, batch: int, seq: int, tensor_axis: str | None) -> TokenAxes:
    """The documented fallback (see the module docstring)."""
    batch_axes: list[str] = []
    seq_axes: list[str] = []
    for name in mesh.axis_names:
        size = mesh.shape[name]
        if size == 1 or name == tensor_axis:
            continue
        if not seq_axes and batch % (degree(mesh, batch_axes) * size) == 0:
            batch_axes.append(name)
        elif seq % (degree(mesh, seq_axes) * size) == 0:
            seq_axes.append(name)
    return TokenAxes(tuple(batch_axes), tuple(seq_axes), "rule")


def infer_token_axes(x: Any, mesh: Mesh, *, batch_axes: tuple[str, ...] | None,
                     seq_axes: tuple[str, ...] | None,
                     tensor_axis: str | None) -> TokenAxes:
    if batch_axes is not None or seq_axes is not None:
        return TokenAxes(batch_axes or (), seq_axes or (), "explicit")
    found = _spec_from_input(x, mesh)
    if found is not None:
        spec, source = found
        entries = tuple(spec) + (None,) * (2 - len(tuple(spec)))
        return TokenAxes(as_axes(entries[0]), as_axes(entries[1]), source)
    return rule_axes(mesh, x.shape[0], x.shape[1], tensor_axis)


def static_problems(cfg: MoeConfig, mesh: Mesh, expert_axis: str | None,
                    tensor_axis: str | None) -> list[str]:
    """Problems that do not depend on the input."""
    problems = []
    for role, name in (("expert_axis", expert_axis), ("tensor_axis", tensor_axis)):
        if name is not None and name not in mesh.shape:
            problems.append(f"{role}={name!r} is not a mesh axis (mesh axes: "
                            f"{dict(mesh.shape)}); pass one of them or None")
    if expert_axis is not None and expert_axis == tensor_axis:
        problems.append(f"expert_axis and tensor_axis are both {expert_axis!r}; shard "
                        "experts and the hidden dimension over different mesh axes")
    if expert_axis in mesh.shape and cfg.num_experts % mesh.shape[expert_axis]:
        ep = mesh.shape[expert_axis]
        problems.append(
            f"num_experts={cfg.num_experts} is not divisible by the expert-parallel degree "
            f"{ep} (mesh axis {expert_axis!r}); use a multiple of {ep} experts, a smaller "
            f"expert axis, or expert_axis=None")
    if tensor_axis in mesh.shape and cfg.mlp_dim % mesh.shape[tensor_axis]:
        tp = mesh.shape[tensor_axis]
        problems.append(
            f"mlp_dim={cfg.mlp_dim} is not divisible by the tensor-parallel degree {tp} "
            f"(mesh axis {tensor_axis!r}); use a multiple of {tp} or tensor_axis=None")
    return problems


def check_layout(cfg: MoeConfig, mesh: Mesh, shape: tuple[int, ...], axes: TokenAxes,
                 expert_axis: str | None, tensor_axis: str | None,
                 weight_axes: tuple[str, ...] = ()) -> None:
    """Raise MoeShardingError listing every problem, or return None."""
    problems = static_problems(cfg, mesh, expert_axis, tensor_axis)
    stray = [a for a in weight_axes if a not in axes.all]
    if stray:
        problems.append(
            f"weight_axes {stray} shard the weights but not the tokens of this call; "
            f"shard x over them too, or build the layer with weight_axes={axes.all} "
            f"(or () to keep the weights whole)")
    if len(shape) != 3 or shape[-1] != cfg.emb_dim:
        problems.append(f"x has shape {tuple(shape)}; expected [batch, seq, "
                        f"emb_dim={cfg.emb_dim}]")
    unknown = [a for a in axes.all if a not in mesh.shape]
    if unknown:
        problems.append(f"token axes {unknown} are not mesh axes {dict(mesh.shape)}")
    repeated = sorted({a for a in axes.all if axes.all.count(a) > 1})
    if repeated:
        problems.append(f"mesh axes {repeated} shard more than one dimension of x")
    if len(shape) >= 2 and not unknown:
        for dim, name, dim_axes, hint in (
                (0, "batch size", axes.batch, "use a batch divisible by it"),
                (1, "sequence length", axes.seq,
                 "pad the sequence to a multiple of it or shard it over fewer axes")):
            shards = degree(mesh, dim_axes)
            if shape[dim] % shards:
                what = "context degree" if dim == 1 else "data-parallel degree"
                problems.append(
                    f"{name} {shape[dim]} is not divisible by the {what} {shards} "
                    f"(mesh axes {dim_axes} of sizes "
                    f"{tuple(mesh.shape[a] for a in dim_axes)}); {hint}")
    if problems:
        raise MoeShardingError(
            f"ShardedRoutedMoE cannot run x{list(shape)} on mesh {dict(mesh.shape)} "
            f"(batch axes {axes.batch}, seq axes {axes.seq} from {axes.source}, "
            f"expert_axis={expert_axis!r}, tensor_axis={tensor_axis!r}, "
            f"weight_axes={weight_axes!r}):\n  - "
            + "\n  - ".join(problems))
