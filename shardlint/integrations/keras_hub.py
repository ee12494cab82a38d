"""keras-hub's Qwen3-MoE training step on Keras's JAX backend as a shardlint target.

    shardlint analyze shardlint.integrations.keras_hub:make_step --devices 8 \\
        --set 'mesh_shape=[2, 4]' --set num_layers=2 --set hidden_dim=64 ...

`make_step` builds the step `model.fit` runs, with Keras's and keras-hub's own pieces:

- the distribution: a `keras.distribution.DeviceMesh` of axes `("batch", "model")` (the
  names `Qwen3MoeBackbone.get_layout_map` takes by default) over the devices shardlint gives,
  keras-hub's own partition rules for the model (`Qwen3MoeBackbone.get_layout_map`) and
  Keras's `ModelParallel` over them, which shards the input batch over `batch`;
- the model: `Qwen3MoeBackbone(**keys)` (random init: no preset is downloaded) in a
  `Qwen3MoeCausalLM` without a preprocessor, compiled with keras-hub's defaults for a causal
  LM (Adam, sparse cross-entropy from logits, weighted accuracy), built on a batch of
  `(batch_size, sequence_length)` as the preprocessor gives it (`token_ids`,
  `padding_mask`, labels, sample weights);
- the step: Keras's JAX trainer's `train_step` jitted as `make_train_function` jits it
  (the state donated, its outputs on the state's shardings), traced inside the
  distribution's scope as `fit` runs it; its arguments the trainer's state (trainable,
  non-trainable, optimizer and metrics variables) and the batch, with the shardings the
  variables and `ModelParallel.get_data_layout` give them.

Keras has no sequence or context parallelism: the batch is sharded over `batch`, the
weights as the layout map says (embedding dimensions over `batch` as well, FSDP style, and
over `model`). keras-hub's Qwen3-MoE flattens `(batch, seq)` into tokens, routes with
`top_k` and runs every expert on every token (a batched einsum), combining the outputs with
a dense `[experts, tokens]` routing matrix.

Keras picks its backend when it is first imported: `KERAS_BACKEND` must be unset or `jax`
(this module sets it when unset). `pip install 'shardlint[keras-hub]'`. Nothing of Keras is
imported until `make_step` runs.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any, Callable, Sequence

from ._library import Library, LibraryError, described, devices_of, unknown_key

AXES = ("batch", "model")   # Qwen3MoeBackbone.get_layout_map's default axis names
_TRAINING_KEYS = ("mesh_shape", "batch_size", "sequence_length")


class KerasHubError(LibraryError):
    """Keras or keras-hub is missing, on another backend, or the model or mesh cannot be
    built as asked."""


# Imported quietly: keras-hub imports TensorFlow, which prints notes as it loads.
KERAS_HUB = Library("keras-hub", "keras-hub", KerasHubError, modules=("keras", "keras_hub"))
INSTALL = KERAS_HUB.install


def make_step(mesh=None, *, devices: Sequence[Any] | None = None, mesh_shape: Sequence[int] | None = None,
              batch_size: int | None = None, sequence_length: int = 128,
              **backbone: Any) -> tuple[Callable[..., Any], tuple[Any, Any]]:
    """`(train_step, (state, data))`: Keras's jitted training step of keras-hub's
    Qwen3-MoE causal LM and its shaped inputs.

    `backbone` are `Qwen3MoeBackbone` arguments (`num_layers`, `hidden_dim`, ...).
    `mesh_shape` is the `(batch, model)` shape of Keras's DeviceMesh (default `(1, N)`, as in
    keras-hub's own example); `batch_size` the global batch (default 2 per `batch` shard). A
    `mesh` given must have these axes and sizes (shardlint's CLI passes None under
    `--devices` and `--topology`).
    """
    import jax

    keras, keras_hub = _require_keras_hub()
    devices = devices_of(mesh, devices)
    shape = tuple(mesh_shape) if mesh_shape is not None else (1, len(devices))
    if len(shape) != 2 or math.prod(shape) != len(devices):
        raise KerasHubError(f"mesh_shape {list(shape)} must be [batch, model] with batch x model = "
                            f"{len(devices)} devices")
    KERAS_HUB.refuse_other_mesh(mesh, dict(zip(AXES, shape)), owner="Keras", way_out="--set mesh_shape=[B, M]")
    device_mesh = keras.distribution.DeviceMesh(shape=shape, axis_names=AXES, devices=devices)
    Backbone = keras_hub.models.Qwen3MoeBackbone
    layout_map = Backbone.get_layout_map(device_mesh)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name=AXES[0])
    batch_size = batch_size if batch_size is not None else 2 * shape[0]
    with distribution.scope():
        model = keras_hub.models.Qwen3MoeCausalLM(backbone=_backbone(Backbone, backbone), preprocessor=None)
        model.compile()
        data = _batch(batch_size, sequence_length)
        model._symbolic_build(data_batch=data)   # what fit does before its first step
        state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                     optimizer_variables=True, metrics_variables=True)
        # As JAXTrainer.make_train_function jits it under a distribution.
        jitted = jax.jit(model.train_step, donate_argnums=0,
                         out_shardings=(None, model._get_state_sharding_spec()))

    def keras_train_step(state, data):
        with distribution.scope():   # layers read the distribution while they trace, as in fit
            return jitted(state, data)

    shaped_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    shaped_data = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=distribution.get_data_layout(a.shape).backend_layout), data)
    return jax.jit(keras_train_step, donate_argnums=0), (shaped_state, shaped_data)


def _backbone(Backbone, keys: dict[str, Any]):
    params = inspect.signature(Backbone.__init__).parameters
    unknown = [k for k in keys if k not in params]
    if unknown:
        takes = [k for k in params if k not in ("self", "kwargs")]
        raise KerasHubError(f"{unknown_key('Qwen3MoeBackbone takes no argument', unknown[0])}; "
                            f"it takes {', '.join(takes)}; the training keys are {', '.join(_TRAINING_KEYS)}")
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty
               and p.kind is p.POSITIONAL_OR_KEYWORD and k != "self" and k not in keys]
    if missing:
        raise KerasHubError(f"Qwen3MoeBackbone needs {', '.join(missing)} (--set {missing[0]}=...): "
                            f"keras-hub's presets load their config from a hub, so the model is built from its arguments")
    try:
        return Backbone(**keys)
    except (ValueError, TypeError) as e:   # its own checks, and a layout its sizes do not divide
        raise KerasHubError(f"Qwen3MoeBackbone cannot be built as asked: {described(e)}") from e


def _batch(batch_size: int, sequence_length: int):
    """`(x, y, sample_weight)` as `Qwen3MoeCausalLMPreprocessor` gives them."""
    import numpy as np

    shape = (batch_size, sequence_length)
    x = {"token_ids": np.zeros(shape, "int32"), "padding_mask": np.ones(shape, "int32")}
    return x, np.zeros(shape, "int32"), np.ones(shape, "float32")


def _require_keras_hub():
    backend = os.environ.setdefault("KERAS_BACKEND", "jax")
    if backend != "jax":
        raise KerasHubError(f"KERAS_BACKEND is {backend!r}: keras-hub's step runs on Keras's JAX backend; "
                            f"unset it or set KERAS_BACKEND=jax")
    keras, keras_hub = KERAS_HUB.require()
    if keras.backend.backend() != "jax":
        raise KerasHubError(f"Keras was imported with its {keras.backend.backend()!r} backend before "
                            f"shardlint could ask for JAX: set KERAS_BACKEND=jax")
    return keras, keras_hub
