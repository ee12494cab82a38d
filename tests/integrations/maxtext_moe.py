"""MaxText 0.2.5's own RoutedMoE layer as a training-like step, for shardlint's tests.

`make_moe_step` builds MaxText's config with `maxtext.configs.pyconfig.initialize`, MaxText's
12-axis mesh with `maxtext.utils.maxtext_utils.get_mesh_from_config`, and its NNX
`maxtext.layers.moe.RoutedMoE` abstractly (`nnx.eval_shape`). Parameters come back as
`jax.ShapeDtypeStruct`s carrying the NamedShardings MaxText derives from its logical axis
rules (`maxtext.utils.sharding.nnx_construct_named_sharding`); the input activations are
sharded over the `activation_batch`/`activation_length`/`activation_embed` logical axes. The
step is `value_and_grad` of mean(out**2) w.r.t. the parameters, so `jax.jit(step).lower(*args)`
traces forward and backward; nothing runs on real arrays.

Nothing is set up at import time (device count, XLA flags): callers do that first. MaxText
itself is imported lazily, inside `make_moe_step`. Note that `pyconfig.initialize` calls
`compilation_cache.set_cache_dir(jax_cache_dir)` (default "~/jax_cache"), which is
process-wide and stays set: pass `jax_cache_dir=str(tmp_path)` to redirect it; `""` only skips
the call (a folder set earlier stays). `scan_layers` is passed to the config only: one
RoutedMoE does not read it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import jax
import jax.numpy as jnp

ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")

# Small dims: 8 experts, top-2, f32, a dropless (capacity_factor=-1) MoE; megablox and tokamax
# off so the sparse path uses `jax.lax.ragged_dot`, which compiles on CPU.
SMALL_MOE_CONFIG: dict[str, Any] = dict(
    base_emb_dim=64, base_mlp_dim=128, base_moe_mlp_dim=128, num_experts=8, num_experts_per_tok=2,
    max_target_length=128, dtype="float32", weight_dtype="float32", capacity_factor=-1.0,
    megablox=False, use_tokamax_gmm=False, base_num_decoder_layers=1, decoder_block="mixtral",
    enable_checkpointing=False, skip_jax_distributed_system=True, hardware="cpu",
    run_name="shardlint_moe", dataset_type="synthetic", log_config=False,
)


def make_config(*, sparse: bool, scan_layers: bool = False, context: int = 4, data: int = 2,
                keep_maxtext_xla_flags: bool = False, **overrides: Any):
    """MaxText's own config (`pyconfig.initialize` on base.yml) for the small MoE.

    MaxText's config validation writes `XLA_FLAGS=--xla_dump_to=/tmp/xla_dump/ ...
    --xla_dump_hlo_module_re=jit_train_step` into os.environ when it is unset; XLA reads it
    only if the backend starts afterwards, so whether it applies would depend on test order.
    By default the backend is started first and XLA_FLAGS restored after, which keeps the
    flags out; `keep_maxtext_xla_flags=True` leaves MaxText's behaviour as it is.
    """
    from maxtext.configs import pyconfig

    if not keep_maxtext_xla_flags:
        jax.devices()  # XLA parses XLA_FLAGS when the backend starts: start it before MaxText
        saved_xla_flags = os.environ.get("XLA_FLAGS")
    num_devices = data * context
    kwargs = dict(SMALL_MOE_CONFIG, sparse_matmul=sparse, scan_layers=scan_layers,
                  ici_data_parallelism=data, ici_context_parallelism=context,
                  ici_fsdp_parallelism=1, per_device_batch_size=2 * data / num_devices,
                  base_output_directory=os.path.join(tempfile.gettempdir(), "shardlint_maxtext"))
    kwargs.update(overrides)
    try:
        return pyconfig.initialize([""], **kwargs)
    finally:
        if not keep_maxtext_xla_flags:
            if saved_xla_flags is None:
                os.environ.pop("XLA_FLAGS", None)
            else:
                os.environ["XLA_FLAGS"] = saved_xla_flags


def make_moe_step(mesh: jax.sharding.Mesh | None = None, *, sparse: bool, scan_layers: bool = False,
                  context: int = 4, data: int = 2, keep_maxtext_xla_flags: bool = False,
                  **overrides: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Returns `(step, args)`: `step(params, rest, x)` computes loss and grads w.r.t. params."""
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.layers import initializers, moe
    from maxtext.utils import maxtext_utils, sharding

    config = make_config(sparse=sparse, scan_layers=scan_layers, context=context, data=data,
                         keep_maxtext_xla_flags=keep_maxtext_xla_flags, **overrides)
    maxtext_mesh = maxtext_utils.get_mesh_from_config(config)
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
    x = jax.ShapeDtypeStruct((batch, config.max_target_length, config.emb_dim), jnp.float32,
                             sharding=x_sharding)

    def loss_fn(params, rest, x):
        layer = nnx.merge(graphdef, params, rest)
        out, _, _ = layer(x)
        return jnp.mean(jnp.square(out))

    def moe_step(params, rest, x):
        with logical_axis_rules(rules):  # MaxText's constraints resolve names at trace time
            return jax.value_and_grad(loss_fn)(params, rest, x)

    return moe_step, (params, rest, x)
