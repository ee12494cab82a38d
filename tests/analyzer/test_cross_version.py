"""The same program gives the same analysis on every JAX version CI runs (0.10 and 0.12).

Each run writes a version-free signature of the example steps' analyses into the folder
named by SHARDLINT_CROSS_VERSION_DIR (`.ci/run` sets it for both environments) and
compares it with every signature a run on another JAX version left there. The first
environment has nothing to compare with yet and says so; the second asserts agreement.
"""

from __future__ import annotations

import json
import os

import jax
import pytest

from support import example_analyses

STEPS = ["make_step", "make_dense_step", "make_attention_step", "make_per_shard_step",
         "make_qwen3_style_step"]


def signature() -> dict:
    out = {}
    for name in STEPS:
        a = example_analyses.analysis(name, 4)  # shared with test_detect: compiled once
        by_id = {c.id: c for c in a.collectives}
        out[name] = {
            "findings": sorted(
                [f.op, list(f.axes), os.path.basename(f.source.file), f.source.line, f.feeds_grouped_matmul,
                 sorted([by_id[i].kind, list(by_id[i].axes), by_id[i].shape] for i in f.collectives)]
                for f in a.findings),
            "collectives": sorted([c.kind, list(c.axes), c.shape] for c in a.collectives),
            "all_gather_lines": sorted(c.source.line for c in a.all_gathers() if c.source),
            "requested": sorted([r.op, list(r.axes), r.source.line] for r in a.requested),
        }
    return out


def test_analysis_agrees_across_jax_versions():
    folder = os.environ.get("SHARDLINT_CROSS_VERSION_DIR")
    if not folder:
        pytest.skip("SHARDLINT_CROSS_VERSION_DIR is not set (.ci/run sets it for both environments)")
    os.makedirs(folder, exist_ok=True)
    mine = signature()
    with open(os.path.join(folder, f"jax-{jax.__version__}.json"), "w") as fh:
        json.dump(mine, fh, indent=1, sort_keys=True)
    others = [f for f in os.listdir(folder) if f.startswith("jax-") and f != f"jax-{jax.__version__}.json"]
    if not others:
        pytest.skip(f"no other JAX version's analysis in {folder} yet (this is jax {jax.__version__})")
    for other in others:
        with open(os.path.join(folder, other)) as fh:
            theirs = json.load(fh)
        for name in STEPS:
            assert mine[name] == theirs[name], f"{name}: jax {jax.__version__} vs {other}"
