"""MaxText's real training step as a shardlint target: no harness to write.

    shardlint analyze shardlint.integrations.maxtext:make_step --devices 8 \\
        --set decoder_block=mixtral --set ici_context_parallelism=4 ...

`make_step` builds the step MaxText's own AOT path (`train_compile.py`) compiles, with
MaxText's functions for every piece:

- the config: `pyconfig.initialize` on MaxText's `base.yml` with the `--set` overrides
  (any MaxText key, `model_name=...` included);
- the mesh: `maxtext_utils.get_mesh_from_config` over the devices shardlint gives
  (simulated CPU devices, or a TPU topology's compile-only chips under `--topology`);
- the shaped train state and batch with their shardings: `train_compile.get_shaped_inputs`,
  the Zero-1 and input-data shardings of `sharding`;
- the step, its in/out shardings and donation: `maxtext_utils.get_functional_train_with_signature`
  over `train.train_step`, jitted with them; MaxText's logical axis rules are entered
  while it traces.

Besides the overrides, shardlint sets what running outside a training job needs (a
user's `--set` wins): one process (`skip_jax_distributed_system`), no checkpoints, no
config log, synthetic data, outputs under the temp folder, and no persistent compile
cache (`jax_cache_dir=""`; MaxText's default turns one on under `~/jax_cache`). On CPU
devices also `hardware=cpu` and `megablox=false`, `use_tokamax_gmm=false`: MaxText's
Pallas kernels do not run on CPU, and `jax.lax.ragged_dot` does.

MaxText needs Python 3.12+: `pip install 'shardlint[maxtext]'`. Nothing of MaxText is
imported until `make_step` runs. Its trainer's modules replace `jax.lax.top_k` and
`jax.lax.with_sharding_constraint` with compat shims for the whole process when they import
(`maxtext/integration/tunix/tunix_adapter.py`), as in a MaxText job; shardlint's stacks
pass over such shims to the model's own lines.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from typing import Any, Callable, Sequence

from .._library import Library, LibraryError, described, devices_of, one_line, quiet, unknown_key

# What a MaxText run outside a training job needs; the caller's overrides win.
_OUTSIDE_A_JOB: dict[str, Any] = dict(
    skip_jax_distributed_system=True, enable_checkpointing=False, log_config=False,
    dataset_type="synthetic", run_name="shardlint", jax_cache_dir="",
    base_output_directory=os.path.join(tempfile.gettempdir(), "shardlint_maxtext"),
)
# On CPU devices: MaxText's Pallas kernels (megablox, tokamax) do not lower for CPU.
_ON_CPU: dict[str, Any] = dict(hardware="cpu", megablox=False, use_tokamax_gmm=False)


class MaxTextError(LibraryError):
    """MaxText is missing, or its config or mesh cannot be built as asked."""


# Imported (and its config read) quietly: MaxText prints its whole config and absl notes.
MAXTEXT = Library("MaxText", "maxtext", MaxTextError, modules=("maxtext", "maxtext.configs.pyconfig"),
                  python=(3, 12))
INSTALL = MAXTEXT.install


def make_step(mesh=None, *, devices: Sequence[Any] | None = None,
              **overrides: Any) -> tuple[Callable[..., Any], tuple[Any, Any]]:
    """`(train_step, (state, batch))`: MaxText's jitted training step and its shaped inputs.

    `overrides` are MaxText config keys. The mesh is MaxText's own, over `devices`
    (default: `jax.devices()`); a `mesh` given must have MaxText's axes and sizes for this
    config (shardlint's CLI passes None under `--devices` and `--topology`).
    `per_device_batch_size` is per device of that mesh (a topology's chips), as on the pod.
    """
    import jax

    devices = devices_of(mesh, devices)
    if len(devices) != jax.device_count():
        # MaxText counts its target devices (the global batch is per_device_batch_size x
        # them) from the devices JAX runs on; under --topology those are this host's, not
        # the topology's chips. Its own key for an AOT compile names the count.
        overrides = dict(internal_compile=True, internal_compile_num_devices=len(devices), **overrides)
    config = make_config(platform=devices[0].platform, **overrides)   # says so if MaxText is missing
    from flax.core.spmd import logical_axis_rules

    maxtext_mesh = _mesh(config, devices)
    MAXTEXT.refuse_other_mesh(mesh, maxtext_mesh.shape, shown=_sizes(maxtext_mesh),
                              way_out="set MaxText's ici_*_parallelism keys")
    state, batch, signature = _shaped_inputs(config, maxtext_mesh)
    train_step, in_shardings, out_shardings, donate_argnums = signature
    rules = config.logical_axis_rules

    def maxtext_train_step(state, batch):
        with logical_axis_rules(rules):  # MaxText's constraints name logical axes
            return train_step(state, batch)

    jitted = jax.jit(maxtext_train_step, in_shardings=in_shardings, out_shardings=out_shardings,
                     donate_argnums=donate_argnums)
    return jitted, (state, batch)


def make_config(*, platform: str = "cpu", **overrides: Any):
    """MaxText's config: `base.yml` + shardlint's defaults for `platform` + `overrides`."""
    return initialize({**defaults(platform), **overrides})


def defaults(platform: str) -> dict[str, Any]:
    """The keys shardlint sets for a MaxText run outside a training job on `platform`."""
    return {**_OUTSIDE_A_JOB, **(_ON_CPU if platform == "cpu" else {})}


def initialize(keys: dict[str, Any], *, keep_maxtext_xla_flags: bool = False):
    """`pyconfig.initialize` on base.yml with `keys`; MaxText's refusals as one line.

    MaxText's config validation writes `XLA_FLAGS=--xla_dump_to=/tmp/xla_dump/ ...` into
    the environment when it is unset; XLA reads it only if the backend starts later, so it
    would depend on the order of calls. The backend is started first and XLA_FLAGS
    restored after, which keeps the flags out; `keep_maxtext_xla_flags=True` leaves
    MaxText's behaviour as it is.
    """
    MAXTEXT.require()
    import jax
    from maxtext.configs import pyconfig

    if not keep_maxtext_xla_flags:
        jax.devices()  # XLA parses XLA_FLAGS when the backend starts: start it before MaxText
    saved_xla_flags = os.environ.get("XLA_FLAGS")
    try:
        with quiet():
            return pyconfig.initialize([""], **keys)
    except ValueError as e:
        unknown = re.match(r"'(\w+)' not in ", str(e))
        if unknown:
            raise MaxTextError(_unknown_key(unknown.group(1), str(e))) from e
        raise MaxTextError(f"MaxText rejects the config: {_reason(e)}") from e
    except (AssertionError, TypeError) as e:
        raise MaxTextError(f"MaxText rejects the config: {described(e)}") from e
    finally:
        if not keep_maxtext_xla_flags:
            if saved_xla_flags is None:
                os.environ.pop("XLA_FLAGS", None)
            else:
                os.environ["XLA_FLAGS"] = saved_xla_flags


def _mesh(config, devices: list):
    from maxtext.utils import maxtext_utils

    try:
        return maxtext_utils.get_mesh_from_config(config, devices)
    except (AssertionError, ValueError) as e:
        asked = ", ".join(f"{k}={v}" for k, v in _ici_keys(config).items() if v != 1)
        raise MaxTextError(
            f"MaxText cannot lay its mesh over {len(devices)} devices with {asked or 'every ici_* key 1'}: "
            f"the product of the ici_*_parallelism keys (one of them -1 to fill in) must be "
            f"{len(devices)}") from e


def _shaped_inputs(config, mesh):
    """MaxText's shaped (state, batch) and (step, in/out shardings, donation), as
    train_compile.py makes them."""
    with quiet():   # MaxText's modules print notes on stdout as they import
        from maxtext.trainers.pre_train import train, train_compile
        from maxtext.utils import maxtext_utils, sharding

    (state, batch), _kwargs, state_shardings, _annotations, model = (
        train_compile.get_shaped_inputs(mesh, config))
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings)
    input_state_shardings = sharding.build_zero1_input_state_mesh_shardings(
        config, state_shardings, params_shardings)
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    step, in_shardings, out_shardings, _static, donate = (
        maxtext_utils.get_functional_train_with_signature(
            train.train_step, data_sharding, input_state_shardings, model, config,
            params_shardings))
    return state, batch, (step, in_shardings, out_shardings, donate)


def _unknown_key(key: str, message: str) -> str:
    valid = re.findall(r"'(\w+)'", message.split(" not in ", 1)[1])
    return unknown_key("MaxText has no config key", key, valid)


def _ici_keys(config) -> dict[str, int]:
    return {k: v for k, v in config.get_keys().items()
            if k.startswith("ici_") and k.endswith("_parallelism") and isinstance(v, int)}


def _sizes(mesh) -> str:
    return str({k: v for k, v in mesh.shape.items() if v != 1} or {"devices": math.prod(mesh.shape.values())})


def _reason(e: ValueError) -> str:
    """A pydantic validation error as its messages alone (not the whole config it echoes)."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            return "; ".join(str(err.get("msg", "")).removeprefix("Value error, ") for err in errors())
        except Exception:  # not pydantic's errors() after all
            pass
    return one_line(e)


