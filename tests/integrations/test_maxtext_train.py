"""`python -m shardlint.integrations.maxtext.train`: MaxText's own training loop, with the
steps it jits rewritten so that the routed MoE runs per shard.

The default tests check the wiring: which arguments are shardlint's (`shardlint_*=` keys)
and which MaxText's, the mistakes said in one line, the summary line's wording from its
record, and that MaxText's `jit_train_and_eval_step` is handed over only while the runner
holds it. The `slow` tests run MaxText's own trainer and the runner once each on the same
command line (a 2-layer mixtral at data=2 x context=4, 8 simulated CPU devices, the dense
dropless path, an eval every 2 steps), compare the losses they log, step by step, and count
the compiles of each step that JAX logs (`JAX_LOG_COMPILES=1`).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import types

import pytest

from shardlint import UsageError
from shardlint.integrations.maxtext import MaxTextError
from shardlint.integrations.maxtext._command import main, split
from shardlint.integrations.maxtext._handover import Fixed, Options, _refuse_unreached
from support.processes import FAST_KERNELS, user_env

HAS_MAXTEXT = importlib.util.find_spec("maxtext") is not None
needs_maxtext = pytest.mark.skipif(not HAS_MAXTEXT, reason="MaxText is not installed: "
                                   "pip install -e '.[maxtext]' (Python 3.12+)")
MIB = 1 << 20


def test_shardlint_keys_are_taken_out_of_maxtexts_command_line():
    options, rest = split(["base.yml", "run_name=a", "shardlint_verify=true", "steps=3",
                           "--alsologtostderr", "shardlint_per_shard_capacity=False"])
    assert options == Options(per_shard_capacity=False, verify=True)
    assert rest == ["base.yml", "run_name=a", "steps=3", "--alsologtostderr"]   # MaxText's, in order
    assert split(["base.yml", "shardlint_per_shard_capacity=TRUE"])[0] == Options(per_shard_capacity=True)
    assert split(["base.yml", "steps=3"]) == (Options(), ["base.yml", "steps=3"])


@pytest.mark.parametrize("argv, said", [
    (["shardlint_verfy=true"], "shardlint has no key 'shardlint_verfy' (did you mean shardlint_verify?); "
                               "its keys are shardlint_per_shard_capacity, shardlint_verify"),
    (["shardlint_verify"], "shardlint_verify needs a value: shardlint_verify=true or shardlint_verify=false"),
    (["shardlint_verify=maybe"], "shardlint_verify=maybe: expected shardlint_verify=true or shardlint_verify=false"),
    (["shardlint_verify=true", "shardlint_verify=false"], "shardlint_verify is given twice"),
    (["shardlint_verify=true", "shardlint_per_shard_capacity=true"],
     "shardlint_verify=true cannot check shardlint_per_shard_capacity=true"),
])
def test_shardlint_key_mistakes_are_one_line_and_exit_2(argv, said, capsys):
    with pytest.raises(UsageError, match=re.escape(said)):
        split(["base.yml", *argv])
    assert main(["base.yml", "steps=3", *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("shardlint: error: ") and said in err[0], err


def test_every_mistake_is_said_at_once(capsys):
    assert main(["base.yml", "shardlint_verfy=true", "shardlint_per_shard_capacity=2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert "'shardlint_verfy'" in err[0] and "shardlint_per_shard_capacity=2: expected" in err[0]


def test_usage(capsys):
    assert main([]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m shardlint.integrations.maxtext.train <config.yml>")
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "shardlint_per_shard_capacity=true" in out and "shardlint_verify=true" in out


def test_summary_line_from_its_record():
    assert Fixed("train", int(7.15 * MIB), int(7.12 * MIB), 2).line() == (
        "shardlint: MaxText's train step, XLA's temp per device: 7.15 MiB as MaxText compiles it, "
        "7.12 MiB fixed; 2 routed regions now run per shard")
    assert Fixed("eval", int(2.33 * MIB), int(2.32 * MIB), 1).line().endswith(
        "2.32 MiB fixed; 1 routed region now runs per shard")
    assert Fixed("train", int(12.47 * MIB), None, 0, unchanged="nothing to rewrite: no routing op").line() == (
        "shardlint: MaxText's train step, XLA's temp per device: 12.47 MiB as MaxText compiles it, "
        "not rewritten; 0 routed regions run per shard (nothing to rewrite: no routing op)")


def _config(**keys):
    base = dict(enable_diloco=False, compiled_trainstep_file="", moe_dropless_fallback=None,
                eval_ragged_buffer_factor=-1.0)
    return types.SimpleNamespace(**{**base, **keys})


def test_configs_whose_loop_jits_steps_out_of_reach_are_refused():
    _refuse_unreached(_config(), has_eval=True)
    _refuse_unreached(_config(eval_ragged_buffer_factor=2.0), has_eval=False)   # no eval: no second jit
    with pytest.raises(MaxTextError, match=r"enable_diloco=true \(DiLoCo .*; moe_dropless_fallback=step "
                                           r"\(.*dropless retry.*\); run MaxText's own trainer for it"):
        _refuse_unreached(_config(enable_diloco=True, moe_dropless_fallback="step"), has_eval=False)
    with pytest.raises(MaxTextError, match=r"eval_ragged_buffer_factor > 0 \(MaxText jits its eval step again"):
        _refuse_unreached(_config(eval_ragged_buffer_factor=2.0), has_eval=True)
    with pytest.raises(MaxTextError, match=r"compiled_trainstep_file \(MaxText loads a step compiled beforehand"):
        _refuse_unreached(_config(compiled_trainstep_file="step.pickle"), has_eval=False)


@pytest.fixture
def jax_as_it_was():
    """MaxText's trainer, when imported, replaces `jax.lax.top_k` and
    `jax.lax.with_sharding_constraint` for the whole process (its tunix adapter)."""
    import jax

    saved = jax.lax.top_k, jax.lax.with_sharding_constraint
    yield
    jax.lax.top_k, jax.lax.with_sharding_constraint = saved


@pytest.mark.parametrize("fail", [False, True], ids=["left", "raised"])
@pytest.mark.usefixtures("jax_as_it_was")
@pytest.mark.maxtext
@needs_maxtext
def test_maxtexts_function_is_handed_over_only_while_held(fail):
    from maxtext.utils import train_utils

    from shardlint.integrations.maxtext._handover import handed_over

    own = train_utils.jit_train_and_eval_step
    with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
        with handed_over(Options(), [].append):
            held = train_utils.jit_train_and_eval_step
            assert held is not own and held.__wrapped__ is own and held.__name__ == own.__name__
            if fail:
                raise RuntimeError("MaxText's loop stopped")
    assert train_utils.jit_train_and_eval_step is own


# The config: a small mixtral, data=2 x context=4, the dense dropless path.
LOOP = ("hardware=cpu dataset_type=synthetic steps=3 enable_checkpointing=false "
        "skip_jax_distributed_system=true ici_data_parallelism=2 ici_context_parallelism=4 "
        "ici_fsdp_parallelism=1 sparse_matmul=false capacity_factor=-1 decoder_block=mixtral "
        "base_num_decoder_layers=2 base_emb_dim=64 base_mlp_dim=128 base_moe_mlp_dim=128 num_experts=8 "
        "num_experts_per_tok=2 base_num_query_heads=4 base_num_kv_heads=4 head_dim=16 vocab_size=256 "
        "max_target_length=128 per_device_batch_size=1 dtype=float32 weight_dtype=float32 megablox=false "
        "use_tokamax_gmm=false attention=dot_product jax_cache_dir= eval_interval=2 eval_steps=1").split()
LOSS = re.compile(r"completed step: (\d+), .*?\bloss: ([\d.]+),")   # not lm_loss
EVAL_LOSS = re.compile(r"Completed eval after train step (\d+), loss=([\d.]+),")
COMPILED = re.compile(r"Finished XLA compilation of jit\((train|eval)_step\)")   # JAX_LOG_COMPILES=1


def _loop(module: str, tmp_path, run_name: str) -> subprocess.CompletedProcess:
    base = os.path.join(importlib.util.find_spec("maxtext").submodule_search_locations[0], "configs", "base.yml")
    env = user_env(f"{FAST_KERNELS} --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
                   JAX_LOG_COMPILES="1")
    return subprocess.run([sys.executable, "-m", module, base, f"run_name={run_name}",
                           f"base_output_directory={tmp_path}", *LOOP],
                          capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def loops(tmp_path_factory) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """MaxText's own trainer, then the runner, on LOOP: one to two minutes for both here (2 CPU
    cores; the runner analyzes, rewrites and compiles each step before MaxText's loop runs)."""
    tmp_path = tmp_path_factory.mktemp("loops")
    own = _loop("maxtext.trainers.pre_train.train", tmp_path, "maxtext")
    assert own.returncode == 0, own.stderr[-3000:]
    ran = _loop("shardlint.integrations.maxtext.train", tmp_path, "shardlint")
    assert ran.returncode == 0, ran.stderr[-3000:]
    return own, ran


@pytest.mark.slow
@pytest.mark.maxtext
@needs_maxtext
def test_maxtexts_loop_logs_the_same_losses_rewritten(loops):
    own, ran = loops
    summary = [line for line in ran.stdout.splitlines() if line.startswith("shardlint: ")]
    assert len(summary) == 2, ran.stdout
    assert re.fullmatch(r"shardlint: MaxText's train step, XLA's temp per device: [\d.]+ MiB as MaxText "
                        r"compiles it, [\d.]+ MiB fixed; [1-9]\d* routed regions? now runs? per shard", summary[0])
    assert summary[1].startswith("shardlint: MaxText's eval step") and "now run" in summary[1], summary[1]
    for pattern, count in ((LOSS, 3), (EVAL_LOSS, 2)):
        theirs, ours = pattern.findall(own.stderr), pattern.findall(ran.stderr)
        assert len(theirs) == count and ours == theirs, (theirs, ours)


@pytest.mark.slow
@pytest.mark.maxtext
@needs_maxtext
def test_the_runner_compiles_each_step_once_more_than_maxtexts_loop(loops):
    """The analysis of MaxText's step is the one compile more; the rewritten step is compiled
    once, as the loop compiles it, and the loop's own compile and its calls reuse that one
    (before: 3 compiles of each step to MaxText's 1, the rewritten step analyzed as well)."""
    own, ran = (collections.Counter(COMPILED.findall(loop.stderr)) for loop in loops)
    assert own["train"] >= 1 and own["eval"] >= 1, own   # JAX logged MaxText's compiles
    assert ran["train"] <= own["train"] + 1 and ran["eval"] <= own["eval"] + 1, (own, ran)
