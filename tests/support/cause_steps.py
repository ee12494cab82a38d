"""Training steps whose collectives have a known cause, for the analyzer's cause tests.

Each `make_<name>(mesh)` returns `(step_fn, args)`: `args` are `jax.ShapeDtypeStruct`s with
NamedShardings on `mesh` (Auto axes `data` and `context`), the step is `value_and_grad` of
a loss w.r.t. `params` (first argument; the batch is second) unless the docstring says
otherwise. Each docstring lists the collectives of the partitioned program measured on
data=2 x context=4 with JAX 0.10.2 and 0.12.0.1 (AG all-gather, AR all-reduce, A2A
all-to-all; per-device shapes) and the cause each should get; `CAUSES` sums them up.
Lines that tests look up end in `# <- marker` (`marker_line`). Where the versions differ:
0.12 often attaches a gather of an argument to the argument itself (op_name `x_BSD` or
`params[0]['w_in']`, no stack frame) instead of the op that needed it. The code is
written as users write it, not as shardlint would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint.examples.steps import _loss_step, routed_moe

from .markers import marker_line as line_of_marker

BATCH, SEQ, EMB, MLP, EXPERTS, TOP_K, LAYERS, HEADS = 8, 64, 16, 32, 4, 2, 4, 4

# The causes each step's collectives should get, all of them (data=2 x context=4).
_LOST = frozenset({"lost", "reduction"})
CAUSES = {**dict.fromkeys(("make_scatter_dispatch_step", "make_capacity_cumsum_step",
                           "make_gather_dispatch_step", "make_scanned_layers_step",
                           "make_prejitted_step", "make_nnx_step",
                           "make_keep_sharded_constraint_step", "make_embedded_transpose_step"), _LOST),
          "make_ulysses_step": frozenset({"layout", "reduction"}),
          "make_fsdp_step": frozenset({"weights", "reduction"}),
          "make_clean_step": frozenset({"reduction"})}


def _sds(mesh, shape, spec=P()):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def _batch(mesh, spec=P("data", "context", None)):
    return _sds(mesh, (BATCH, SEQ, EMB), spec)


def _moe_params(mesh, layers=()):
    shapes = {"w_gate": (EMB, EXPERTS), "w_in": (EXPERTS, EMB, MLP), "w_out": (EXPERTS, MLP, EMB)}
    return {k: _sds(mesh, (*layers, *v)) for k, v in shapes.items()}


def _dense_experts(params, x_BSD, combine_BSE):
    hidden_BSEF = jax.nn.silu(jnp.einsum("bsd,edf->bsef", x_BSD, params["w_in"]))
    out_BSED = jnp.einsum("bsef,efd->bsed", hidden_BSEF, params["w_out"])
    return jnp.einsum("bsed,bse->bsd", out_BSED, combine_BSE)


def _scatter_moe(params, x_BSD, keep_mesh=None):
    logits_BSE = jnp.einsum("bsd,de->bse", x_BSD, params["w_gate"])
    weights_BSK, experts_BSK = jax.lax.top_k(logits_BSE, TOP_K)
    weights_BSK = jax.nn.softmax(weights_BSK, axis=-1)
    if keep_mesh is not None:
        keep = NamedSharding(keep_mesh, P("data", "context", None))
        weights_BSK = jax.lax.with_sharding_constraint(weights_BSK, keep)  # <- keep weights
        experts_BSK = jax.lax.with_sharding_constraint(experts_BSK, keep)  # <- keep experts
    b, s, _ = x_BSD.shape
    b_B, s_S = jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None]
    combine_BSE = jnp.zeros_like(logits_BSE).at[b_B, s_S, experts_BSK].set(weights_BSK)  # <- scatter
    return _dense_experts(params, x_BSD, combine_BSE)


def make_scatter_dispatch_step(mesh):
    """Dense MoE whose combine tensor is built by scattering the softmaxed top-k weights.

    The partitioner does not split the top-k custom call nor the scatter over batch/seq:
    `lost`, each as an AG over `context` then one over `data`, of the router logits
    f32[8,64,4] (top_k line, 0.12: the logits einsum line), and at `# <- scatter` of the
    scatter's ids u32[8,64,2] and indices s32[8,64,2,3], and in the backward of the
    combine cotangent f32[8,64,4] (the scatter's transpose, a gather). Two ARs (context,
    data) of f32[8,64,4] at `# <- scatter` (op scatter-add: JAX's jvp of a non-unique
    scatter adds a mask; XLA splits it over the updates and sums): `reduction` (partial
    sums, though over operands the loss made whole). ARs of loss+grads: `reduction`.
    """
    return _loss_step(_scatter_moe), (_moe_params(mesh), _batch(mesh))


def _capacity_moe(params, x_BSD, capacity: int = SEQ * TOP_K // EXPERTS):
    logits_BSE = jnp.einsum("bsd,de->bse", x_BSD, params["w_gate"])
    probs_BSE = jax.nn.softmax(logits_BSE, axis=-1)
    _, experts_BSK = jax.lax.top_k(probs_BSE, TOP_K)
    mask_BSE = jax.nn.one_hot(experts_BSK, EXPERTS, dtype=jnp.int32).sum(2)
    position_BSE = jnp.cumsum(mask_BSE, axis=1) - 1  # <- cumsum
    keep_BSE = (position_BSE < capacity) & (mask_BSE > 0)
    dispatch_BSEC = jax.nn.one_hot(jnp.where(keep_BSE, position_BSE, -1), capacity, dtype=x_BSD.dtype)
    combine_BSEC = dispatch_BSEC * probs_BSE[..., None]
    expert_in_EBCD = jnp.einsum("bsec,bsd->ebcd", dispatch_BSEC, x_BSD)
    hidden_EBCF = jax.nn.silu(jnp.einsum("ebcd,edf->ebcf", expert_in_EBCD, params["w_in"]))
    expert_out_EBCD = jnp.einsum("ebcf,efd->ebcd", hidden_EBCF, params["w_out"])
    return jnp.einsum("bsec,ebcd->bsd", combine_BSEC, expert_out_EBCD)


def make_capacity_cumsum_step(mesh):
    """GShard capacity dispatch: position in expert = cumsum over the sequence of a one-hot.

    `lost`: AG `context` s32[4,64,4] of the mask for the cumsum (a reduce-window over the
    sequence) at `# <- cumsum` (0.12 names the mask's `.sum(2)` line); AG `context` and
    `data` of the router probs f32[8,64,4] for top_k. `reduction`: AR `context`
    f32[4,16,4,32] of the dispatch einsum (contracts over the sharded sequence) and the
    ARs of loss and gradients.
    """
    return _loss_step(_capacity_moe), (_moe_params(mesh), _batch(mesh))


def _gather_moe(params, x_BSD):
    b, s, d = x_BSD.shape
    tokens_TD = x_BSD.reshape(b * s, d)  # <- flatten
    scores_TE = jax.nn.softmax(tokens_TD @ params["w_gate"], axis=-1)
    capacity = b * s * TOP_K // EXPERTS
    gate_EC, token_index_EC = jax.lax.top_k(scores_TE.T, capacity)  # expert choice
    expert_in_ECD = jnp.take(tokens_TD, token_index_EC, axis=0)  # <- take
    hidden_ECF = jax.nn.silu(jnp.einsum("ecd,edf->ecf", expert_in_ECD, params["w_in"]))
    out_ECD = jnp.einsum("ecf,efd->ecd", hidden_ECF, params["w_out"]) * gate_EC[..., None]
    token_index_N, out_ND = token_index_EC.reshape(-1), out_ECD.reshape(-1, d)
    out_TD = jax.ops.segment_sum(out_ND, token_index_N, num_segments=b * s)  # <- segment_sum
    return out_TD.reshape(b, s, d)


def make_gather_dispatch_step(mesh):
    """Expert-choice dispatch: `jnp.take` of token rows per expert, `segment_sum` to combine.

    `lost`: AG `context` f32[4,64,16] at `# <- flatten` (0.12: attached to argument
    `x_BSD`), AG `data` f32[4,512] of the scores for the expert-choice top_k. At `# <- take`
    an AR `data` f32[4,256,16]: XLA gathers from its own rows, masks and sums, so the
    result is replicated through an all-reduce; `reduction` by form, but it carries the
    loss too. AR `data` of the w_gate gradient: `reduction`. segment_sum adds nothing.
    """
    return _loss_step(_gather_moe), (_moe_params(mesh), _batch(mesh))


def make_scanned_layers_step(mesh, remat: bool = True, moe=None):
    """`lax.scan` over LAYERS stacked routed-MoE layers (each flattens (batch, seq)).

    All but the loss ARs sit in the while bodies (once per layer). Forward body: `lost`
    AG `context` f32[4,64,16] at the flatten (steps.py routed_moe; 0.12: no op_name, no
    frame), AG `data` f32[512,4] (top_k) and s32[1024] (argsort); AR `data` s32[4]
    (bincount) `reduction`; AR `data` f32[1024,16] of the sorted-token gather (masked
    gather, like `make_gather_dispatch_step`'s take). Backward body: the same again with
    `remat` (recomputed), plus AG `context` of the unflatten's cotangent (0.12 names
    `# <- scan`) and AR of the w_gate gradient. remat=False: 10 collectives, not 15.
    """

    moe = moe or functools.partial(routed_moe, top_k=TOP_K)

    def layer(x_BSD, params):
        return x_BSD + moe(params, x_BSD), None

    body = jax.checkpoint(layer) if remat else layer

    def model(params, x_BSD):
        out_BSD, _ = jax.lax.scan(body, x_BSD, params)  # <- scan
        return out_BSD

    return _loss_step(model), (_moe_params(mesh, layers=(LAYERS,)), _batch(mesh))


def make_prejitted_step(mesh):
    """The naive routed MoE step, already `jax.jit`-ed with shardings and donation (SGD).

    Returns `(new_params, loss)`; same collectives as the plain function: `lost` AG
    `context` f32[4,64,16] at the flatten (0.12: argument `x_BSD`), AG `data` f32[512,4]
    (top_k) and s32[1024] (argsort); AR `data` s32[4] (bincount) and of loss+grads:
    `reduction`; AR `data` f32[1024,16] of the sorted-token gather (masked gather).
    """
    params, x = _moe_params(mesh), _batch(mesh)

    def train_step(params, x_BSD):
        def loss_fn(params):
            return jnp.mean(routed_moe(params, x_BSD, TOP_K) ** 2)  # <- prejitted moe

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    shardings = jax.tree.map(lambda a: a.sharding, params)
    step = jax.jit(train_step, in_shardings=(shardings, x.sharding),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
    return step, (params, x)


def make_nnx_step(mesh, concrete: bool = False, scanned: bool = False, moe=None):
    """A Flax NNX routed MoE (flattens (batch, seq)) trained with `nnx.Optimizer` (adam).

    `nnx.jit`-ed `train_step(model, optimizer, x)`; model and optimizer come from
    `nnx.eval_shape` with ShapeDtypeStruct leaves carrying replicated shardings. Traced
    with its own `train_step.trace(*args)`, the collectives are those of
    `make_prejitted_step`. Caution: `jax.jit(train_step).trace(*args)` also compiles, but
    the in-place optimizer update is not an output there, so XLA drops it and with it the
    gradients (no w_gate-gradient AR; inputs are only params and x).

    `scanned`: a decoder of LAYERS such layers (each adding its input back), created
    stacked with `nnx.vmap` and run with `nnx.scan` over `nnx.remat` layers, as Flax's
    guides write a scanned stack.
    """
    import optax
    from flax import nnx

    class MoE(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            init = jax.nn.initializers.normal(0.02)
            self.w_gate = nnx.Param(init(rngs.params(), (EMB, EXPERTS)))
            self.w_in = nnx.Param(init(rngs.params(), (EXPERTS, EMB, MLP)))
            self.w_out = nnx.Param(init(rngs.params(), (EXPERTS, MLP, EMB)))

        def __call__(self, x_BSD):
            weights = {"w_gate": self.w_gate[...], "w_in": self.w_in[...], "w_out": self.w_out[...]}
            return (moe or functools.partial(routed_moe, top_k=TOP_K))(weights, x_BSD)  # <- nnx moe

    class Decoder(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            @nnx.split_rngs(splits=LAYERS)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create_layers(rngs):
                return MoE(rngs)

            self.layers = create_layers(rngs)

        def __call__(self, x_BSD):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def layer(x_BSD, moe):
                return x_BSD + moe(x_BSD)

            return layer(x_BSD, self.layers)

    @nnx.jit
    def train_step(model, optimizer, x_BSD):
        def loss_fn(model):
            return jnp.mean(model(x_BSD) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def create():
        model = (Decoder if scanned else MoE)(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    replicated = NamedSharding(mesh, P())
    if concrete:  # real weights and batch, to run the step (`concrete=True`); else shapes only
        model, optimizer = create()
        for state in (nnx.state(model), nnx.state(optimizer)):
            nnx.update(state, jax.device_put(state, replicated))
        x = _batch(mesh)
        x_BSD = jax.device_put(jax.random.normal(jax.random.key(0), x.shape, x.dtype), x.sharding)
        return train_step, (model, optimizer, x_BSD)
    model, optimizer = nnx.eval_shape(create)
    for state in (nnx.state(model), nnx.state(optimizer)):
        nnx.update(state, jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), state))
    return train_step, (model, optimizer, _batch(mesh))


def make_keep_sharded_constraint_step(mesh):
    """The scatter dispatch of `make_scatter_dispatch_step`, with the top-k weights and
    indices constrained to *keep* `P('data', 'context', None)` just before the scatter.

    The constraints ask for what the arrays already have, so they request nothing: the
    same 12 collectives as `make_scatter_dispatch_step`, none at `# <- keep weights` or
    `# <- keep experts`; the gathers are `lost`, not `requested`.
    """
    step = _loss_step(lambda p, x: _scatter_moe(p, x, keep_mesh=mesh))
    return step, (_moe_params(mesh), _batch(mesh))


def make_ulysses_step(mesh):
    """Ulysses sequence parallelism asked with constraints.

    q/k/v `[B,S,H,K]` are pinned to `P('data','context',None,None)`, then constrained to
    `P('data',None,'context',None)` (heads sharded, whole sequence) for attention; the
    output is pinned to heads and constrained back. 8 A2A over `context`: 3 at
    `# <- ulysses qkv`, 1 at `# <- ulysses out`, and in the backward 1 at
    `# <- attention out`, 3 at `# <- qkv seq sharded` (the constraints' transposes). The
    asked sharding lacks `context` on the sequence, so by the letter they are `requested`;
    but nothing is replicated, the axis moves between seq and heads as the code asked:
    `layout`. Without the two pins XLA gathers q/k/v and the output cotangent instead.
    ARs (context, data) of loss+grads: `reduction`.
    """
    heads_spec = NamedSharding(mesh, P("data", None, "context", None))
    seq_spec = NamedSharding(mesh, P("data", "context", None, None))

    def attention(params, x_BSD):
        b, s, d = x_BSD.shape
        qkv_BSHK = [(x_BSD @ params[w]).reshape(b, s, HEADS, d // HEADS) for w in ("wq", "wk", "wv")]
        q_BSHK, k_BSHK, v_BSHK = (jax.lax.with_sharding_constraint(t, seq_spec)  # <- qkv seq sharded
                                  for t in qkv_BSHK)
        q_BSHK, k_BSHK, v_BSHK = (jax.lax.with_sharding_constraint(t, heads_spec)  # <- ulysses qkv
                                  for t in (q_BSHK, k_BSHK, v_BSHK))
        logits_BHSS = jnp.einsum("bqhd,bkhd->bhqk", q_BSHK, k_BSHK) / jnp.sqrt(d // HEADS)
        mask_SS = jnp.tril(jnp.ones((s, s), bool))
        probs_BHSS = jax.nn.softmax(jnp.where(mask_SS, logits_BHSS, -1e9), axis=-1)
        attn_BSHK = jnp.einsum("bhqk,bkhd->bqhd", probs_BHSS, v_BSHK)
        out_BSHK = jax.lax.with_sharding_constraint(attn_BSHK, heads_spec)  # <- attention out
        out_BSHK = jax.lax.with_sharding_constraint(out_BSHK, seq_spec)  # <- ulysses out
        return out_BSHK.reshape(b, s, d) @ params["wo"]

    params = {w: _sds(mesh, (EMB, EMB)) for w in ("wq", "wk", "wv", "wo")}
    return _loss_step(attention), (params, _batch(mesh))


def make_fsdp_step(mesh, axis: str | None = None):
    """Two-layer MLP (Python loop) with SGD, weights sharded over `axis` (default `fsdp`
    if the mesh has it, else `data`) on their embed dimension; returns (loss, new params).

    `weights`: 4 AG over `axis` (w_in f32[16,32], w_out f32[32,16], once per layer, reused
    by the backward) at `# <- fsdp w_in` / `# <- fsdp w_out` (0.12: attached to arguments
    `params[i]['w_in']`, no frame). `reduction`: AR over `axis` of the full gradients,
    AR over the other batch axes of the sharded gradients and loss (XLA:CPU makes no
    reduce-scatter). Activations keep their sharding: nothing is `lost`.
    """

    def mlp(params, x_BSD):
        for layer in params:
            h_BSF = jax.nn.silu(x_BSD @ layer["w_in"])  # <- fsdp w_in
            x_BSD = x_BSD + h_BSF @ layer["w_out"]  # <- fsdp w_out
        return x_BSD

    def train_step(params, x_BSD):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(mlp(p, x_BSD) ** 2))(params)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)  # <- fsdp update

    axis = axis or ("fsdp" if "fsdp" in mesh.axis_names else "data")
    batch_axes = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
    params = [{"w_in": _sds(mesh, (EMB, MLP), P(axis, None)),
               "w_out": _sds(mesh, (MLP, EMB), P(None, axis))} for _ in range(2)]
    batch = batch_axes if len(batch_axes) > 1 else batch_axes[0]
    return train_step, (params, _batch(mesh, P(batch, "context", None)))


def make_scanned_fsdp_step(mesh):
    """The FSDP MLP as LAYERS stacked layers under `lax.scan` (MaxText's `scan_layers`),
    SGD inside: each body slices its layer's weights and gathers them over `data`.

    `weights`: every AG (w_in f32[16,32] and w_out f32[32,16] per iteration, forward and
    backward). The loop carries weights and activations side by side in one tuple; only
    the weights' elements hold parameters. Nothing is `lost`.
    """

    def layer(x_BSD, params):
        return x_BSD + jax.nn.silu(x_BSD @ params["w_in"]) @ params["w_out"], None  # <- scanned fsdp

    def train_step(params, x_BSD):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(jax.lax.scan(layer, x_BSD, p)[0] ** 2))(params)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = {"w_in": _sds(mesh, (LAYERS, EMB, MLP), P(None, "data", None)),
              "w_out": _sds(mesh, (LAYERS, MLP, EMB), P(None, None, "data"))}
    return train_step, (params, _batch(mesh))


def make_clean_step(mesh):
    """Routed MoE flattened per shard inside `shard_map`, batch sharded over `data` only.

    One collective: AR `data` of loss and gradients (`reduction`). No AG, no A2A.
    """
    spec = P("data", None, None)
    moe = jax.shard_map(lambda p, x: routed_moe(p, x, TOP_K), mesh=mesh,  # <- clean moe
                        in_specs=(P(), spec), out_specs=spec)
    return _loss_step(moe), (_moe_params(mesh), _batch(mesh, spec))


def make_embedded_transpose_step(mesh, vocab: int = 128):
    """Token ids looked up in an embedding table (its backward is a scatter-add, whose zero
    XLA shares with every fusion that needs one), then scores added to their own transpose:
    the two operands of the add are sharded over `context` along different dimensions, so
    the partitioner moves one with an all-to-all, forward (add) and backward (add_any).
    The ids arrive sharded over data and context, the table replicated."""

    def loss(params, ids_BS):
        h_BSD = params["table"][ids_BS]
        s_BSS = jnp.einsum("bqd,bkd->bqk", h_BSD @ params["wq"], h_BSD @ params["wk"])
        t_BSS = jnp.swapaxes(s_BSS, 1, 2)                      # <- transpose
        return jnp.sum(jnp.maximum(s_BSS + t_BSS, 0.0) ** 2)  # <- add

    params = {"table": _sds(mesh, (vocab, EMB)), "wq": _sds(mesh, (EMB, EMB)), "wk": _sds(mesh, (EMB, EMB))}
    ids = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=NamedSharding(mesh, P("data", "context")))
    return jax.jit(jax.value_and_grad(loss)), (params, ids)


def marker_line(marker: str) -> int:
    return line_of_marker(__file__, marker)
