"""A small decoder-only MoE training step, sharded as a real training setup would be.

The tiny steps in `steps.py` show a lossy flatten on its own. In a real model that
flatten sits among collectives the user *wants*: FSDP weight gathers, the K/V all-gather
of context-parallel attention, gradient reductions, the vocabulary reduction of tied
logits. This step is such a model at toy size, so the analyzer and the rewrite are
exercised where the one bad all-gather has to be told apart from the good ones:

    embedding -> N x [RMSNorm, causal attention (context parallel, all-gather K/V),
                      RMSNorm, Qwen3NextSparseMoeBlock] -> RMSNorm -> tied logits
    -> cross-entropy against integer targets, under `jax.value_and_grad`.

The MoE block is built with `mesh=None`, i.e. around the reference `RoutedMoE`, which
flattens (batch, seq) over the global array: under context parallelism that is where XLA
loses the sequence sharding, and `shardlint.rewrite` swaps in `ShardedRoutedMoE`.

Shardings follow MaxText's logical-axis rules, restricted to the axes the mesh has
(`spec` drops the others, so any subset of data, fsdp, context, expert, tensor works):
activations' batch over (data, fsdp) and sequence over context; weights' model dim over
fsdp; heads, MLP hidden and vocabulary over tensor; the experts' E dim over expert.
Attention gathers K and V over the context axis with a sharding constraint (the
all-gather-K/V strategy) while queries stay sharded on the sequence; the step is written
in the global view, so `arange(S)` are global positions and the causal mask is right on
every query shard without any per-shard offset.

`make_step(mesh, cfg)` is a CLI target:
`shardlint analyze shardlint.examples.decoder:make_step --mesh data=2,context=4`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint import moe

Params = dict[str, Any]

# Logical axis -> mesh axes (MaxText-style rules). Mesh axes a mesh lacks are skipped.
BATCH = ("data", "fsdp")
SEQ = ("context",)
EMBED = ("fsdp",)       # the model dim of weights (FSDP)
HEADS = ("tensor",)
MLP = ("tensor",)
VOCAB = ("tensor",)
EXPERT = ("expert",)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the decoder. Defaults are small enough to compile in seconds on 2 cores.

    `batch` must divide over the mesh's (data, fsdp) axes and `seq` over context; `heads`,
    `mlp` and `vocab` over tensor; `experts` over expert; `emb` over fsdp.
    """

    vocab: int = 128
    emb: int = 32
    heads: int = 2
    head_dim: int = 16
    layers: int = 2
    experts: int = 4
    top_k: int = 2
    mlp: int = 32
    seq: int = 64
    batch: int = 8
    eps: float = 1e-6

    @property
    def moe_config(self) -> moe.MoeConfig:
        """Qwen3-Next routing: softmax over all experts, top-k, renormalised."""
        return moe.MoeConfig(num_experts=self.experts, top_k=self.top_k, emb_dim=self.emb,
                             mlp_dim=self.mlp, softmax_before_topk=True, norm_topk_prob=True)


def spec(mesh: Mesh, *dims: tuple[str, ...] | str | None) -> P:
    """A PartitionSpec with one entry per dimension, keeping only the mesh's own axes.

    Each entry is None, a mesh-axis name or a tuple of names (a logical axis); names the
    mesh does not have are dropped, so `spec(mesh, BATCH, SEQ)` on a data x context mesh
    is P("data", "context") and on a context-only mesh P(None, "context").
    """
    entries = []
    for dim in dims:
        wanted = (dim,) if isinstance(dim, str) else tuple(dim or ())
        names = tuple(n for n in wanted if n in mesh.axis_names)
        entries.append(None if not names else names[0] if len(names) == 1 else names)
    return P(*entries)


def param_specs(mesh: Mesh, cfg: DecoderConfig = DecoderConfig()) -> Params:
    """The PartitionSpec of every parameter, in the pytree `init_params` returns."""
    s = functools.partial(spec, mesh)
    layer = lambda: {
        "attn_norm": s(None),
        "wq": s(EMBED, HEADS, None), "wk": s(EMBED, HEADS, None),
        "wv": s(EMBED, HEADS, None), "wo": s(HEADS, None, EMBED),
        "mlp_norm": s(None),
        "moe": {
            "moe": {"gate": s(EMBED, None), "wi_0": s(EXPERT, EMBED, MLP),
                    "wi_1": s(EXPERT, EMBED, MLP), "wo": s(EXPERT, MLP, EMBED)},
            "shared_expert": {"wi_0": s(EMBED, MLP), "wi_1": s(EMBED, MLP),
                              "wo": s(MLP, EMBED)},
            "shared_expert_gate": s(EMBED, None),
        },
    }
    return {"embed": s(VOCAB, EMBED), "layers": [layer() for _ in range(cfg.layers)],
            "final_norm": s(None)}


@functools.partial(jax.jit, static_argnums=1)
def init_params(key: jax.Array, cfg: DecoderConfig = DecoderConfig()) -> Params:
    """Real float32 parameters (unsharded; `jax.device_put` them with `param_specs`).

    Normal, scaled by 1/sqrt(fan-in); norms start at one. The MoE block's own `init`
    draws its parameters, so they have exactly the layout the block reads.
    """
    D, H, K = cfg.emb, cfg.heads, cfg.head_dim
    block = moe.Qwen3NextSparseMoeBlock(cfg.moe_config)
    k_embed, *k_layers = jax.random.split(key, cfg.layers + 1)
    normal = lambda k, shape, fan_in: jax.random.normal(k, shape, jnp.float32) * fan_in ** -0.5
    layers = []
    for k_layer in k_layers:
        kq, kk, kv, ko, k_moe = jax.random.split(k_layer, 5)
        layers.append({
            "attn_norm": jnp.ones((D,), jnp.float32),
            "wq": normal(kq, (D, H, K), D), "wk": normal(kk, (D, H, K), D),
            "wv": normal(kv, (D, H, K), D), "wo": normal(ko, (H, K, D), H * K),
            "mlp_norm": jnp.ones((D,), jnp.float32),
            "moe": block.init(k_moe),
        })
    return {"embed": normal(k_embed, (cfg.vocab, D), D), "layers": layers,
            "final_norm": jnp.ones((D,), jnp.float32)}


def rms_norm(x_BSD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    with jax.named_scope("rms_norm"):
        x32_BSD = x_BSD.astype(jnp.float32)
        inv_BS1 = jax.lax.rsqrt(jnp.mean(jnp.square(x32_BSD), axis=-1, keepdims=True) + eps)
        return (x32_BSD * inv_BS1).astype(x_BSD.dtype) * scale_D


def attention(mesh: Mesh, p: Params, x_BSD: jax.Array) -> jax.Array:
    """Causal multi-head attention, context parallel with all-gathered K and V.

    Queries keep the activations' sharding (batch over data/fsdp, sequence over context);
    K and V are constrained to an unsharded sequence, which is the all-gather over the
    context axis this strategy asks for. Scores are [B, H, S, T] with S the (sharded)
    query positions and T all key positions. The caller opens the "attention" scope
    around the pre-norm too, because XLA may gather the normed input once instead of
    K and V apiece and name the gather after the norm.
    """
    S, K = x_BSD.shape[1], p["wq"].shape[-1]
    q_BSHK = jnp.einsum("bsd,dhk->bshk", x_BSD, p["wq"])
    k_BSHK = jnp.einsum("bsd,dhk->bshk", x_BSD, p["wk"])
    v_BSHK = jnp.einsum("bsd,dhk->bshk", x_BSD, p["wv"])
    q_BSHK = jax.lax.with_sharding_constraint(
        q_BSHK, NamedSharding(mesh, spec(mesh, BATCH, SEQ, HEADS, None)))
    with jax.named_scope("gather_kv"):
        gathered = NamedSharding(mesh, spec(mesh, BATCH, None, HEADS, None))
        k_BTHK = jax.lax.with_sharding_constraint(k_BSHK, gathered)
        v_BTHK = jax.lax.with_sharding_constraint(v_BSHK, gathered)
    scores_BHST = jnp.einsum("bshk,bthk->bhst", q_BSHK, k_BTHK).astype(jnp.float32)
    scores_BHST = scores_BHST * K ** -0.5
    q_pos_S, k_pos_T = jnp.arange(S), jnp.arange(S)  # global positions
    causal_ST = q_pos_S[:, None] >= k_pos_T[None, :]
    scores_BHST = jnp.where(causal_ST, scores_BHST, jnp.finfo(jnp.float32).min)
    probs_BHST = jax.nn.softmax(scores_BHST, axis=-1).astype(x_BSD.dtype)
    out_BSHK = jnp.einsum("bhst,bthk->bshk", probs_BHST, v_BTHK)
    return jnp.einsum("bshk,hkd->bsd", out_BSHK, p["wo"])


def cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    """Mean token cross-entropy; one-hot rather than a gather, so a vocabulary sharded
    over tensor stays sharded until the reductions."""
    with jax.named_scope("cross_entropy"):
        logits_BSV = logits_BSV.astype(jnp.float32)
        logz_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
        onehot_BSV = jax.nn.one_hot(targets_BS, logits_BSV.shape[-1], dtype=jnp.float32)
        target_BS = jnp.sum(logits_BSV * onehot_BSV, axis=-1)
        return jnp.mean(logz_BS - target_BS)


def forward_loss(mesh: Mesh, cfg: DecoderConfig, params: Params, tokens_BS: jax.Array,
                 targets_BS: jax.Array) -> jax.Array:
    """The scalar training loss of one batch."""
    block = moe.Qwen3NextSparseMoeBlock(cfg.moe_config)  # mesh=None: the reference RoutedMoE
    residual = NamedSharding(mesh, spec(mesh, BATCH, SEQ, None))
    with jax.named_scope("embed"):
        # A one-hot matmul rather than a gather: XLA partitions a gather from a table
        # sharded over the vocabulary only by replicating it ("involuntary full
        # rematerialization"), a matmul contracts the sharded vocabulary and all-reduces.
        onehot_BSV = jax.nn.one_hot(tokens_BS, cfg.vocab, dtype=params["embed"].dtype)
        x_BSD = jnp.einsum("bsv,vd->bsd", onehot_BSV, params["embed"])
        x_BSD = jax.lax.with_sharding_constraint(x_BSD, residual)
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            with jax.named_scope("attention"):
                x_BSD = x_BSD + attention(mesh, p, rms_norm(x_BSD, p["attn_norm"], cfg.eps))
            x_BSD = x_BSD + block(p["moe"], rms_norm(x_BSD, p["mlp_norm"], cfg.eps))
            x_BSD = jax.lax.with_sharding_constraint(x_BSD, residual)
    x_BSD = rms_norm(x_BSD, params["final_norm"], cfg.eps)
    with jax.named_scope("logits"):
        logits_BSV = jnp.einsum("bsd,vd->bsv", x_BSD, params["embed"])  # tied embedding
    return cross_entropy(logits_BSV, targets_BS)


def make_step(mesh: Mesh, cfg: DecoderConfig = DecoderConfig(), **sizes: int):
    """`(step_fn, (params, tokens, targets))`: `step_fn` returns `(loss, grads)`; the
    arguments are `jax.ShapeDtypeStruct`s carrying NamedShardings on `mesh`. `sizes` change
    fields of `cfg` (`--set seq=512`, `--grid layers=2,4`)."""
    fields = {f.name for f in dataclasses.fields(DecoderConfig)}
    unknown = sorted(set(sizes) - fields)
    if unknown:
        raise ValueError(f"DecoderConfig has no field {unknown[0]!r} (it has {', '.join(sorted(fields))})")
    cfg = dataclasses.replace(cfg, **sizes)
    problems = _divisibility_problems(mesh, cfg)
    if problems:
        raise ValueError(f"DecoderConfig does not fit mesh {dict(mesh.shape)}:\n  - "
                         + "\n  - ".join(problems))

    def step(params: Params, tokens_BS: jax.Array, targets_BS: jax.Array):
        loss = functools.partial(forward_loss, mesh, cfg)
        return jax.value_and_grad(loss)(params, tokens_BS, targets_BS)

    shapes = jax.eval_shape(init_params, jax.random.key(0), cfg)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        shapes, param_specs(mesh, cfg))
    token_sharding = NamedSharding(mesh, spec(mesh, BATCH, SEQ))
    tokens, targets = (jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32,
                                            sharding=token_sharding) for _ in range(2))
    return step, (params, tokens, targets)


def _divisibility_problems(mesh: Mesh, cfg: DecoderConfig) -> list[str]:
    """Every size that does not divide over the mesh axes that shard it."""
    sizes = {"batch": (cfg.batch, BATCH), "seq": (cfg.seq, SEQ), "emb": (cfg.emb, EMBED),
             "heads": (cfg.heads, HEADS), "mlp": (cfg.mlp, MLP), "vocab": (cfg.vocab, VOCAB),
             "experts": (cfg.experts, EXPERT)}
    problems = []
    for name, (size, logical) in sizes.items():
        axes = [a for a in logical if a in mesh.axis_names]
        degree = 1
        for a in axes:
            degree *= mesh.shape[a]
        if size % degree:
            problems.append(f"{name}={size} does not divide over {'x'.join(axes)} "
                            f"({degree} shards); choose a multiple of {degree}")
    return problems
