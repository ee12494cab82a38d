"""MaxText's MoE presets, as shipped, on each of MaxText's MoE paths: what shardlint finds
and what its rewrite does, as a Markdown table (docs/maxtext.md's `maxtext-presets` block).

Each preset is MaxText 0.2.5's own `model_name=...`, shrunk with MaxText's own
`override_model_config=True` to a size 8 simulated CPU devices compile (layers, dims,
experts, vocabulary; every MoE feature kept: tests/support/maxtext_presets.py says which
keys), at data=2 x context=4, seq 128, float32. Per preset and path (dense with a capacity,
dense dropless, sparse) one row, measured in a fresh process (MaxText's imports and compiles
stay out of the next row's memory): the findings (of them, at maxtext/layers/moe.py), the
all-gathers the analysis reports (count, bytes per device) against those in XLA's compiled
HLO text, the temp memory per device before -> after `shardlint.rewrite`, and whether the
rewrite was verified (both steps run on the same random inputs, loss and train state
compared at the step's own tolerance) or why not, and the row's wall time.

    pip install 'shardlint[maxtext]'                   # Python 3.12+
    python benchmarks/maxtext_presets.py                # every preset and path (about 1 hour here)
    python benchmarks/maxtext_presets.py --rows mixtral-8x7b:dropless,gpt-oss-20b:sparse
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout: tests.support.maxtext_presets

from tests.support.maxtext_presets import PATHS, PRESETS, Row  # noqa: E402

MIB = 2 ** 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="preset:path,... (default: every preset on every path)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a row may take (default 1800)")
    parser.add_argument("--row", help=argparse.SUPPRESS)   # one row, in this process: prints its JSON
    args = parser.parse_args(argv)
    try:
        import maxtext  # noqa: F401
    except ImportError:
        print("skip: MaxText is not installed (pip install 'shardlint[maxtext]', Python 3.12+)")
        return 0
    if args.row:
        return _one_row(*args.row.split(":"))
    rows = ([tuple(r.split(":")) for r in args.rows.split(",")] if args.rows
            else [(preset, path) for preset in PRESETS for path in PATHS])
    print("| preset | path | findings (moe.py) | all-gathers: analysis / HLO | temp before -> after | "
          "MoE findings after | rewrite | s |")
    print("|---|---|---|---|---|---|---|---|")
    for preset, path in rows:
        line = _markdown(_in_a_fresh_process(preset, path, args.timeout))
        print(line, flush=True)
        print(f"maxtext_presets: {line}", file=sys.stderr, flush=True)   # progress
    return 0


def _one_row(preset: str, path: str) -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    from tests.support.maxtext_presets import measure

    row = measure(preset, path, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(dataclasses.asdict(row)))
    return 0


def _in_a_fresh_process(preset: str, path: str, timeout: int) -> Row | str:
    # LLVM at -O0 for XLA:CPU's kernels, as in the tests (tests/support/processes.py): the
    # partitioned program and its memory analysis are the same, compiles take 2/3 the time.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | dict(
        JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
    try:
        run = subprocess.run([sys.executable, __file__, "--row", f"{preset}:{path}"], env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{preset} | {path} | not measured: over {timeout} s"
    if run.returncode != 0:   # the error's last line, without its class's module path
        last = ([line for line in run.stderr.splitlines() if line.strip()] or ["no output"])[-1]
        error = re.sub(r"^[\w.]+[.](\w+: )", r"\1", last)
        return f"{preset} | {path} | failed: {error}"
    return Row(**json.loads(run.stdout.splitlines()[-1]))


def _markdown(row: Row | str) -> str:
    if isinstance(row, str):
        return f"| {row} | | | | | |"
    match = "" if row.gathers_match else " (shapes differ)"
    after = "-" if row.temp_after is None else f"{row.temp_after / MIB:.1f}"
    return (f"| {row.preset} | {row.path} | {row.findings} ({row.moe_findings}) | "
            f"{row.gathers} / {row.hlo_gathers}{match}, {row.gather_bytes / MIB:.2f} MiB | "
            f"{row.temp_before / MIB:.1f} -> {after} MiB | "
            f"{'-' if row.moe_findings_after is None else row.moe_findings_after} | "
            f"{_outcome(row.outcome).replace('|', '/')} | {row.seconds:.0f} |")


def _outcome(outcome: str) -> str:
    """The rewrite's outcome in a table cell: a refusal's first sentence (the op, its line
    and why), nothing to rewrite and its reason."""
    if outcome.startswith("refused: "):
        return outcome.split(". ")[0]
    if "nothing to rewrite: " in outcome:
        return "nothing to rewrite: " + outcome.rsplit("nothing to rewrite: ", 1)[1].split(" (")[0].split(";")[0]
    return outcome


if __name__ == "__main__":
    sys.exit(main())
