"""Shared set-up of the MoE benchmarks: sizes, meshes and the layers compared.

They are the reference RoutedMoE (flattens globally: loses the sequence sharding),
ShardedRoutedMoE (flattens per shard) in its default layout (the expert matrices gathered
in pieces) and with their slices passed round the weight axes (the ring), and the usual
workaround, a dense SwiGLU MLP of the same active FLOPs
(hidden = top_k * mlp_dim), which keeps the sharding but drops routing.
Each is measured as a training step: value_and_grad of a scalar loss over params and x.
The scripts set `jax_num_cpu_devices` before importing this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from shardlint import moe  # noqa: E402
from shardlint.moe.layers._experts import normal_params, swiglu  # noqa: E402

NUM_DEVICES = 8
# The activations' sharding. By default only the sequence is sharded (over "context"); the
# "data" axis keeps all 8 devices in the mesh and replicates the batch, so the tokens per
# device shrink as 1/N with the context degree N: that is the line context parallelism
# promises. With the batch over "data" too, every N holds B*S/8 tokens per device.
X_SPEC = P(None, "context", None)
X_SPEC_BATCH_OVER_DATA = P("data", "context", None)
# ShardedRoutedMoE with the expert matrices' slices passed round the weight axes, beside its
# default (the expert matrices gathered whole in pieces)
RING = "ShardedRoutedMoE (ring)"


def token_axes(x_spec: P) -> dict[str, tuple[str, ...]]:
    as_tuple = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
    return {"batch_axes": as_tuple(x_spec[0]), "seq_axes": as_tuple(x_spec[1])}


def parse_sizes(description: str, **extra: Any) -> argparse.Namespace:
    """--batch --seq --emb --mlp --experts --top-k, --batch-over-data, and `extra` ints."""
    parser = argparse.ArgumentParser(description=description)
    for name, value in dict(batch=8, seq=2048, emb=64, mlp=128, experts=8, top_k=2,
                            **extra).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--batch-over-data", action="store_true",
                        help="shard x's batch over 'data' as well (tokens/device constant)")
    args = parser.parse_args()
    args.x_spec = X_SPEC_BATCH_OVER_DATA if args.batch_over_data else X_SPEC
    return args


def config(args: argparse.Namespace) -> moe.MoeConfig:
    return moe.MoeConfig(num_experts=args.experts, top_k=args.top_k, emb_dim=args.emb,
                         mlp_dim=args.mlp)


def mesh_for(context: int) -> jax.sharding.Mesh:
    return jax.make_mesh((NUM_DEVICES // context, context), ("data", "context"),
                         axis_types=(AxisType.Auto,) * 2)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    apply: Callable[[Any, jax.Array], jax.Array]
    params: Any
    param_specs: Any


def variants(cfg: moe.MoeConfig, mesh: jax.sharding.Mesh, x_spec: P) -> list[Variant]:
    key = jax.random.key(0)
    moe_params = moe.init_moe_params(key, cfg)
    replicated = jax.tree.map(lambda _: P(), moe_params)
    sharded = moe.ShardedRoutedMoE(cfg, mesh, **token_axes(x_spec))
    # where no mesh axis shards the weights (context 1 here) there is no ring to pass them
    # round: that row is the default layer
    ring = moe.ShardedRoutedMoE(cfg, mesh, **token_axes(x_spec),
                                weight_gather="ring" if sharded.weight_axes else "whole")
    D, H = cfg.emb_dim, cfg.top_k * cfg.mlp_dim
    mlp_params = normal_params(key, {"wi_0": ((D, H), D), "wi_1": ((D, H), D),
                                     "wo": ((H, D), H)}, cfg.dtype)
    mlp = lambda p, x: swiglu(x, p["wi_0"], p["wi_1"], p["wo"])
    return [
        Variant("RoutedMoE (reference)", moe.RoutedMoE(cfg), moe_params, replicated),
        Variant("ShardedRoutedMoE", sharded, moe_params, sharded.param_specs()),
        Variant(RING, ring, moe_params, ring.param_specs()),
        Variant(f"dense MLP (hidden {H})", mlp, mlp_params,
                jax.tree.map(lambda _: P(), mlp_params)),
    ]


def train_step(v: Variant) -> Callable[..., Any]:
    loss = lambda p, x: jnp.mean(jnp.square(v.apply(p, x)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def abstract_args(v: Variant, mesh, x_spec: P, shape, dtype) -> tuple[Any, Any]:
    params = jax.tree.map(
        lambda w, s: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, s)),
        v.params, v.param_specs)
    return params, jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, x_spec))


def concrete_args(v: Variant, mesh, x_spec: P, x: jax.Array) -> tuple[Any, Any]:
    params = jax.tree.map(lambda w, s: jax.device_put(w, NamedSharding(mesh, s)),
                          v.params, v.param_specs)
    return params, jax.device_put(x, NamedSharding(mesh, x_spec))


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn(*args)` (to `jax.block_until_ready`) over `repeats` runs
    after `warmup` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def count_all_gathers(hlo_text: str) -> int:
    return sum(1 for line in hlo_text.splitlines()
               if " all-gather(" in line or " all-gather-start(" in line)
