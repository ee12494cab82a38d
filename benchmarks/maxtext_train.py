"""MaxText's own training loop against shardlint's runner: time to the first step, compiles.

Both commands run as a user runs them, on the same arguments (docs/maxtext.md's loop: a
2-layer mixtral at data=2 x context=4 on 8 simulated CPU devices, the dense dropless path,
3 steps; `key=value` arguments here are added to MaxText's): `python -m
maxtext.trainers.pre_train.train ...` and `python -m shardlint.integrations.maxtext.train
...`, one after the other, --repeats times. Printed per run: the wall seconds from launching
the command to MaxText's `completed step: 0` line (MaxText logs it once that step's loss is
on the host), the whole run's seconds, and the compiles of the train step that JAX logged
(`JAX_LOG_COMPILES=1`: `Finished XLA compilation of jit(train_step)`); then the medians and
the runner's extra seconds to the first step.

    .venv312/bin/python benchmarks/maxtext_train.py [--repeats 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {"MaxText": "maxtext.trainers.pre_train.train", "shardlint": "shardlint.integrations.maxtext.train"}
# docs/maxtext.md's loop (docs/regenerate.py runs it from here)
LOOP = ("hardware=cpu dataset_type=synthetic steps=3 enable_checkpointing=false "
        "skip_jax_distributed_system=true ici_data_parallelism=2 ici_context_parallelism=4 "
        "ici_fsdp_parallelism=1 sparse_matmul=false capacity_factor=-1 decoder_block=mixtral "
        "base_num_decoder_layers=2 base_emb_dim=64 base_mlp_dim=128 base_moe_mlp_dim=128 "
        "num_experts=8 num_experts_per_tok=2 base_num_query_heads=4 base_num_kv_heads=4 head_dim=16 "
        "vocab_size=256 max_target_length=128 per_device_batch_size=1 dtype=float32 "
        "weight_dtype=float32 megablox=false use_tokamax_gmm=false attention=dot_product jax_cache_dir=")
FIRST_STEP = "completed step: 0,"
COMPILED = re.compile(r"Finished XLA compilation of jit\(train_step\)")


def run(module: str, keys: list[str]) -> tuple[float, float, int]:
    """(seconds to the first step, seconds in all, train-step compiles) of one command."""
    base = os.path.join(importlib.util.find_spec("maxtext").submodule_search_locations[0], "configs", "base.yml")
    folder = tempfile.mkdtemp(prefix="shardlint-train-")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               JAX_LOG_COMPILES="1")
    command = [sys.executable, "-m", module, base, "run_name=bench", f"base_output_directory={folder}",
               *LOOP.split(), *keys]
    start = time.perf_counter()
    first, compiles, tail = None, 0, []
    with subprocess.Popen(command, cwd=folder, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT) as process:
        for line in process.stdout:
            if first is None and FIRST_STEP in line:
                first = time.perf_counter() - start
            compiles += bool(COMPILED.search(line))
            tail = [*tail[-20:], line]
    total = time.perf_counter() - start
    if process.returncode != 0 or first is None:
        raise SystemExit(f"{module} exited {process.returncode}"
                         + ("" if first else " before step 0") + ":\n" + "".join(tail))
    return first, total, compiles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    opts, keys = parser.parse_known_args()
    if importlib.util.find_spec("maxtext") is None:
        raise SystemExit("MaxText is not installed: pip install -e '.[maxtext]' (Python 3.12+)")
    print(f"{'run':<16} {'first step s':>12} {'all s':>7} {'train-step compiles':>20}")
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in COMMANDS}
    for i in range(opts.repeats):
        for name, module in COMMANDS.items():
            results[name].append(run(module, keys))
            first, total, compiles = results[name][-1]
            print(f"{name + ' ' + str(i + 1):<16} {first:12.1f} {total:7.1f} {compiles:>20}", flush=True)
    medians = {name: [statistics.median(r[k] for r in runs) for k in range(3)] for name, runs in results.items()}
    for name, (first, total, compiles) in medians.items():
        print(f"{name + ' median':<16} {first:12.1f} {total:7.1f} {compiles:>20g}")
    extra = medians["shardlint"][0] - medians["MaxText"][0]
    print(f"the runner reaches step 0 {extra:.1f} s after MaxText's loop "
          f"({medians['shardlint'][0] / medians['MaxText'][0]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
