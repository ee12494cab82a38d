"""A routed MoE whose expert matmuls write float32 or bfloat16, its correct per-shard forms
and wrong ones, for the rewrite's numbers check (`verify_same`).

Each `make_*` takes a mesh (Auto axes `data` and `context`) and a dtype and returns
`(step_fn, args)`, the step `value_and_grad` of a sum of squares over float32 parameters
(`cause_steps` sizes, tokens `P('data', 'context', None)`): summed, so that the gradients
are of order one, as a language model's loss gives them (a mean over 8192 values makes
them 1e-4, where float32's absolute tolerance alone would pass wrong ones):

  make_moe_step           the layer as users write it: tokens flattened over the whole
                          array, routed in float32, the experts' matmuls (forward and
                          backward) writing `dtype`; `fault` makes it wrong:
                            "wrong expert"    the first token's first choice goes to the
                                              next expert
                            "dropped weight"  the first token's first combine weight is
                                              dropped (its expert's output taken whole)
  make_per_shard_step     the same layer per shard in shard_map over data and context, loss
                          and gradients psummed: a correct rewrite written by hand;
                          `psum=False` leaves each device its own shard's gradients
  make_capacity_step      GShard-style capacity (`examples.steps.capacity_moe`) computing
                          in `dtype`; `layer=` serves a per-shard reference of it
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardlint.examples.steps import _experts, _route, capacity_moe

from .cause_steps import EXPERTS, TOP_K, _batch, _moe_params

FAULTS = ("wrong expert", "dropped weight")
TOKEN_AXES = ("data", "context")


def moe_layer(dtype, fault: str | None = None):
    def layer(params, x_BSD):
        b, s, d = x_BSD.shape
        tokens_TD = x_BSD.reshape(b * s, d)
        weights_TK, experts_TK = _route(tokens_TD, params["w_gate"], TOP_K)
        if fault == "wrong expert":
            experts_TK = experts_TK.at[0, 0].add(1) % EXPERTS
        elif fault == "dropped weight":
            weights_TK = weights_TK.at[0, 0].set(1.0)
        elif fault is not None:
            raise ValueError(f"fault {fault!r}: expected one of {FAULTS}")
        out_TD = _experts(tokens_TD.astype(dtype), weights_TK, experts_TK, params["w_in"].astype(dtype),
                          params["w_out"].astype(dtype))
        return out_TD.reshape(b, s, d).astype(x_BSD.dtype)

    return layer


def summed_loss_step(layer):
    def step(params, x_BSD):
        return jax.value_and_grad(lambda params: jnp.sum(layer(params, x_BSD) ** 2))(params)

    return step


def make_moe_step(mesh, dtype, fault: str | None = None):
    return summed_loss_step(moe_layer(dtype, fault)), (_moe_params(mesh), _batch(mesh))


def make_per_shard_step(mesh, dtype, psum: bool = True):
    local_step = summed_loss_step(moe_layer(dtype))

    def local(params, x_BSD):   # this shard's part of the sum
        value, grads = local_step(params, x_BSD)
        return jax.lax.psum(value, TOKEN_AXES), jax.lax.psum(grads, TOKEN_AXES) if psum else grads

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(*TOKEN_AXES, None)), out_specs=(P(), P()),
                         check_vma=False)
    return step, (_moe_params(mesh), _batch(mesh))


def capacity_layer(dtype, capacity_factor: float):
    def layer(params, x_BSD):
        low = jax.tree_util.tree_map(lambda w: w.astype(dtype), params)
        return capacity_moe(low, x_BSD.astype(dtype), TOP_K, capacity_factor).astype(x_BSD.dtype)

    return layer


def make_capacity_step(mesh, dtype, capacity_factor: float = 1.0, *, layer=None):
    layer = layer or capacity_layer(dtype, capacity_factor)
    return summed_loss_step(layer), (_moe_params(mesh), _batch(mesh))

