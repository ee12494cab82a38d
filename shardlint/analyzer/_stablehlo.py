"""What the user asked for, read from the lowered StableHLO with jaxlib's MLIR bindings.

A resharding the user wrote (`with_sharding_constraint`, a `shard_map`'s specs) is not a
lost sharding. XLA's propagated HLO does not always keep it as an op of its own (Shardy
exports a constraint as a plain `copy`, and may fold it away), while the lowered module
has every `sdy.sharding_constraint` and `sdy.manual_computation` with its source location.
This module walks that module (no text parsing: sdy attributes through the sdy bindings,
locations through `ir.Location`) and returns the source lines where the user asked for a
sharding, which the detector uses to tell requested from lost.
"""

from __future__ import annotations

import dataclasses
import re

from jax._src.lib.mlir.dialects import sdy

_ASKING_OPS = ("sdy.sharding_constraint", "sdy.reshard", "sdy.manual_computation")


@dataclasses.dataclass(frozen=True)
class Asked:
    op: str                          # "sharding_constraint", "reshard" or "shard_map"
    file: str
    line: int
    dims: tuple[tuple[str, ...], ...]  # mesh axes per dimension (first value for shard_map)


def asked_for(module) -> tuple[Asked, ...]:
    """Every sharding the user asked for in a lowered module (`lowered.compiler_ir()`)."""
    found = []
    for op in _walk(module.operation):
        if op.name not in _ASKING_OPS:
            continue
        where = _file_line(op.location)
        if where is None:
            continue
        if op.name == "sdy.manual_computation":
            found.append(Asked("shard_map", *where, _first_in_sharding(op)))
        else:
            dims = _dims(op.attributes["sharding"]) if "sharding" in op.attributes else ()
            found.append(Asked(op.name.split(".", 1)[1], *where, dims))
    return tuple(found)


def _walk(op):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner.operation
                yield from _walk(inner.operation)


def _dims(attr) -> tuple[tuple[str, ...], ...]:
    sharding = sdy.TensorShardingAttr(attr)
    return tuple(tuple(sdy.AxisRefAttr(axis).name for axis in sdy.DimensionShardingAttr(dim).axes)
                 for dim in sharding.dimension_shardings)


def _first_in_sharding(op) -> tuple[tuple[str, ...], ...]:
    shardings = op.attributes["in_shardings"] if "in_shardings" in op.attributes else None
    if shardings is None:
        return ()
    per_value = sdy.TensorShardingPerValueAttr(shardings).shardings
    return _dims(per_value[0]) if len(per_value) else ()


def _file_line(location) -> tuple[str, int] | None:
    """The innermost file:line of a location (name(callsite(callee at caller)))."""
    m = re.search(r'"([^"]+)":(\d+):\d+', str(location))
    return (m.group(1), int(m.group(2))) if m else None
