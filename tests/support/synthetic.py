"""An unrolled 48-layer model's collectives, as the analyzer would list them: what the report
must render small and grouped (tests/reports/test_report_scale.py) and what
benchmarks/report_render.py times."""

from __future__ import annotations

import dataclasses

from shardlint.analyzer import Analysis, Collective, Source

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")


def many_collectives(base: Analysis, layers: int = 48, per_layer: int = 104, drop: int = 0) -> Analysis:
    """`base` with the collectives of an unrolled `layers`-layer model: `per_layer` a layer
    from the same code (one collective key each, so one row with a count), a few whose shape
    depends on the layer, and every `drop`-th site left out (the after side of a fix)."""
    collectives = []
    for layer in range(layers):
        for site in range(per_layer):
            if drop and site % drop == 0:
                continue
            unique = site < 4  # a few collectives whose shape depends on the layer
            collectives.append(Collective(
                id=f"{KINDS[site % 4]}.{layer * per_layer + site}", kind=KINDS[site % 4],
                axes=("data", "context")[: 1 + site % 2], bytes=4096 * (1 + site % 13),
                result_bytes=8192 * (1 + site % 13),
                shape=f"bf16[{8 + (layer if unique else 0)},{1024 + site}]",
                op_path=f"jit(train_step)/transpose(jvp(decoder))/layer/mlp_{site}/dot_general",
                source=Source("/srv/project/model/decoder.py", 200 + site, f"block_{site % 17}"),
                is_async=site % 3 == 0, in_loop=False))
    return dataclasses.replace(base, collectives=tuple(collectives))
