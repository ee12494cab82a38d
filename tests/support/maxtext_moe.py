"""MaxText 0.2.5's own RoutedMoE layer as a training-like step, for tests and benchmarks
(tests import it as `support.maxtext_moe`; from the repository root it is also the target
`tests.support.maxtext_moe:make_moe_step`).

`make_moe_step` builds MaxText's config with `maxtext.configs.pyconfig.initialize`, MaxText's
12-axis mesh with `maxtext.utils.maxtext_utils.get_mesh_from_config` (over `devices`, by
default all of JAX's: simulated CPU devices or a TPU topology's compile-only chips), and its
NNX `maxtext.layers.moe.RoutedMoE` abstractly (`nnx.eval_shape`). Parameters come back as
`jax.ShapeDtypeStruct`s carrying the NamedShardings MaxText derives from its logical axis
rules (`maxtext.utils.sharding.nnx_construct_named_sharding`); the input activations are
sharded over the `activation_batch`/`activation_length`/`activation_embed` logical axes. The
step is `value_and_grad` of mean(out**2) w.r.t. the parameters (and x with `grad_x=True`), so
`jax.jit(step).lower(*args)` traces forward and backward; nothing runs on real arrays.

`sizes` (`shardlint.moe.Sizes`: global batch, sequence, dims, experts, top-k) and
`dtype` say the layer's shape; the default is the small float32 dropless MoE the tests use,
with a global batch of 2 x the data degree. Nothing is set up at import time (device
count, XLA flags): callers do that first. MaxText itself is imported lazily, inside the
functions. Note that `pyconfig.initialize` calls `compilation_cache.set_cache_dir(jax_cache_dir)`,
which is process-wide and stays set; shardlint's MaxText defaults (`maxtext.defaults`) pass
`""`, which skips the call (a folder set earlier stays): pass `jax_cache_dir=str(tmp_path)` to
turn MaxText's persistent cache on in a folder of your own. `scan_layers` is passed
to the config only: one RoutedMoE does not read it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from shardlint.integrations import maxtext
from shardlint.moe import Sizes

ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")

# Fixed for every size: a dropless (capacity_factor=-1) MoE of one Mixtral-style layer, on
# shardlint's CPU defaults for MaxText (`maxtext.defaults`): megablox and tokamax off, so the
# sparse path uses `jax.lax.ragged_dot`, which compiles on CPU (the TPU compiler takes it too).
FIXED_CONFIG: dict[str, Any] = dict(capacity_factor=-1.0, base_num_decoder_layers=1,
                                    decoder_block="mixtral", run_name="shardlint_moe")


def small_sizes(data: int) -> Sizes:
    """The tests' MoE: seq 128, emb 64, mlp 128, 8 experts, top-2, batch 2 x data."""
    return Sizes(batch=2 * data, seq=128, emb=64, mlp=128, experts=8, top_k=2)


def size_keys(sizes: Sizes, dtype: str, num_devices: int) -> dict[str, Any]:
    """MaxText's config keys for these sizes. MaxText's global batch is
    `per_device_batch_size x` the number of JAX devices (not the mesh's), hence the division."""
    return dict(base_emb_dim=sizes.emb, base_mlp_dim=sizes.mlp, base_moe_mlp_dim=sizes.mlp,
                num_experts=sizes.experts, num_experts_per_tok=sizes.top_k,
                max_target_length=sizes.seq, dtype=dtype, weight_dtype=dtype,
                per_device_batch_size=sizes.batch / num_devices)


def make_config(*, sparse: bool, scan_layers: bool = False, context: int = 4, data: int = 2,
                sizes: Sizes | None = None, dtype: str = "float32",
                keep_maxtext_xla_flags: bool = False, **overrides: Any):
    """MaxText's own config (`pyconfig.initialize` on base.yml) for the MoE of `sizes`
    (default `small_sizes(data)`) on a data x context mesh (fsdp 1).

    `keep_maxtext_xla_flags`: see `shardlint.integrations.maxtext.initialize` (by default
    MaxText's own XLA_FLAGS, a dump folder, are kept out of the environment).
    """
    kwargs = dict(maxtext.defaults("cpu"), **FIXED_CONFIG, sparse_matmul=sparse,
                  scan_layers=scan_layers, ici_data_parallelism=data,
                  ici_context_parallelism=context, ici_fsdp_parallelism=1,
                  **size_keys(sizes or small_sizes(data), dtype, len(jax.devices())))
    kwargs.update(overrides)
    return maxtext.initialize(kwargs, keep_maxtext_xla_flags=keep_maxtext_xla_flags)


def make_moe_step(mesh: jax.sharding.Mesh | None = None, *, sparse: bool, scan_layers: bool = False,
                  context: int = 4, data: int = 2, sizes: Sizes | None = None,
                  dtype: str = "float32", devices: Sequence[Any] | None = None, grad_x: bool = False,
                  keep_maxtext_xla_flags: bool = False,
                  **overrides: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Returns `(step, (params, rest, x))`: `step(params, rest, x)` computes the loss and its
    grads w.r.t. params (a pair, params' and x's, with `grad_x`).

    MaxText's mesh is laid over `devices` (default: the first data x context of
    `jax.devices()`); a `mesh` given must have MaxText's axes and sizes.
    """
    apply, params, rest, x = _layer(mesh, sparse=sparse, scan_layers=scan_layers, context=context,
                                    data=data, sizes=sizes, dtype=dtype, devices=devices,
                                    keep_maxtext_xla_flags=keep_maxtext_xla_flags, **overrides)

    def loss_fn(params, rest, x):
        return jnp.mean(jnp.square(apply(params, rest, x).astype(jnp.float32)))

    argnums = (0, 2) if grad_x else 0

    def moe_step(params, rest, x):
        return jax.value_and_grad(loss_fn, argnums=argnums)(params, rest, x)

    return moe_step, (params, rest, x)


def make_moe_layer(mesh: jax.sharding.Mesh | None = None, **kwargs: Any):
    """`(layer(params, x_BSD), params, x)`: MaxText's RoutedMoE as a function of its
    parameters and input alone, for steps written around a layer (its other state, the
    unused rng streams, made afresh inside). Keywords as `make_moe_step`'s."""
    apply, params, rest, x = _layer(mesh, **kwargs)

    def layer(params, x_BSD):
        fresh = jax.tree.map(lambda a: jax.random.key(0) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
                             else jnp.zeros(a.shape, a.dtype), rest)
        return apply(params, fresh, x_BSD)

    return layer, params, x


def _layer(mesh, *, sparse: bool, scan_layers: bool = False, context: int = 4, data: int = 2,
           sizes: Sizes | None = None, dtype: str = "float32", devices: Sequence[Any] | None = None,
           keep_maxtext_xla_flags: bool = False, **overrides: Any):
    """`(apply(params, rest, x), params, rest, x)`: MaxText's RoutedMoE split into its
    parameters and the rest of its state, abstractly, with the input's shape."""
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.layers import initializers, moe
    from maxtext.utils import maxtext_utils, sharding

    config = make_config(sparse=sparse, scan_layers=scan_layers, context=context, data=data,
                         sizes=sizes, dtype=dtype, keep_maxtext_xla_flags=keep_maxtext_xla_flags, **overrides)
    if devices is None:
        devices = jax.devices()[:data * context]
    maxtext_mesh = maxtext_utils.get_mesh_from_config(config, list(devices))
    if mesh is not None:
        if dict(mesh.shape) != dict(maxtext_mesh.shape):
            raise ValueError(f"mesh {dict(mesh.shape)} does not match MaxText's config "
                             f"{dict(maxtext_mesh.shape)}")
        maxtext_mesh = mesh
    mesh = maxtext_mesh
    rules = config.logical_axis_rules

    def new_layer() -> moe.RoutedMoE:
        # Constructed the way MaxText's Mixtral decoder layer constructs its MoeBlock_0.
        return moe.RoutedMoE(
            config=config, num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok, mesh=mesh,
            kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
            kernel_axes=("embed", None), intermediate_dim=config.moe_mlp_dim,
            dtype=config.dtype, weight_dtype=config.weight_dtype, rngs=nnx.Rngs(0))

    with logical_axis_rules(rules):
        abstract_layer = nnx.eval_shape(new_layer)
        graphdef, params, rest = nnx.split(abstract_layer, nnx.Param, ...)
        shardings = sharding.nnx_construct_named_sharding(params, mesh)

    def with_sharding(var, sharding_var):
        value = var.get_value()
        return var.replace(value=jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                      sharding=sharding_var.get_value()))

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    params = jax.tree.map(with_sharding, params, shardings, is_leaf=is_var)
    batch = int(config.global_batch_size_to_train_on)
    x_sharding = sharding.create_sharding(mesh, ACTIVATION_AXES, rules=rules)
    x = jax.ShapeDtypeStruct((batch, config.max_target_length, config.emb_dim), config.dtype,
                             sharding=x_sharding)

    def apply(params, rest, x):
        with logical_axis_rules(rules):  # MaxText's constraints resolve names at trace time
            out, _, _ = nnx.merge(graphdef, params, rest)(x)
        return out

    return apply, params, rest, x
