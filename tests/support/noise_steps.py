"""Steps on which findings once said more than XLA did (issue 41, "Why 4"), written as users
write them (plain JAX, `value_and_grad` of a mean square through the model).

Each `make_<name>(mesh)` returns `(step_fn, args)`: `args` are `jax.ShapeDtypeStruct`s with
NamedShardings on `mesh` (Auto axes `data` and `context`), the parameters first, then
`x_BSD` sharded `P('data', 'context', None)`. Lines tests look up end in `# <- marker`.

- `make_embed_context_step`: the routed MoE with its weights' embed dimension sharded over
  `context` (as MaxText's logical rules shard it). XLA keeps `context` through the flatten
  by moving it from the sequence to the embed dimension with all-to-alls: the flatten's
  result is `P('data', 'context')`; nothing gathers the sequence.
- `make_decoder_step`: LAYERS pre-norm blocks in a Python loop, each attention without a
  constraint (XLA gathers K and V over `context` for the score and value einsums) and then
  the routed MoE. The layers share their lines and op paths.
- `make_scanned_decoder_step`: the same blocks stacked and run with `lax.scan`.
- `make_batch_only_step`: the routed MoE with only the batch sharded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint.examples.steps import _loss_step, routed_moe

from .markers import marker_line as line_of_marker

BATCH, SEQ, EMB, MLP, EXPERTS, TOP_K, HEADS, LAYERS = 8, 64, 16, 32, 4, 2, 2, 2


def _sds(mesh, shape, spec=P()):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def _x(mesh):
    return _sds(mesh, (BATCH, SEQ, EMB), P("data", "context", None))


def make_embed_context_step(mesh):
    params = {"w_gate": _sds(mesh, (EMB, EXPERTS), P("context", None)),
              "w_in": _sds(mesh, (EXPERTS, EMB, MLP), P(None, "context", None)),
              "w_out": _sds(mesh, (EXPERTS, MLP, EMB), P(None, None, "context"))}
    return _loss_step(lambda p, x: routed_moe(p, x, TOP_K)), (params, _x(mesh))


def _attention(p, x_BSD):
    b, s, d = x_BSD.shape
    q_BSHK, k_BSHK, v_BSHK = ((x_BSD @ p[w]).reshape(b, s, HEADS, d // HEADS) for w in ("wq", "wk", "wv"))
    logits_BHSS = jnp.einsum("bqhd,bkhd->bhqk", q_BSHK, k_BSHK) / jnp.sqrt(d // HEADS)  # <- scores
    mask_SS = jnp.tril(jnp.ones((s, s), bool))
    probs_BHSS = jax.nn.softmax(jnp.where(mask_SS, logits_BHSS, -1e9), axis=-1)
    out_BSHK = jnp.einsum("bhqk,bkhd->bqhd", probs_BHSS, v_BSHK)  # <- values
    return out_BSHK.reshape(b, s, d) @ p["wo"]


def _norm(x_BSD):
    return x_BSD * jax.lax.rsqrt(jnp.mean(x_BSD * x_BSD, axis=-1, keepdims=True) + 1e-6)


def _block(p, x_BSD):
    x_BSD = x_BSD + _attention(p, _norm(x_BSD))
    return x_BSD + routed_moe(p, _norm(x_BSD), TOP_K)


def _block_params(mesh, layers=()):
    shapes = {"wq": (EMB, EMB), "wk": (EMB, EMB), "wv": (EMB, EMB), "wo": (EMB, EMB),
              "w_gate": (EMB, EXPERTS), "w_in": (EXPERTS, EMB, MLP), "w_out": (EXPERTS, MLP, EMB)}
    return {k: _sds(mesh, (*layers, *v)) for k, v in shapes.items()}


def make_decoder_step(mesh):
    def model(params, x_BSD):
        for p in params:
            x_BSD = _block(p, x_BSD)
        return x_BSD

    return _loss_step(model), ([_block_params(mesh) for _ in range(LAYERS)], _x(mesh))


def make_scanned_decoder_step(mesh):
    def model(params, x_BSD):
        return jax.lax.scan(lambda h, p: (_block(p, h), None), x_BSD, params)[0]  # <- scan

    return _loss_step(model), (_block_params(mesh, (LAYERS,)), _x(mesh))


def marker_line(marker: str) -> int:
    return line_of_marker(__file__, marker)


def make_batch_only_step(mesh):
    """The routed MoE with only the batch sharded (`x_BSD` at `P('data', None, None)`), as
    the README's model.py with `--mesh data=8` and the context=1 point of a sweep: top_k and
    the argsort lose `data`, nothing loses a sequence axis."""
    params = {"w_gate": _sds(mesh, (EMB, EXPERTS)), "w_in": _sds(mesh, (EXPERTS, EMB, MLP)),
              "w_out": _sds(mesh, (EXPERTS, MLP, EMB))}
    x = _sds(mesh, (BATCH, SEQ, EMB), P("data", None, None))
    return _loss_step(lambda p, x: routed_moe(p, x, TOP_K)), (params, x)
