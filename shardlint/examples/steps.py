"""Tiny training steps that show (or avoid) lost sharding, written as users write them.

Each `make_*` takes a mesh (axes `data` and `context` at least) and `Sizes` and returns
`(step_fn, args)` with `jax.ShapeDtypeStruct` arguments carrying NamedShardings, so any
of them is a CLI target: `shardlint analyze shardlint.examples.steps:make_step --mesh
data=2,context=4`. Each is `value_and_grad` of a mean square through one model:

  make_step              a routed MoE flattened outside shard_map: the bug
  make_qwen3_style_step  the same plus a sigmoid-gated shared expert (Qwen3-Next)
  make_capacity_step     dense dispatch whose capacity couples all tokens
  make_per_shard_step    the routed MoE flattened per shard in shard_map: the fix
  make_dense_step        a flatten before a dense MLP (no grouped matmul)
  make_attention_step    attention that gathers K/V over context on purpose
  make_scanned_step      routed-MoE layers under lax.scan and jax.checkpoint

The layers are plain JAX, independent of `shardlint.moe`'s, so the analyzer is tested
on code shardlint did not write; only their `Sizes` record comes from `shardlint.moe`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..moe import Sizes


def _route(tokens_TD, w_gate_DE, top_k):
    logits_TE = tokens_TD @ w_gate_DE
    weights_TK, experts_TK = jax.lax.top_k(logits_TE, top_k)
    return jax.nn.softmax(weights_TK, axis=-1), experts_TK


def _experts(tokens_TD, weights_TK, experts_TK, w_in_EDF, w_out_EFD):
    """Dropless routed experts: sort by expert, grouped matmuls, unsort, combine."""
    num_tokens, emb = tokens_TD.shape
    top_k = experts_TK.shape[1]
    flat_expert = experts_TK.reshape(-1)
    order = jnp.argsort(flat_expert)
    sorted_TkD = jnp.repeat(tokens_TD, top_k, axis=0)[order]
    group_sizes = jnp.bincount(flat_expert, length=w_in_EDF.shape[0]).astype(jnp.int32)
    hidden = jax.nn.silu(jax.lax.ragged_dot(sorted_TkD, w_in_EDF, group_sizes))
    out_sorted = jax.lax.ragged_dot(hidden, w_out_EFD, group_sizes)
    out_TkD = jnp.zeros_like(out_sorted).at[order].set(out_sorted)
    return (out_TkD.reshape(num_tokens, top_k, emb) * weights_TK[..., None]).sum(1)


def routed_moe(params, x_BSD, top_k):
    """The layer that loses context sharding: flattens (batch, seq) over the whole array."""
    b, s, d = x_BSD.shape
    tokens_TD = x_BSD.reshape(b * s, d)
    weights_TK, experts_TK = _route(tokens_TD, params["w_gate"], top_k)
    out_TD = _experts(tokens_TD, weights_TK, experts_TK, params["w_in"], params["w_out"])
    return out_TD.reshape(b, s, d)


def per_shard_moe(mesh, top_k):
    """The same layer flattened per shard inside shard_map: nothing is lost."""

    def local(params, x_BSD):
        return routed_moe(params, x_BSD, top_k)

    spec = P("data", "context", None)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), spec), out_specs=spec)


def dense_mlp(params, x_BSD):
    """A flatten before a plain dense MLP: loses context, but feeds no grouped matmul."""
    b, s, d = x_BSD.shape
    tokens_TD = x_BSD.reshape(b * s, d)
    hidden_TF = jax.nn.silu(tokens_TD @ params["w_in"])
    return (hidden_TF @ params["w_out"]).reshape(b, s, d)


def attention_kv_gather(mesh, params, x_BSD, heads=2):
    """Split heads (keeps seq whole) and gather K/V over context on purpose."""
    b, s, d = x_BSD.shape
    q = (x_BSD @ params["wq"]).reshape(b, s, heads, d // heads)
    k = (x_BSD @ params["wk"]).reshape(b, s, heads, d // heads)
    v = (x_BSD @ params["wv"]).reshape(b, s, heads, d // heads)
    gathered = NamedSharding(mesh, P("data", None, None, None))
    k = jax.lax.with_sharding_constraint(k, gathered)
    v = jax.lax.with_sharding_constraint(v, gathered)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)


def qwen3_style_block(params, x_BSD, top_k):
    """Routed experts plus a sigmoid-gated shared SwiGLU expert, as in Qwen3-Next."""
    routed_BSD = routed_moe(params, x_BSD, top_k)
    shared_BSD = (jax.nn.silu(x_BSD @ params["shared_wi_0"]) * (x_BSD @ params["shared_wi_1"])) @ params["shared_wo"]
    gate_BS1 = jax.nn.sigmoid(x_BSD @ params["shared_gate"])
    return routed_BSD + gate_BS1 * shared_BSD


def capacity_moe(params, x_BSD, top_k, capacity_factor=1.0):
    """Dense dispatch with a capacity computed over all tokens: tokens over it are dropped."""
    b, s, d = x_BSD.shape
    tokens_TD = x_BSD.reshape(b * s, d)
    weights_TK, experts_TK = _route(tokens_TD, params["w_gate"], top_k)
    num_experts = params["w_in"].shape[0]
    capacity = max(1, int(b * s * top_k / num_experts * capacity_factor))
    onehot_TKE = jax.nn.one_hot(experts_TK, num_experts, dtype=jnp.int32)
    position_TKE = jnp.cumsum(onehot_TKE.reshape(-1, num_experts), axis=0).reshape(onehot_TKE.shape) - 1
    keep_TKE = (position_TKE < capacity) & (onehot_TKE > 0)
    slot_TKEC = jax.nn.one_hot(jnp.where(keep_TKE, position_TKE, -1), capacity, dtype=x_BSD.dtype)
    dispatch_TEC = slot_TKEC.sum(1)
    combine_TEC = (slot_TKEC * weights_TK[:, :, None, None]).sum(1)
    expert_in_ECD = jnp.einsum("tec,td->ecd", dispatch_TEC, tokens_TD)
    hidden_ECF = jax.nn.silu(jnp.einsum("ecd,edf->ecf", expert_in_ECD, params["w_in"]))
    expert_out_ECD = jnp.einsum("ecf,efd->ecd", hidden_ECF, params["w_out"])
    return jnp.einsum("tec,ecd->td", combine_TEC, expert_out_ECD).reshape(b, s, d)


def _loss_step(layer):
    def step(params, x_BSD):
        def loss(params):
            return jnp.mean(layer(params, x_BSD) ** 2)

        return jax.value_and_grad(loss)(params)

    return step


def _args(mesh, sizes: Sizes, shapes: dict[str, tuple[int, ...]]):
    replicated = NamedSharding(mesh, P())
    params = {k: jax.ShapeDtypeStruct(v, jnp.float32, sharding=replicated) for k, v in shapes.items()}
    x = jax.ShapeDtypeStruct((sizes.batch, sizes.seq, sizes.emb), jnp.float32,
                             sharding=NamedSharding(mesh, P("data", "context", None)))
    return params, x


def _moe_shapes(z: Sizes):
    return {"w_gate": (z.emb, z.experts), "w_in": (z.experts, z.emb, z.mlp),
            "w_out": (z.experts, z.mlp, z.emb)}


def make_step(mesh, sizes: Sizes = Sizes()):
    """Routed MoE flattened outside shard_map, value_and_grad: the bug."""
    step = _loss_step(lambda p, x: routed_moe(p, x, sizes.top_k))
    return step, _args(mesh, sizes, _moe_shapes(sizes))


def make_qwen3_style_step(mesh, sizes: Sizes = Sizes()):
    """Routed MoE plus gated shared expert, flattened outside shard_map."""
    step = _loss_step(lambda p, x: qwen3_style_block(p, x, sizes.top_k))
    d, f = sizes.emb, sizes.mlp
    shapes = {**_moe_shapes(sizes), "shared_wi_0": (d, f), "shared_wi_1": (d, f),
              "shared_wo": (f, d), "shared_gate": (d, 1)}
    return step, _args(mesh, sizes, shapes)


def make_capacity_step(mesh, sizes: Sizes = Sizes()):
    """Dense-dispatch MoE whose capacity couples all tokens (not safe to compute per shard)."""
    step = _loss_step(lambda p, x: capacity_moe(p, x, sizes.top_k))
    return step, _args(mesh, sizes, _moe_shapes(sizes))


def make_per_shard_step(mesh, sizes: Sizes = Sizes()):
    """The same MoE flattened per shard inside shard_map: the fix."""
    step = _loss_step(per_shard_moe(mesh, sizes.top_k))
    return step, _args(mesh, sizes, _moe_shapes(sizes))


def make_dense_step(mesh, sizes: Sizes = Sizes()):
    step = _loss_step(dense_mlp)
    return step, _args(mesh, sizes, {"w_in": (sizes.emb, sizes.mlp), "w_out": (sizes.mlp, sizes.emb)})


def make_attention_step(mesh, sizes: Sizes = Sizes()):
    step = _loss_step(lambda p, x: attention_kv_gather(mesh, p, x))
    d = sizes.emb
    return step, _args(mesh, sizes, {"wq": (d, d), "wk": (d, d), "wv": (d, d)})


def make_scanned_step(mesh, sizes: Sizes = Sizes(), layers: int = 4, remat: bool = True):
    """`lax.scan` over `layers` stacked routed-MoE layers (MaxText's `scan_layers`), each
    a residual block under `jax.checkpoint` unless `remat=False`: the bug, once per layer."""

    def layer(x_BSD, params):
        return x_BSD + routed_moe(params, x_BSD, sizes.top_k), None

    body = jax.checkpoint(layer) if remat else layer

    def model(params, x_BSD):
        return jax.lax.scan(body, x_BSD, params)[0]

    shapes = {k: (layers, *v) for k, v in _moe_shapes(sizes).items()}
    return _loss_step(model), _args(mesh, sizes, shapes)
