"""One layer, three training-step signatures: the analysis and the rewrite must not care.

Whether a gathered value is a weight or an activation is read from the values (a moved
parameter, or something computed), never from where an argument sits in the step's
signature. Each layer here is wrapped as users write steps:

- `layer_step`: `step(x, *weights)` returning `value_and_grad` with respect to every
  argument, as people check a layer's forward and backward (x comes back as a gradient of
  its own shape, like a parameter's);
- `train_step`: `step(params, opt_state, batch, rng)` with SGD and momentum (the momentum
  has the parameters' shapes and shardings) and the rng drawing a dropout mask;
- `batch_first_step`: `step(batch, params)` returning the loss and the parameters'
  gradients.

`LAYERS` maps an id to `make(mesh) -> (layer(params, x_BSD), params, x)` with
ShapeDtypeStruct arguments carrying NamedShardings; `make(layer, signature, mesh)` gives one
layer's step in one signature (also from `dump_job.py`: `signature_steps.LAYER.SIGNATURE`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint.examples.steps import routed_moe

from .cause_steps import EMB, EXPERTS, MLP, TOP_K, _batch, _capacity_moe, _moe_params, _scatter_moe, _sds
from .cause_steps import LAYERS as NUM_LAYERS


def _loss(layer, params, x_BSD):
    return jnp.mean(layer(params, x_BSD) ** 2)


def layer_step(layer, params, x):
    """`step(x, *weights)`: the loss and its gradient with respect to every argument."""
    leaves, tree = jax.tree_util.tree_flatten(params)

    def step(x_BSD, *weights):
        def loss(x_BSD, *weights):
            return _loss(layer, jax.tree_util.tree_unflatten(tree, weights), x_BSD)

        return jax.value_and_grad(loss, argnums=tuple(range(1 + len(weights))))(x_BSD, *weights)

    return step, (x, *leaves)


def train_step(layer, params, x):
    """`step(params, opt_state, batch, rng)`: SGD with momentum, dropout drawn from rng."""

    def step(params, opt_state, batch, rng):
        def loss(params):
            out_BSD = layer(params, batch["x"])
            keep_BSD = jax.random.bernoulli(jax.random.wrap_key_data(rng), 0.9, out_BSD.shape)
            return jnp.mean(jnp.where(keep_BSD, out_BSD / 0.9, 0.0) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, opt_state, grads)
        return jax.tree.map(lambda p, m: p - 0.1 * m, params, momentum), momentum, value

    mesh = x.sharding.mesh
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P()))
    return step, (params, params, {"x": x}, rng)


def batch_first_step(layer, params, x):
    """`step(batch, params)`: the loss and the parameters' gradients."""

    def step(batch, params):
        return jax.value_and_grad(functools.partial(_loss, layer), argnums=0)(params, batch)

    return step, (x, params)


# id: wrap(layer, params, x) -> (step, args)
SIGNATURES = {"x_then_weights": layer_step, "params_opt_state_batch_rng": train_step,
              "batch_then_params": batch_first_step}


def _capacity_layer(params, x_BSD):
    """GShard's one-hot capacity dispatch (a cumsum over the sequence), with a capacity of
    the input's sequence length: no token drops, globally or per shard (the rewrite's
    per-shard capacity then gives the same numbers)."""
    return _capacity_moe(params, x_BSD, capacity=x_BSD.shape[1])


def _flatten_layer(params, x_BSD):
    return routed_moe(params, x_BSD, TOP_K)


def _scanned_layers(params, x_BSD):
    @jax.checkpoint
    def layer(x_BSD, layer_params):
        return x_BSD + routed_moe(layer_params, x_BSD, TOP_K), None

    return jax.lax.scan(layer, x_BSD, params)[0]


def _fsdp_params(mesh):
    return {"w_gate": _sds(mesh, (EMB, EXPERTS), P("data", None)),
            "w_in": _sds(mesh, (EXPERTS, EMB, MLP), P(None, "data", None)),
            "w_out": _sds(mesh, (EXPERTS, MLP, EMB), P(None, None, "data"))}


# id: make(mesh) -> (layer, params, x)
LAYERS = {
    # a scatter dense dispatch whose routing is constrained to keep P('data', 'context', None)
    "scatter_keep_sharded": lambda mesh: (
        functools.partial(_scatter_moe, keep_mesh=mesh), _moe_params(mesh), _batch(mesh)),
    "capacity_cumsum": lambda mesh: (_capacity_layer, _moe_params(mesh), _batch(mesh)),
    "flatten_ragged_dot": lambda mesh: (_flatten_layer, _moe_params(mesh), _batch(mesh)),
    "scan_remat": lambda mesh: (_scanned_layers, _moe_params(mesh, layers=(NUM_LAYERS,)), _batch(mesh)),
    "fsdp_weights": lambda mesh: (_flatten_layer, _fsdp_params(mesh), _batch(mesh)),
}


def make(layer: str, signature: str, mesh):
    """`(step, args)` of one layer in one signature."""
    return SIGNATURES[signature](*LAYERS[layer](mesh))
