"""Levanter's Mixtral training step as a shardlint target (haliax named axes).

    shardlint analyze shardlint.integrations.levanter:make_step --devices 8 \\
        --set 'axes={"context": 4}' --set 'shared_mapping={"position": "context"}' \\
        --set hidden_dim=64 --set num_layers=2 ...

`make_step` builds the step Levanter's `Trainer` runs, with Levanter's own pieces:

- the configs: `MixtralConfig` and `TrainerConfig` decoded by draccus (Levanter's config
  parser) from the `--set` keys: a key that names a `MixtralConfig` field goes to the model,
  one that names a `TrainerConfig` field to the trainer, one that names a `MeshConfig` field
  to the trainer's mesh (`axes`, `shared_mapping`, `compute_mapping`, ... as JSON), and
  `vocab_size` stands in for the tokenizer Levanter would load;
- the mesh: `MeshConfig.axis_shapes` and `create_mesh_from_axis_specs` over the devices
  shardlint gives (simulated CPU devices or a TPU topology's compile-only chips);
- the train state: `TrainerState.init` with `AdamConfig` (train_lm's default optimizer) on
  the model `MixtralConfig.build` makes, evaluated abstractly, sharded by haliax's
  `infer_resource_partitions` under the trainer's parameter mapping; the batch an
  `LmExample` of `(batch, position)` tokens sharded under its compute mapping, as
  Levanter's data loader puts it;
- the step: the trainer's own `named_jit` of `Trainer._train_step` with `train_lm`'s loss
  (`compute_next_token_loss`), called inside a `jax.jit` that donates the state, as
  `Trainer.train_step` donates it. Levanter's layers read the mesh from the context
  (`with trainer:` enters it); the step enters Levanter's abstract mesh while it traces, so
  it lowers wherever it is traced.

Levanter's notion of context parallelism is a `context` mesh axis with the `position`
axis mapped to it (`shared_mapping: {position: context}`, its gpt2_small_fast_context.yaml).
Its Mixtral flattens `(batch, position)` into a `token` axis and routes, permutes and
unpermutes inside `jax.shard_map`s whose specs come from the same mapping.

Besides the keys, shardlint sets what running outside a training job needs (a key given
wins): no tracker (`tracker: noop`), no accelerator required, no jaxpr/HLO logging.
Levanter (the `marin-levanter` package) needs Python 3.12 and JAX < 0.12:
`pip install 'shardlint[levanter]'`. Nothing of Levanter is imported until `make_step` runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from ._library import Library, LibraryError, described, devices_of, unknown_key

# What a run outside a training job needs; the caller's keys win.
_OUTSIDE_A_JOB: dict[str, Any] = dict(tracker={"type": "noop"}, require_accelerator=False,
                                      log_jaxprs=False, log_xla_hlo=False, id="shardlint")


class LevanterError(LibraryError):
    """Levanter is missing, or its config or mesh cannot be built as asked."""


# Imported quietly: transformers prints a note when it imports without PyTorch.
LEVANTER = Library("Levanter", "levanter", LevanterError, modules=("levanter.models.mixtral",),
                   python=(3, 12), distribution="marin-levanter")
INSTALL = LEVANTER.install


def make_step(mesh=None, *, devices: Sequence[Any] | None = None, vocab_size: int = 256,
              **keys: Any) -> tuple[Callable[..., Any], tuple[Any, Any]]:
    """`(train_step, (state, batch))`: Levanter's jitted Mixtral training step and its
    shaped inputs (the train state's arrays and an `LmExample`).

    `keys` are `MixtralConfig`, `TrainerConfig` or `MeshConfig` fields (`make_configs`);
    `vocab_size` stands in for the tokenizer's. The mesh is Levanter's own over `devices`
    (default `jax.devices()`); a `mesh` given must have Levanter's axes and sizes for this
    config (shardlint's CLI passes None under `--devices` and `--topology`).
    """
    devices = devices_of(mesh, devices)
    model_config, trainer_config = make_configs(**keys)   # says so if Levanter is missing
    levanter_mesh = _mesh(trainer_config, devices)
    LEVANTER.refuse_other_mesh(mesh, levanter_mesh.shape,
                               way_out="--set axes=... (Levanter's trainer.mesh.axes as JSON)")
    return _train_step(model_config, trainer_config, levanter_mesh, vocab_size=vocab_size)


def make_configs(**keys: Any):
    """`(MixtralConfig, TrainerConfig)` decoded by draccus from `keys` plus shardlint's
    defaults for a run outside a job; Levanter's refusals as one line. A key goes where
    Levanter's YAML has it: `model.*` (MixtralConfig), `trainer.*` (TrainerConfig) or
    `trainer.mesh.*` (MeshConfig: `axes`, `dcn_axes`, `shared_mapping`, `compute_mapping`,
    `param_mapping`, `batch_axis_name`)."""
    LEVANTER.require()
    import draccus
    from levanter.models.mixtral import MixtralConfig
    from levanter.trainer import TrainerConfig
    from levanter.utils.mesh import MeshConfig

    model_fields = _fields(MixtralConfig)
    mesh_fields = _fields(MeshConfig)
    trainer_fields = _fields(TrainerConfig) - {"mesh"}   # `mesh` is the target's own argument
    model_keys = {k: v for k, v in keys.items() if k in model_fields}
    mesh_keys = {k: v for k, v in keys.items() if k in mesh_fields}
    trainer_keys = {**_OUTSIDE_A_JOB, **{k: v for k, v in keys.items() if k in trainer_fields},
                    **({"mesh": mesh_keys} if mesh_keys else {})}
    valid = model_fields | mesh_fields | trainer_fields
    unknown = [k for k in keys if k not in valid]
    if unknown:
        raise LevanterError(unknown_key("Levanter's MixtralConfig, TrainerConfig and MeshConfig have no key",
                                        unknown[0], sorted(valid)))
    try:
        return (draccus.decode(MixtralConfig, model_keys), draccus.decode(TrainerConfig, trainer_keys))
    except Exception as e:   # draccus raises its own DecodingError, and the configs' checks others
        raise LevanterError(f"Levanter rejects the config: {described(e)}") from e


def _train_step(model_config, trainer_config, mesh, *, vocab_size: int):
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from levanter.models.lm_model import LmExample
    from levanter.optim.config import AdamConfig
    from levanter.trainer import Trainer
    from levanter.trainer_state import TrainerState

    optimizer = AdamConfig().build(trainer_config.num_train_steps)

    def loss_function(model, example, *, key=None):   # levanter.main.train_lm's loss
        return model.compute_next_token_loss(example, key=key)

    trainer = Trainer(trainer_config, optimizer, loss_function, add_default_hooks=False)
    params, compute = trainer.parameter_axis_mapping, trainer.compute_axis_mapping
    _, _, model_key, training_key = jax.random.split(jax.random.PRNGKey(trainer_config.seed), 4)  # train_lm's
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping(params):
        vocab = hax.partitioning.round_axis_for_partitioning(hax.Axis("vocab", vocab_size), params)

        def init_state():
            model = model_config.build(vocab, key=model_key)
            return TrainerState.init(optimizer, model, key=training_key, is_trainable=True, mp=trainer.mp,
                                     quantization=trainer_config.quantization,
                                     model_averaging=trainer_config.model_averaging)

        state = _shaped(eqx.filter_eval_shape(init_state), params, mesh)
        tokens = (hax.Axis(trainer_config.batch_axis_name, trainer_config.train_batch_size),
                  model_config.max_Pos)
        batch = _shaped(eqx.filter_eval_shape(lambda: LmExample(
            tokens=hax.zeros(tokens, dtype=jnp.int32), loss_weight=hax.ones(tokens, dtype=jnp.float32))),
            compute, mesh)
    arrays, static = eqx.partition(state, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    levanter_step = trainer._jit_train_step_fn_no_hook   # what Trainer.train_step calls
    abstract_mesh = mesh.abstract_mesh

    def levanter_train_step(state, batch):
        with jax.sharding.use_abstract_mesh(abstract_mesh):   # as `with trainer:` provides it
            result = levanter_step(eqx.combine(state, static), (batch,), {})
        return eqx.filter(result, eqx.is_array)

    return jax.jit(levanter_train_step, donate_argnums=0), (arrays, batch)


def _shaped(tree, mapping, mesh):
    """`tree`'s abstract arrays as ShapeDtypeStructs carrying the NamedShardings haliax
    infers for them under `mapping`."""
    import haliax as hax
    import jax

    shardings = hax.partitioning.infer_resource_partitions(tree, mapping, mesh=mesh)

    def with_sharding(x, sharding):
        if isinstance(x, hax.NamedArray):
            return hax.NamedArray(with_sharding(x.array, sharding), x.axes)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return x

    return jax.tree.map(with_sharding, tree, shardings, is_leaf=lambda x: isinstance(x, hax.NamedArray))


def _mesh(trainer_config, devices: list):
    from levanter.utils.mesh import create_mesh_from_axis_specs

    try:
        ici, dcn = trainer_config.mesh.axis_shapes(len(devices), 1)
        return create_mesh_from_axis_specs(ici_axes=ici, dcn_axes=dcn, devices=devices)
    except ValueError as e:
        raise LevanterError(f"Levanter cannot lay its mesh over {len(devices)} devices with "
                            f"axes {dict(trainer_config.mesh.axes)}: {described(e)}") from e


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}
