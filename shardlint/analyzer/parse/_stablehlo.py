"""What the user asked for, read from the lowered StableHLO with jaxlib's MLIR bindings.

A resharding the user wrote (`with_sharding_constraint`, a `shard_map`'s specs) is not a
lost sharding. XLA's propagated HLO does not always keep it as an op of its own (Shardy
exports a constraint as a plain `copy`, and may fold it away), while the lowered module
has every `sdy.sharding_constraint` and `sdy.manual_computation` with its source location.
This module walks that module (no text parsing: sdy attributes through the sdy bindings,
locations through the typed `ir.Location` classes) and returns where the user asked for a
sharding, with the whole Python stack, which the detector uses to tell requested from lost.
"""

from __future__ import annotations

import dataclasses

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import sdy

_ASKING_OPS = ("sdy.sharding_constraint", "sdy.reshard", "sdy.manual_computation")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Asked:
    op: str                          # "sharding_constraint", "reshard" or "shard_map"
    file: str                        # the innermost frame of `stack`
    line: int
    dims: tuple[tuple[str, ...], ...]  # mesh axes per dimension (first value for shard_map)
    stack: tuple[tuple[str, int], ...] = ()  # (file, line), innermost frame first
    shape: tuple[int, ...] = ()      # global shape of the (first) result


def asked_for(module) -> tuple[Asked, ...]:
    """Every sharding the user asked for in a lowered module (`lowered.compiler_ir()`)."""
    found = []
    for op in _walk(module.operation):
        if op.name not in _ASKING_OPS:
            continue
        stack = location_stack(op.location)
        if not stack:
            continue
        if op.name == "sdy.manual_computation":
            kind, dims = "shard_map", _first_in_sharding(op)
        else:
            kind = op.name.split(".", 1)[1]
            dims = _dims(op.attributes["sharding"]) if "sharding" in op.attributes else ()
        file, line = stack[0]
        found.append(Asked(op=kind, file=file, line=line, dims=dims, stack=stack, shape=_shape(op)))
    return tuple(found)


def op_stack(module, hlo_opcode: str) -> tuple[tuple[str, int], ...]:
    """The (file, line) frames of the first op of a lowered module that XLA's `hlo_opcode`
    (`ragged-all-to-all`) is made from: the StableHLO op of that name, or a custom call of
    that target (JAX lowers `ragged_all_to_all` to one); () where none has a location."""
    name = hlo_opcode.replace("-", "_")
    for op in _walk(module.operation):
        target = op.attributes["call_target_name"] if "call_target_name" in op.attributes else None
        if op.name == f"stablehlo.{name}" or (target is not None and ir.StringAttr(target).value == name):
            stack = location_stack(op.location)
            if stack:
                return stack
    return ()


def location_stack(location) -> tuple[tuple[str, int], ...]:
    """The (file, line) frames of an MLIR location, innermost first.

    JAX writes `name(callsite(callee at callsite(... at caller)))`; a `fused[...]` location
    merges ops, and its first part that has frames stands for it. jaxlib's bindings hand
    back the typed subclass (`NameLoc`, `CallSiteLoc`, ...) in JAX 0.10.2 and 0.12.0.1.
    """
    if isinstance(location, ir.NameLoc):
        return location_stack(location.child_loc)
    if isinstance(location, ir.CallSiteLoc):
        return location_stack(location.callee) + location_stack(location.caller)
    if isinstance(location, ir.FileLineColLoc):
        return ((location.filename, location.start_line),)
    if isinstance(location, ir.FusedLoc):
        return next((s for s in map(location_stack, location.locations) if s), ())
    return ()  # unknown location


def _walk(op):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner.operation
                yield from _walk(inner.operation)


def _shape(op) -> tuple[int, ...]:
    if not len(op.results):
        return ()
    kind = op.results[0].type  # a typed `RankedTensorType` in JAX 0.10.2 and 0.12.0.1
    return tuple(kind.shape) if isinstance(kind, ir.RankedTensorType) else ()


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
