"""Training steps the rewrite must reach, written as users write them (plain JAX).

Each `make_<name>(mesh)` returns `(step_fn, args)` with `jax.ShapeDtypeStruct` arguments
carrying NamedShardings on `mesh` (Auto axes `data` and `context`); every step's MoE
flattens `(batch, seq)` before its grouped matmul, so XLA gathers the sequence. The
scanned, pre-jitted, nnx and scatter-dispatch steps are the analyzer's
(`cause_steps.py`); these are the ones only the rewrite needs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint.examples.steps import _experts, _loss_step, _route, routed_moe

from .cause_steps import (BATCH, EMB, EXPERTS, HEADS, LAYERS, MLP, SEQ, TOP_K, _batch, _moe_params, _scatter_moe,
                           _sds)


def make_remat_loop_step(mesh):
    """A Python loop over LAYERS routed-MoE layers, each under `jax.checkpoint`."""
    layer = jax.checkpoint(lambda params, x_BSD: x_BSD + routed_moe(params, x_BSD, TOP_K))

    def model(params, x_BSD):
        for p in params:
            x_BSD = layer(p, x_BSD)
        return x_BSD

    return _loss_step(model), ([_moe_params(mesh) for _ in range(LAYERS)], _batch(mesh))


def make_scanned_scatter_step(mesh, remat: bool = False):
    """MaxText's dense path with `scan_layers`: LAYERS stacked layers of top_k and a scatter
    into [batch, seq, experts] under `lax.scan`. The scatter's (batch, seq) positions are
    loop-invariant, so JAX computes them once outside the loop and passes them in; the
    forward body's routing reaches no expert weight after it, only the combine."""

    def layer(x_BSD, params):
        return x_BSD + _scatter_moe(params, x_BSD), None

    body = jax.checkpoint(layer) if remat else layer

    def model(params, x_BSD):
        out_BSD, _ = jax.lax.scan(body, x_BSD, params)
        return out_BSD

    return _loss_step(model), (_moe_params(mesh, layers=(LAYERS,)), _batch(mesh))


def make_remat_around_scan_step(mesh):
    """`jax.checkpoint` around the whole `lax.scan` over LAYERS layers (a checkpointed
    decoder stack, as MaxText's 2-layer Qwen3-Next builds it): JAX stages the forward as
    one call of the scan's known part (`closed_call` on 0.10.2, `eval_jaxpr` on 0.12)
    and the backward as `remat2`."""

    def layer(x_BSD, params):
        return x_BSD + routed_moe(params, x_BSD, TOP_K), None

    @jax.checkpoint
    def model(params, x_BSD):
        out_BSD, _ = jax.lax.scan(layer, x_BSD, params)
        return out_BSD

    return _loss_step(model), (_moe_params(mesh, layers=(LAYERS,)), _batch(mesh))


def make_routing_returned_step(mesh):
    """The routed MoE, whose step also returns each token's experts in flattened
    (batch * seq) order: per shard that order is another one, so the value may not leave
    the routed region as it is."""

    def step(params, x_BSD):
        b, s, d = x_BSD.shape
        tokens_TD = x_BSD.reshape(b * s, d)
        weights_TK, experts_TK = _route(tokens_TD, params["w_gate"], TOP_K)
        out_TD = _experts(tokens_TD, weights_TK, experts_TK, params["w_in"], params["w_out"])
        return out_TD.reshape(b, s, d), experts_TK   # <- flattened routing returned

    return step, (_moe_params(mesh), _batch(mesh))


@functools.lru_cache
def _ramp(n: int) -> jax.Array:
    """A table built from a size once and cached (computed eagerly even under a trace), as
    models cache position tables."""
    with jax.ensure_compile_time_eval():
        return jnp.linspace(0.5, 1.5, n, dtype=jnp.float32)


def make_size_cached_tables_step(mesh):
    """`lax.scan` over LAYERS remat layers that scale x by cached tables of its sequence
    and embed sizes, then the routed MoE. The backward scan takes the tables as operands,
    one per distinct table: at data=2 x context=4 one shard's sequence (16) equals the
    embed size, so the per-shard trace hands it one table where the global trace hands two
    (7 operands against 6, JAX 0.10.2 and 0.12)."""

    def layer(x_BSD, params):
        _, s, d = x_BSD.shape
        x_BSD = x_BSD * jnp.expand_dims(_ramp(s), (0, 2)) * _ramp(d)   # the tables themselves
        return x_BSD + routed_moe(params, x_BSD, TOP_K), None

    def model(params, x_BSD):
        out_BSD, _ = jax.lax.scan(jax.checkpoint(layer), x_BSD, params)
        return out_BSD

    return _loss_step(model), (_moe_params(mesh, layers=(LAYERS,)), _batch(mesh))


def make_fsdp_moe_step(mesh):
    """The routed MoE with its weights sharded over `data` on the embed dimension (FSDP),
    SGD update inside: returns (loss, new params)."""

    def train_step(params, x_BSD):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(routed_moe(p, x_BSD, TOP_K) ** 2))(params)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = {"w_gate": _sds(mesh, (EMB, EXPERTS), P("data", None)),
              "w_in": _sds(mesh, (EXPERTS, EMB, MLP), P(None, "data", None)),
              "w_out": _sds(mesh, (EXPERTS, MLP, EMB), P(None, None, "data"))}
    return train_step, (params, _batch(mesh))


def make_config_mask_step(mesh, seq_len: int = SEQ, *, built_in_step: bool = False):
    """Causal self-attention with its mask built from the configured sequence length (not
    from the input's shape), then the routed MoE. The mask is a constant the step closes
    over, or (`built_in_step`) built while the step traces, from iotas, as MaxText does."""
    closed_over = jnp.tril(jnp.ones((seq_len, seq_len), bool))

    def block(params, x_BSD):
        b, s, d = x_BSD.shape
        mask_SS = jnp.tril(jnp.ones((seq_len, seq_len), bool)) if built_in_step else closed_over
        q, k, v = ((x_BSD @ params[w]).reshape(b, s, HEADS, d // HEADS) for w in ("wq", "wk", "wv"))
        logits_BHSS = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // HEADS)
        probs_BHSS = jax.nn.softmax(jnp.where(mask_SS, logits_BHSS, -1e9), axis=-1)  # <- config mask
        x_BSD = x_BSD + jnp.einsum("bhqk,bkhd->bqhd", probs_BHSS, v).reshape(b, s, d)
        return x_BSD + routed_moe(params, x_BSD, TOP_K)

    params = {**_moe_params(mesh), **{w: _sds(mesh, (EMB, EMB)) for w in ("wq", "wk", "wv")}}
    return _loss_step(block), (params, _batch(mesh))


def _mix_tokens(params, x_BSD):
    """Token mixing, MLP-Mixer style: a learned [seq, seq] matrix of the configured length
    contracted with the sequence. At one shard's shapes it meets a shard's sequence with
    the whole one."""
    return x_BSD + jnp.einsum("bsd,st->btd", x_BSD, params["w_mix"])  # <- whole sequence


def _mixing_params(mesh) -> dict:
    return {**_moe_params(mesh), "w_mix": _sds(mesh, (SEQ, SEQ))}


def make_token_mixing_step(mesh):
    """A token-mixing layer (`_mix_tokens`), then the routed MoE."""

    def block(params, x_BSD):
        x_BSD = _mix_tokens(params, x_BSD)
        return x_BSD + routed_moe(params, x_BSD, TOP_K)

    return _loss_step(block), (_mixing_params(mesh), _batch(mesh))


def make_gshard_step(mesh, capacity_factor: float = 1.0):
    """GShard capacity dispatch over `[batch, seq, experts]` (no flatten): a token's slot in
    its expert is a cumsum over the sequence; slots past `capacity` (from the input's
    shape and `capacity_factor`) drop. At `capacity_factor=EXPERTS` nothing drops, per
    shard or globally."""

    def gshard_moe(params, x_BSD):
        _, s, _ = x_BSD.shape
        capacity = max(1, int(s * TOP_K / EXPERTS * capacity_factor))
        logits_BSE = jnp.einsum("bsd,de->bse", x_BSD, params["w_gate"])
        probs_BSE = jax.nn.softmax(logits_BSE, axis=-1)
        _, experts_BSK = jax.lax.top_k(probs_BSE, TOP_K)
        mask_BSE = jax.nn.one_hot(experts_BSK, EXPERTS, dtype=jnp.int32).sum(2)
        position_BSE = jnp.cumsum(mask_BSE, axis=1) - 1
        keep_BSE = (position_BSE < capacity) & (mask_BSE > 0)
        dispatch_BSEC = jax.nn.one_hot(jnp.where(keep_BSE, position_BSE, -1), capacity, dtype=x_BSD.dtype)
        combine_BSEC = dispatch_BSEC * probs_BSE[..., None]
        expert_in_EBCD = jnp.einsum("bsec,bsd->ebcd", dispatch_BSEC, x_BSD)
        hidden_EBCF = jax.nn.silu(jnp.einsum("ebcd,edf->ebcf", expert_in_EBCD, params["w_in"]))
        expert_out_EBCD = jnp.einsum("ebcf,efd->ebcd", hidden_EBCF, params["w_out"])
        return jnp.einsum("bsec,ebcd->bsd", combine_BSEC, expert_out_EBCD)

    return _loss_step(gshard_moe), (_moe_params(mesh), _batch(mesh))


def make_scaled_tokens_step(mesh):
    """The routed MoE with each flattened token scaled by a table of the configured
    `(batch * seq)` length, inside the routed region (a shard's part of it is unknown)."""
    scale_T = jnp.linspace(0.5, 1.5, BATCH * SEQ)

    def moe(params, x_BSD):
        b, s, d = x_BSD.shape
        tokens_TD = x_BSD.reshape(b * s, d) * scale_T[:, None]   # <- configured length
        weights_TK, experts_TK = _route(tokens_TD, params["w_gate"], TOP_K)
        out_TD = _experts(tokens_TD, weights_TK, experts_TK, params["w_in"], params["w_out"])
        return out_TD.reshape(b, s, d)

    return _loss_step(moe), (_moe_params(mesh), _batch(mesh))


def make_size_branch_step(mesh, *, mixing: bool = False):
    """The routed MoE after an RMS norm that a Python branch on the sequence length turns
    on for long sequences: one shard's sequence is short, so the step's Python traces into
    other equations there. `mixing`: the branch mixes tokens instead (`_mix_tokens`),
    which no per-shard trace can follow."""

    def block(params, x_BSD):
        if x_BSD.shape[1] >= SEQ:   # <- a branch on the array's size
            if mixing:
                x_BSD = _mix_tokens(params, x_BSD)
            else:
                x_BSD = x_BSD * jax.lax.rsqrt(jnp.mean(x_BSD ** 2, axis=-1, keepdims=True) + 1e-6)
        return x_BSD + routed_moe(params, x_BSD, TOP_K)

    return _loss_step(block), (_mixing_params(mesh) if mixing else _moe_params(mesh), _batch(mesh))


def maxtext_capacity_moe(params, x_BSD, *, mesh, capacity_factor: float = 1.25, leak: str = ""):
    """MaxText's dense capacity path in miniature (`RoutedMoE.dense_matmul` with
    `capacity_factor > 0`, `generate_masks`): top_k and the scatter into `[batch, seq,
    experts]` weights; the one-hot experts folded to `[batch, seq * top_k, experts]` under a
    constraint that asks for the sequence unsharded; a cumsum over it (a token's position
    in its expert); a capacity from the sequence length; `[batch, seq, experts, capacity]`
    masks; the dispatch `BSM,BSEC -> EBCM`, the expert einsums and the combine
    `EBCM,BSEC -> BSM`. `leak` also returns a value from inside: "positions" (the running
    totals) or "dispatched" (the `[experts, batch, capacity, emb]` expert inputs)."""
    b, s, _ = x_BSD.shape
    logits_BSE = jnp.einsum("bsd,de->bse", x_BSD, params["w_gate"])
    weights_BSK, experts_BSK = jax.lax.top_k(logits_BSE, TOP_K)
    weights_BSK = jax.nn.softmax(weights_BSK, axis=-1)
    b_B, s_S = jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None]
    weights_BSE = jnp.zeros_like(logits_BSE).at[b_B, s_S, experts_BSK].set(weights_BSK)
    capacity = int(max(math.ceil(s * TOP_K / EXPERTS) * capacity_factor, capacity_factor))
    mask_BSKE = jax.nn.one_hot(experts_BSK, EXPERTS, dtype=jnp.int32)
    mask_BTE = mask_BSKE.reshape(b, s * TOP_K, EXPERTS)
    whole_seq = NamedSharding(mesh, P("data", None, None))
    mask_BTE = jax.lax.with_sharding_constraint(mask_BTE, whole_seq)  # <- asks for the whole sequence
    count_BTE = jnp.cumsum(mask_BTE, axis=1)
    count_BSKE = count_BTE.reshape(b, s, TOP_K, EXPERTS)  # <- positions
    kept_BSE = jnp.sum(mask_BSKE * (count_BSKE <= capacity), axis=2)
    weights_BSE = weights_BSE * kept_BSE
    position_BSE = jnp.sum((mask_BTE * count_BTE).reshape(b, s, TOP_K, EXPERTS), axis=2) * kept_BSE
    slot_BSEC = jax.nn.one_hot(position_BSE, capacity + 1, dtype=jnp.int32)
    combine_BSEC = (weights_BSE[..., None] * slot_BSEC)[..., 1:]
    dispatch_BSEC = combine_BSEC.astype(bool)
    expert_in_EBCD = jnp.einsum("BSM,BSEC -> EBCM", x_BSD, dispatch_BSEC)  # <- dispatch
    hidden_EBCF = jax.nn.silu(jnp.einsum("EBCM,EMH -> EBCH", expert_in_EBCD, params["w_in"]))
    out_EBCD = jnp.einsum("EBCH,EHM -> EBCM", hidden_EBCF, params["w_out"])
    out_BSD = jnp.einsum("EBCM,BSEC -> BSM", out_EBCD, combine_BSEC)
    if leak:
        return out_BSD, {"positions": count_BSKE, "dispatched": expert_in_EBCD}[leak]
    return out_BSD


def make_maxtext_capacity_step(mesh, capacity_factor: float = 1.25, *, layer=None, leak: str = ""):
    """`maxtext_capacity_moe` in a residual block, value_and_grad over its parameters and
    input. `layer` replaces the layer (a per-shard reference of it); `leak` returns a value
    from inside the layer with the loss."""
    moe = layer or functools.partial(maxtext_capacity_moe, mesh=mesh, capacity_factor=capacity_factor,
                                     leak=leak)

    def step(params, x_BSD):
        def loss(params, x_BSD):
            out = moe(params, x_BSD)
            out_BSD, aux = out if leak else (out, None)
            return jnp.mean((x_BSD + out_BSD) ** 2), aux

        (value, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
        return (value, grads, aux) if leak else (value, grads)

    return step, (_moe_params(mesh), _batch(mesh))


def top2_capacity_moe(params, x_BSD, *, mesh, capacity_factor: float = 1.25):
    """GShard's top-2 gating on MaxText's capacity path, routed the way XLA keeps sharded
    at real size: the two experts by `argmax` (GShard's own `top2gating`; an argmax over
    the experts needs no token dimension whole), the weights as a one-hot product (no
    scatter), the cumsum under a constraint that asks for the sequence whole and one right
    after that shards it again (MaxText's `activation_norm_length`), and like MaxText's a
    norm before it and weights that reach the experts through a layout op. XLA then gathers
    nothing for the routing: what is left of the loss is the dispatch einsum that sums
    the context-sharded sequence into capacity slots, all-reduced over `context`, with the
    expert matmuls replicated over it (what MaxText's Mixtral-8x7B shows on 64 v5p chips)."""
    b, s, _ = x_BSD.shape
    x_BSD = x_BSD * jax.lax.rsqrt(jnp.mean(x_BSD ** 2, axis=-1, keepdims=True) + 1e-6)   # RMSNorm
    logits_BSE = jnp.einsum("bsd,de->bse", x_BSD, params["w_gate"])
    first_BS = jnp.argmax(logits_BSE, axis=-1)
    taken_BSE = jax.nn.one_hot(first_BS, EXPERTS, dtype=bool)
    second_BS = jnp.argmax(jnp.where(taken_BSE, -jnp.inf, logits_BSE), axis=-1)
    experts_BSK = jnp.stack([first_BS, second_BS], axis=-1)
    weights_BSK = jax.nn.softmax(jnp.take_along_axis(logits_BSE, experts_BSK, axis=-1), axis=-1)
    capacity = int(max(math.ceil(s * TOP_K / EXPERTS) * capacity_factor, capacity_factor))
    mask_BSKE = jax.nn.one_hot(experts_BSK, EXPERTS, dtype=jnp.int32)
    weights_BSE = jnp.sum(mask_BSKE * weights_BSK[..., None], axis=2)
    mask_BTE = mask_BSKE.reshape(b, s * TOP_K, EXPERTS)
    mask_BTE = jax.lax.with_sharding_constraint(mask_BTE, NamedSharding(mesh, P("data", None, None)))
    count_BTE = jnp.cumsum(mask_BTE, axis=1)
    count_BSKE = count_BTE.reshape(b, s, TOP_K, EXPERTS)
    count_BSKE = jax.lax.with_sharding_constraint(count_BSKE, NamedSharding(mesh, P("data", "context")))
    kept_BSE = jnp.sum(mask_BSKE * (count_BSKE <= capacity), axis=2)
    weights_BSE = weights_BSE * kept_BSE
    position_BSE = jnp.sum(mask_BSKE * count_BSKE, axis=2) * kept_BSE
    slot_BSEC = jax.nn.one_hot(position_BSE, capacity + 1, dtype=jnp.int32)
    combine_BSEC = (weights_BSE[..., None] * slot_BSEC)[..., 1:]
    dispatch_BSEC = combine_BSEC.astype(bool)
    expert_in_EBCD = jnp.einsum("BSM,BSEC -> EBCM", x_BSD, dispatch_BSEC)  # <- top-2 dispatch
    # The weights reach the expert einsums through a layout op, as MaxText's do (a convert
    # from weight_dtype, a sharding constraint): here a constraint that keeps them whole.
    w_in, w_out = (jax.lax.with_sharding_constraint(params[k], NamedSharding(mesh, P())) for k in ("w_in", "w_out"))
    hidden_EBCF = jax.nn.silu(jnp.einsum("EBCM,EMH -> EBCH", expert_in_EBCD, w_in))
    out_EBCD = jnp.einsum("EBCH,EHM -> EBCM", hidden_EBCF, w_out)
    return jnp.einsum("EBCM,BSEC -> BSM", out_EBCD, combine_BSEC)  # <- top-2 combine


def make_top2_capacity_step(mesh, *, layer=None):
    """`top2_capacity_moe` in a residual block, value_and_grad over its parameters and
    input. `layer` replaces the layer (a per-shard reference of it)."""
    return make_maxtext_capacity_step(mesh, layer=layer or functools.partial(top2_capacity_moe, mesh=mesh))


def make_stacked_capacity_step(mesh, layers: str, *, layer=None):
    """`maxtext_capacity_moe` in LAYERS residual blocks whose weights are stacked over
    layers, value_and_grad over them and the input: `layers` is "scan" (`lax.scan` over the
    stack: JAX hoists the one-hot's iota out of the loop and saves the per-shard capacity
    masks for the backward body), "scan, remat" (each block under `jax.checkpoint`) or
    "loop" (a Python loop indexing the stack, `w[i]`). `layer` replaces the layer."""
    moe = layer or functools.partial(maxtext_capacity_moe, mesh=mesh)

    def block(x_BSD, params):
        return x_BSD + moe(params, x_BSD), None

    def model(params, x_BSD):
        if layers == "loop":
            for i in range(LAYERS):
                x_BSD, _ = block(x_BSD, jax.tree_util.tree_map(lambda w: w[i], params))
            return x_BSD
        body = jax.checkpoint(block) if layers == "scan, remat" else block
        return jax.lax.scan(body, x_BSD, params)[0]

    def step(params, x_BSD):
        return jax.value_and_grad(lambda p, x: jnp.mean(model(p, x) ** 2), argnums=(0, 1))(params, x_BSD)

    return step, (_moe_params(mesh, layers=(LAYERS,)), _batch(mesh))


def make_balance_loss_step(mesh):
    """The routed MoE with a load-balancing loss as keras-hub's Qwen3-MoE computes it (and
    Switch, Mixtral): over the flattened tokens, the fraction routed to each expert and the
    mean router probability, each masked by the valid tokens and divided by
    `maximum(valid count, 1e-9)`, their product summed. The sums over all tokens are a
    statistic: per shard a part of the whole, not a shard's own."""

    def balance_loss(params, x_BSD):
        b, s, d = x_BSD.shape
        tokens_TD = x_BSD.reshape(b * s, d)
        probs_TE = jax.nn.softmax(tokens_TD @ params["w_gate"], axis=-1)
        _, experts_TK = jax.lax.top_k(probs_TE, TOP_K)
        mask_TKE = jax.nn.one_hot(experts_TK, EXPERTS)
        valid_T1 = (jnp.abs(tokens_TD).sum(-1, keepdims=True) > 0).astype(jnp.float32)
        routed_KE = jnp.sum(mask_TKE * valid_T1[:, None, :], axis=0) / jnp.maximum(
            jnp.sum(valid_T1[:, None, :], axis=0), 1e-9)
        prob_E = jnp.sum(probs_TE * valid_T1, axis=0) / jnp.maximum(jnp.sum(valid_T1, axis=0), 1e-9)
        return jnp.sum(jnp.mean(routed_KE, axis=0) * prob_E) * EXPERTS

    def step(params, x_BSD):
        def loss(params):
            out_BSD = x_BSD + routed_moe(params, x_BSD, TOP_K)
            return jnp.mean(out_BSD ** 2) + 0.01 * balance_loss(params, x_BSD)

        return jax.value_and_grad(loss)(params)

    return step, (_moe_params(mesh), _batch(mesh))


def make_kernel_wrapper_step(mesh):
    """Attention in a kernel wrapper of its own, as MaxText's flash attention is on TPU: a
    `jax.shard_map` over the mesh that checks the global batch against its batch axis (its
    kernel takes blocks of two rows per device) and gathers K/V over `context` inside; then
    the routed MoE. At one shard's shapes the check would not hold (a shard has two batch
    rows, not two per device of `data`): the attention stays as written."""
    spec = P("data", "context", None)

    def per_device(q_BSD, k_BSD, v_BSD):
        k_BSD = jax.lax.all_gather(k_BSD, "context", axis=1, tiled=True)
        v_BSD = jax.lax.all_gather(v_BSD, "context", axis=1, tiled=True)
        scores_BQK = jnp.einsum("bqd,bkd->bqk", q_BSD, k_BSD) / math.sqrt(q_BSD.shape[-1])
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores_BQK, axis=-1), v_BSD)

    def attention(params, x_BSD):
        rows = 2 * mesh.shape["data"]
        if x_BSD.shape[0] % rows:   # <- checks the global batch
            raise AssertionError(f"batch {x_BSD.shape[0]} should be blocks of 2 rows per device of data")
        q, k, v = (x_BSD @ params[w] for w in ("wq", "wk", "wv"))
        return jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)

    def block(params, x_BSD):
        x_BSD = x_BSD + attention(params, x_BSD)
        return x_BSD + routed_moe(params, x_BSD, TOP_K)

    params = {**_moe_params(mesh), **{w: _sds(mesh, (EMB, EMB)) for w in ("wq", "wk", "wv")}}
    return _loss_step(block), (params, _sds(mesh, (2 * mesh.shape["data"], SEQ, EMB), spec))


def make_token_key_step(mesh, *, positions: str = "iota"):
    """The routed MoE sorting its token copies by one key, `expert * T + token`: the token
    count T is a literal of the step's jaxpr, and the token ids are an iota of T
    (`positions="iota"`) or a constant computed once (`"constant"`). Per shard the key
    keeps the global T and takes the shard's own ids; it still orders by expert, then by
    token."""

    def moe(params, x_BSD):
        b, s, d = x_BSD.shape
        t = b * s
        tokens_TD = x_BSD.reshape(t, d)
        weights_TK, experts_TK = _route(tokens_TD, params["w_gate"], TOP_K)
        if positions == "iota":
            ids_T = jnp.arange(t)
        else:
            with jax.ensure_compile_time_eval():
                ids_T = jnp.arange(t)
        key_TK = experts_TK * t + ids_T[:, None]   # <- the global token count
        order = jnp.argsort(key_TK.reshape(-1))
        sorted_TkD = jnp.repeat(tokens_TD, TOP_K, axis=0)[order]
        group_sizes = jnp.bincount(experts_TK.reshape(-1), length=EXPERTS).astype(jnp.int32)
        hidden = jax.nn.silu(jax.lax.ragged_dot(sorted_TkD, params["w_in"], group_sizes))
        out_sorted = jax.lax.ragged_dot(hidden, params["w_out"], group_sizes)
        out_TkD = jnp.zeros_like(out_sorted).at[order].set(out_sorted)
        return (out_TkD.reshape(t, TOP_K, d) * weights_TK[..., None]).sum(1).reshape(b, s, d)

    return _loss_step(moe), (_moe_params(mesh), _batch(mesh))


def make_configured_slice_step(mesh):
    """The routed MoE keeping only the first half of the flattened tokens by a size from
    the configuration: at one shard's shapes that slice is longer than the shard's tokens,
    so the op inside the region cannot run per shard."""

    def moe(params, x_BSD):
        b, s, d = x_BSD.shape
        tokens_TD = x_BSD.reshape(b * s, d)
        first_TD = jax.lax.dynamic_slice_in_dim(tokens_TD, 0, BATCH * SEQ // 2)   # <- configured half
        weights_TK, experts_TK = _route(first_TD, params["w_gate"], TOP_K)
        out_TD = _experts(first_TD, weights_TK, experts_TK, params["w_in"], params["w_out"])
        return jnp.concatenate([out_TD, jnp.zeros_like(out_TD)]).reshape(b, s, d)

    return _loss_step(moe), (_moe_params(mesh), _batch(mesh))


def make_select_after_experts_step(mesh, spec=P("data", "context", None)):
    """Every expert on every token (a dense `[batch, seq, experts, emb]` pass), then each
    token's top-k outputs selected by index and weighted: top_k over the router's logits
    and the selection (a gather) are the routing, after the experts rather than before."""

    def moe(params, x_BSD):
        logits_BSE = jnp.einsum("bsd,de->bse", x_BSD, params["w_gate"])
        weights_BSK, experts_BSK = jax.lax.top_k(logits_BSE, TOP_K)   # <- top_k after experts
        weights_BSK = jax.nn.softmax(weights_BSK, axis=-1)
        hidden_BSEF = jax.nn.silu(jnp.einsum("bsd,edf->bsef", x_BSD, params["w_in"]))
        out_BSED = jnp.einsum("bsef,efd->bsed", hidden_BSEF, params["w_out"])
        chosen_BSKD = jnp.take_along_axis(out_BSED, experts_BSK[..., None], axis=2)   # <- selection
        return jnp.einsum("bskd,bsk->bsd", chosen_BSKD, weights_BSK)

    return _loss_step(moe), (_moe_params(mesh), _batch(mesh, spec))


def make_batch_only_step(mesh):
    """The routed MoE (flatten, top_k, sort, grouped matmul) with only the batch sharded,
    over `data`: the flatten keeps the sharding, top_k and the sort lose it."""
    return _loss_step(lambda params, x_BSD: routed_moe(params, x_BSD, TOP_K)), (
        _moe_params(mesh), _batch(mesh, P("data", None, None)))


def make_replicated_routing_step(mesh, layers: str = "scan"):
    """The routed MoE as Levanter's Mixtral writes it: its routing (top_k), its permutation
    (argsort, the sorted tokens, the group sizes) and its unpermutation each in a
    `jax.shard_map` over the mesh whose specs split nothing (its flattened token axis maps
    to no mesh axis, `check_vma=False`), so every device routes every token; the grouped
    matmuls between them outside. Differentiated, JAX splits each shard_map into a forward
    that saves residuals over every mesh axis and a backward that sums over the mesh.
    `layers`: "scan" (LAYERS layers stacked under `lax.scan`) or "one"."""
    replicated = functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)

    def permute(tokens_TD, experts_TK):
        flat = experts_TK.reshape(-1)
        order = jnp.argsort(flat)
        group_sizes = jnp.bincount(flat, length=EXPERTS).astype(jnp.int32)
        return tokens_TD[order // TOP_K], group_sizes, order

    def unpermute(out_sorted, order):
        return out_sorted[jnp.argsort(order)].reshape(-1, TOP_K, out_sorted.shape[-1])

    def moe(params, x_BSD):
        b, s, d = x_BSD.shape
        tokens_TD = x_BSD.reshape(b * s, d)
        logits_TE = tokens_TD @ params["w_gate"]
        weights_TK, experts_TK = replicated(lambda logits: jax.lax.top_k(logits, TOP_K))(logits_TE)
        sorted_TkD, group_sizes, order = replicated(permute)(tokens_TD, experts_TK)
        hidden = jax.nn.silu(jax.lax.ragged_dot(sorted_TkD, params["w_in"], group_sizes))
        out_TKD = replicated(unpermute)(jax.lax.ragged_dot(hidden, params["w_out"], group_sizes), order)
        return (out_TKD * jax.nn.softmax(weights_TK, axis=-1)[..., None]).sum(1).reshape(b, s, d)

    def block(x_BSD, params):
        return x_BSD + moe(params, x_BSD), None

    def model(params, x_BSD):
        if layers == "one":
            return block(x_BSD, params)[0]
        return jax.lax.scan(block, x_BSD, params)[0]

    stack = () if layers == "one" else (LAYERS,)
    return _loss_step(model), (_moe_params(mesh, layers=stack), _batch(mesh))


def every_expert_moe(params, x_BSD):
    """A small public MoE's way: every expert on every token, then each token's top-k
    outputs picked by advanced indexing (`out[idx, arange(b), arange(s)]`), weighted and
    summed. No flatten; the routing op and the pick gather lose the sequence."""
    logits_BSE = jnp.einsum("bsd,de->bse", x_BSD, params["w_gate"])
    weights_BSK, experts_BSK = jax.lax.top_k(logits_BSE, TOP_K)
    weights_BSK = jax.nn.softmax(weights_BSK, axis=-1)
    hidden_EBSF = jax.nn.silu(jnp.einsum("bsd,edf->ebsf", x_BSD, params["w_in"]))
    out_EBSD = jnp.einsum("ebsf,efd->ebsd", hidden_EBSF, params["w_out"])
    b, s = x_BSD.shape[:2]
    picked_BSKD = out_EBSD[experts_BSK, jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None]]  # <- pick
    return jnp.einsum("bskd,bsk->bsd", picked_BSKD, weights_BSK)


def make_every_expert_step(mesh):
    """`every_expert_moe` in a residual block, value_and_grad over its parameters."""
    return _loss_step(lambda params, x_BSD: x_BSD + every_expert_moe(params, x_BSD)), (_moe_params(mesh), _batch(mesh))
