"""Hand MaxText's training loop the rewritten step, for the one call that jits it.

MaxText's `train_loop` (maxtext/trainers/pre_train/train.py) gets its jitted train and eval
steps from `maxtext.utils.train_utils.jit_train_and_eval_step(...)`, looked up on the
module when it runs, then lowers, compiles and calls what it got back. `handed_over` puts a
function of the same signature there for as long as it is entered (and puts MaxText's back
when it leaves, whatever happens): it calls MaxText's own, then passes each step through
`shardlint.analyze` and `shardlint.rewrite` on the arguments MaxText lowers it with (the
train state as it is, a batch shaped by `maxtext_utils.get_shaped_batch` with MaxText's
input sharding), under the logical axis rules the loop calls it with. A rewritten step is
compiled once, there, as the loop compiles it (mesh, rules, compiler options): JAX keeps
that executable, so the loop's own compile and its calls reuse it, and a step costs one
compile more than in MaxText's loop (the analysis of MaxText's). Nothing else in MaxText
is touched: its data pipeline, optimizer, checkpoints and logs run as they are.

What each step became is a `Fixed` record; `Fixed.line()` renders it for people.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
from typing import Callable, Iterator

from ..._errors import NothingToRewrite, RewriteError, first_line
from ..._format import human_bytes, progress
from ...jaxpr import equations
from ._target import MaxTextError


@dataclasses.dataclass(frozen=True)
class Options:
    """What shardlint does to MaxText's steps (the `shardlint_*` keys)."""

    per_shard_capacity: bool = False   # a capacity computed from the tokens runs per shard
    verify: bool = False               # run both steps once on random inputs and compare


@dataclasses.dataclass(frozen=True)
class Fixed:
    """One of MaxText's steps before and after the rewrite."""

    step: str                 # "train" or "eval"
    temp_before: int          # XLA's temp bytes per device, the step as MaxText jits it
    temp_after: int | None    # ... and rewritten; None when nothing was rewritten
    regions: int              # routed regions that run per shard (shard_maps the rewrite added)
    unchanged: str | None = None   # why nothing was rewritten

    def line(self) -> str:
        before = f"shardlint: MaxText's {self.step} step, XLA's temp per device: {human_bytes(self.temp_before)}"
        if self.temp_after is None:
            return f"{before} as MaxText compiles it, not rewritten; 0 routed regions run per shard ({self.unchanged})"
        regions = "1 routed region now runs" if self.regions == 1 else f"{self.regions} routed regions now run"
        return f"{before} as MaxText compiles it, {human_bytes(self.temp_after)} fixed; {regions} per shard"


@contextlib.contextmanager
def handed_over(options: Options, on_fixed: Callable[[Fixed], None]) -> Iterator[None]:
    """While entered, MaxText's `train_utils.jit_train_and_eval_step` returns its steps
    rewritten; `on_fixed` hears what became of each."""
    from maxtext.utils import train_utils

    original = train_utils.jit_train_and_eval_step
    train_utils.jit_train_and_eval_step = _rewriting(original, options, on_fixed)
    try:
        yield
    finally:
        train_utils.jit_train_and_eval_step = original


def _rewriting(original: Callable, options: Options, on_fixed: Callable[[Fixed], None]) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def jit_train_and_eval_step(*args, **kwargs):
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        config, mesh, state = (given.arguments[k] for k in ("config", "mesh", "state"))
        # MaxText's own test for an eval step (`if eval_data_iterator:`), before it jits one
        _refuse_unreached(config, has_eval=bool(given.arguments["eval_data_iterator"]))
        train_step, eval_step = original(*args, **kwargs)
        compiler_options = _compiler_options(config)
        train_step = _fix(train_step, "train", mesh, (state, _batch(config, mesh, is_eval=False)),
                          config.logical_axis_rules, compiler_options, options, on_fixed)
        if eval_step is not None:
            eval_step = _fix(eval_step, "eval", mesh, (state, _batch(config, mesh, is_eval=True)),
                             config.logical_axis_rules_for_eval, compiler_options, options, on_fixed)
        return train_step, eval_step

    return jit_train_and_eval_step


def _refuse_unreached(config, *, has_eval: bool) -> None:
    """Configs whose loop runs a step this hand-over does not see, or none it could rewrite
    (train_loop's `if` around each other jit)."""
    unreached = [
        ("enable_diloco=true", config.enable_diloco, "DiLoCo wraps the step in its own outer loop"),
        ("compiled_trainstep_file", config.compiled_trainstep_file != "",
         "MaxText loads a step compiled beforehand, which cannot be rewritten"),
        ("moe_dropless_fallback=step", config.moe_dropless_fallback == "step",
         "MaxText jits its dropless retry and first-phase programs as well"),
        ("eval_ragged_buffer_factor > 0", config.eval_ragged_buffer_factor > 0 and has_eval,
         "MaxText jits its eval step again from another graph"),
    ]
    said = [f"{key} ({why})" for key, on, why in unreached if on]
    if said:
        raise MaxTextError(f"shardlint's training runner does not rewrite this config's steps: "
                           f"{'; '.join(said)}; run MaxText's own trainer for it")


def _batch(config, mesh, *, is_eval: bool):
    """The batch MaxText lowers its step with: shapes from `get_shaped_batch`, sharded as
    its input pipeline shards them (train_loop does the same)."""
    import jax
    from flax.core.spmd import logical_axis_rules
    from maxtext.utils import maxtext_utils, sharding

    rules = config.logical_axis_rules_for_eval if is_eval else config.logical_axis_rules
    with jax.set_mesh(mesh), logical_axis_rules(rules):
        data_sharding = sharding.get_input_data_sharding(config, mesh, rules=rules)
        return maxtext_utils.get_shaped_batch(config, batch_sharding=data_sharding, is_eval=is_eval)


def _compiler_options(config) -> dict:
    """The compiler options `train_loop` compiles its steps with (`compile_xla_flags`)."""
    from maxtext.utils import max_utils

    return max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags)


def _fix(step, name: str, mesh, args: tuple, rules, compiler_options: dict, options: Options,
         on_fixed: Callable[[Fixed], None]):
    """`step` rewritten (or `step` itself when nothing needs it), said to `on_fixed`."""
    from flax.core.spmd import logical_axis_rules

    import shardlint

    capacity = "per-shard" if options.per_shard_capacity else "global"
    with logical_axis_rules(rules):   # MaxText's constraints name logical axes
        progress(f"analyzing MaxText's {name} step")
        before = shardlint.analyze(step, *args, params_argnums=(0,), progress=progress)
        with warnings.catch_warnings():   # said in the summary line instead
            warnings.simplefilter("ignore", NothingToRewrite)
            try:
                fixed = shardlint.rewrite(step, mesh, args=args, analysis=before, verify=options.verify,
                                          capacity=capacity, params_argnums=(0,), progress=progress)
            except RewriteError as e:
                raise RewriteError(f"the rewrite of MaxText's {name} step was refused: {e}") from e
        if not fixed.changed:
            on_fixed(Fixed(name, before.memory.temp_bytes, None, 0,
                           unchanged=fixed.notes[-1] if fixed.notes else "nothing to rewrite"))
            return step
        regions = _shard_maps(fixed.trace(*args).jaxpr.jaxpr) - _shard_maps(step.trace(*args).jaxpr.jaxpr)
    temp_after = _compiled_as_maxtext_does(fixed, name, mesh, args, rules, compiler_options)
    on_fixed(Fixed(name, before.memory.temp_bytes, temp_after, regions))
    return fixed


def _compiled_as_maxtext_does(fixed, name: str, mesh, args: tuple, rules, compiler_options: dict) -> int:
    """XLA's temp bytes per device of the rewritten step, compiled once as `train_loop`
    compiles it (its mesh and rules in context, its compiler options, the same shaped
    arguments): JAX keeps that compile, and the loop's own compile and its calls reuse it."""
    import jax
    from flax.core.spmd import logical_axis_rules

    progress(f"compiling the rewritten {name} step")
    with jax.set_mesh(mesh), logical_axis_rules(rules):
        lowered = fixed.lower(*args)
        try:
            compiled = lowered.compile(compiler_options=compiler_options)
        except Exception as e:   # XLA's refusal (out of memory, say): MaxText's compile would fail alike
            raise RewriteError(f"MaxText's {name} step rewritten does not compile: {first_line(e)}") from e
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _shard_maps(jaxpr) -> int:
    """How many `shard_map` equations `jaxpr` holds, at every depth."""
    return sum(eqn.primitive.name == "shard_map" for eqn in equations(jaxpr))
