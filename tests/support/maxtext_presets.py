"""MaxText 0.2.5's MoE presets, as shipped, at a size 8 simulated CPU devices compile: for
tests/integrations/test_maxtext_presets.py and benchmarks/maxtext_presets.py (which imports
it as `tests.support.maxtext_presets` from the repository root).

Each preset is MaxText's own `model_name=...` with MaxText's own way to shrink it
(`override_model_config=True`, then the keys below win over the preset's): fewer layers
(still a whole cycle of the preset's layer pattern), small dims, fewer experts (at least
twice the preset's top-k, which stays), a small vocabulary. Every MoE feature the preset
sets stays as it ships: shared experts, sigmoid routing with a learned bias, normalized
top-k, clamped activations, expert biases, the first dense layers, the layer cycle.
All run at data=2 x context=4, seq 128, one sequence per device, float32, MaxText's
`dot_product` attention, `scan_layers` and remat at MaxText's defaults.

A step is measured as a user runs shardlint on it: `make_step`, `shardlint.analyze`,
`shardlint.rewrite(..., verify=True)` (both steps run on the same random inputs; the loss
and the new train state, whose Adam moments carry the gradients, must match) and
`shardlint.analyze` of the rewritten step. Beside it, what the compiled HLO gathers, read
from `compiled.as_text()` with nothing of shardlint's (lowered in the mesh context MaxText's
own loop lowers it in): the truth the analysis is checked against.
"""

from __future__ import annotations

import dataclasses
import re
import time
import warnings
from collections import Counter
from typing import Any

# Small dims every preset gets; each preset's own keys below come on top.
SMALL = dict(override_model_config=True, base_emb_dim=64, base_mlp_dim=128, base_moe_mlp_dim=128,
             base_num_query_heads=4, base_num_kv_heads=4, head_dim=16, vocab_size=256,
             max_target_length=128, per_device_batch_size=1, dtype="float32", weight_dtype="float32",
             attention="dot_product", ici_data_parallelism=2, ici_context_parallelism=4,
             ici_fsdp_parallelism=1)

# preset -> the keys that shrink it (beside SMALL). The comment says what of the preset stays.
PRESETS: dict[str, dict[str, Any]] = {
    # 8 experts top-2, as shipped
    "mixtral-8x7b": dict(base_num_decoder_layers=2),
    # top-8 with normalized weights, QK-norm; 128 experts -> 16
    "qwen3-30b-a3b": dict(base_num_decoder_layers=2, num_experts=16),
    # MaxText's own small DeepSeek-V3 (MLA, 16 experts top-8, a shared expert, sigmoid routing
    # with a learned bias, routed scaling): one dense layer first, then MoE layers
    "deepseek3-tiny": dict(base_num_decoder_layers=2, first_num_dense_layers=1),
    # one cycle of sliding-window + full attention with sinks, top-4, clamped SwiGLU, expert
    # and router biases; 32 experts -> 8; the window below the sequence so that it slides
    "gpt-oss-20b": dict(base_num_decoder_layers=2, num_experts=8, sliding_window_size=64),
    # one cycle of 4 layers (every 4th without RoPE), every layer MoE with a shared expert,
    # top-1; 16 experts -> 8; the chunked-attention window below the sequence
    "llama4-17b-16e": dict(base_num_decoder_layers=4, num_experts=8, chunk_attn_window_size=64),
    # (last: the slowest) one cycle of 3 gated delta-net layers + 1 full attention, a shared
    # expert, top-10; 512 experts -> 20. Gated delta-net reads device order as sequence order.
    "qwen3-next-80b-a3b": dict(base_num_decoder_layers=4, num_experts=20, context_parallel_load_balance=False),
}

# MaxText's MoE paths: the dense one with a token capacity, the dense one without
# (dropless), and the sparse one (sort by expert, grouped matmul; ragged_dot on CPU).
PATHS: dict[str, dict[str, Any]] = {
    "capacity": dict(sparse_matmul=False, capacity_factor=1.25),
    "dropless": dict(sparse_matmul=False, capacity_factor=-1),
    "sparse": dict(sparse_matmul=True, capacity_factor=-1),
}


# Paths MaxText's own config refuses for a preset: its words.
NO_SUCH_PATH: dict[tuple[str, str], str] = {
    ("gpt-oss-20b", "capacity"): "GPT-OSS MoE only supports dropless (capacity_factor=-1) with dense matmul",
    ("llama4-17b-16e", "capacity"): "Llama4 decoder has not been tested with capacity_factor >= 0",
}


def config(preset: str, path: str) -> dict[str, Any]:
    """The keys for `make_step`: the preset, shrunk, on `path`."""
    return dict(SMALL, model_name=preset, **PRESETS[preset], **PATHS[path])


# `%name = f32[2,64]{1,0} all-gather(...)`, `%s = (f32[..], f32[..]) all-gather-start(...)`:
# one all-gather each (an async pair's `-done` is the same one).
_ALL_GATHER = re.compile(r"=\s+(\([^)]*\)|\S+)\s+all-gather(?:-start)?\(")


def hlo_all_gathers(compiled_text: str) -> Counter:
    """The all-gathers of a compiled (partitioned) HLO module's text: result shape (layouts
    dropped) -> how many."""
    return Counter(_shape(m.group(1)) for m in _ALL_GATHER.finditer(compiled_text))


def compiled_as_maxtext_runs_it(fn, args) -> str:
    """The compiled HLO text of the step, lowered inside `jax.set_mesh(mesh)` as MaxText's
    own loop (train.py) and AOT compile (train_compile.py) lower it: some presets' steps
    (gpt-oss, Llama 4) read the mesh in context and lower to another program without it."""
    import jax
    from shardlint.analyzer.compile._compile import mesh_of

    with jax.set_mesh(mesh_of(args)):
        return fn.lower(*args).compile().as_text()


def analysis_all_gathers(analysis) -> Counter:
    """The same count from an analysis's collectives."""
    return Counter(_shape(c.shape) for c in analysis.all_gathers())


def _shape(text: str) -> str:
    return re.sub(r"\{[^}]*\}", "", text).strip("() ").replace(" ", "")


def moe_findings(analysis) -> list:
    return [f for f in analysis.findings if f.source and f.source.file.endswith("maxtext/layers/moe.py")]


@dataclasses.dataclass(frozen=True)
class Row:
    preset: str
    path: str
    findings: int
    moe_findings: int                 # of them, at maxtext/layers/moe.py
    gathers: int                      # all-gathers the analysis reports
    gather_bytes: int                 # bytes they move per device
    hlo_gathers: int                  # all-gathers in the compiled HLO text
    gathers_match: bool               # the same result shapes, as many of each
    temp_before: int
    temp_after: int | None            # None: not rewritten
    moe_findings_after: int | None
    gathers_after: int | None
    outcome: str                      # "verified", "refused: ..." or NothingToRewrite's words
    seconds: float


def measure(preset: str, path: str, progress=None) -> Row:
    """Builds, analyzes, rewrites and verifies one preset on one path (see the module doc)."""
    import shardlint
    from shardlint.analyzer.compile._compile import mesh_of
    from shardlint.integrations import maxtext

    start = time.perf_counter()
    fn, args = maxtext.make_step(**config(preset, path))
    before = shardlint.analyze(fn, *args)
    truth = hlo_all_gathers(compiled_as_maxtext_runs_it(fn, args))
    after = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", shardlint.NothingToRewrite)
        try:
            fixed = shardlint.rewrite(fn, mesh_of(args), args=args, analysis=before, verify=True,
                                      progress=progress)
        except shardlint.RewriteError as e:
            outcome = "refused: " + " ".join(str(e).split())
        else:
            if fixed.changed:
                after = shardlint.analyze(fixed, *args)
                outcome = "verified"
            else:   # NothingToRewrite's own words: "shardlint.rewrite: nothing to rewrite: ..."
                outcome = "; ".join(" ".join(str(w.message).split()) for w in caught
                                    if w.category is shardlint.NothingToRewrite)
    gathers = before.all_gathers()
    return Row(preset, path, len(before.findings), len(moe_findings(before)), len(gathers),
               sum(c.bytes for c in gathers), sum(truth.values()), analysis_all_gathers(before) == truth,
               before.memory.temp_bytes, after and after.memory.temp_bytes,
               after and len(moe_findings(after)), after and len(after.all_gathers()), outcome,
               time.perf_counter() - start)
