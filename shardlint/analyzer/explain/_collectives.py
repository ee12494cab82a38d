"""Every collective of the partitioned program, attributed to mesh axes, bytes and source.

Collectives are found wherever XLA put them: synchronous or async (`*-start`; the
matching `*-done` is the same transfer and is skipped), inside fusions and async
wrappers, in loop bodies, tuple-shaped or not. Bytes are what one device moves, with the
usual ring estimates (documented in the README): all-gather and all-to-all receive
(n-1)/n of their result, reduce-scatter sends (n-1)/n of its input, all-reduce moves
2(n-1)/n of its buffer, collective-permute sends its buffer once.

Where a collective comes from: XLA's own label (`xla_op_path`, `xla_source`) changes
across versions (JAX 0.12 labels a gather with the op that made the value, or with an
argument's name), so `op_path`/`source` attribute it to the op that needs it: an
all-gather or all-to-all to the op it was placed for (`_readers.py`), a reduction to the
op that produced the partial sums (XLA's label). The analysis then moves collectives
caused by a finding to the finding's op, and `_causes.py` says why each one is there.

A collective in a while body runs once per iteration: `trips` is the product of the
known trip counts of the loops around it (None when XLA does not know one).
"""

from __future__ import annotations

from ..._vocab import COLLECTIVE_KINDS, CollectiveKind
from ..parse import (ArrayType, axes_of_groups, axes_of_pairs, HloModule, Instruction, MeshInfo,
    parse_replica_groups, replica_group_axes)
from .._model import Collective
from ._readers import Readers
from ..._source import Source, shown, user_stack
from ..graph import executions

_READ_BY_CONSUMER = {CollectiveKind.ALL_GATHER, CollectiveKind.ALL_TO_ALL, CollectiveKind.RAGGED_ALL_TO_ALL,
                     CollectiveKind.COLLECTIVE_BROADCAST}


def collectives_of(module: HloModule, mesh: MeshInfo) -> tuple[Collective, ...]:
    loop_bodies = _loop_bodies(module)
    trips = executions(module)
    readers = Readers(module)
    found = []
    for instr in module.instructions():
        kind, is_async = _kind(instr.opcode)
        if kind is None:
            continue
        consumer, needed_by = (readers.placed_for(instr, kind) if kind in _READ_BY_CONSUMER
                               else (None, instr.primitive))
        found.append(_collective(instr, kind, is_async, mesh, instr.computation in loop_bodies, consumer,
                                 trips.get(instr.computation, 1), needed_by))
    return tuple(found)


def _kind(opcode: str) -> tuple[CollectiveKind | None, bool]:
    if opcode.endswith("-done"):
        return None, False
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return (CollectiveKind(base), opcode != base) if base in COLLECTIVE_KINDS else (None, False)


def _collective(instr: Instruction, kind: CollectiveKind, is_async: bool, mesh: MeshInfo,
                in_loop: bool, consumer: Instruction | None, trips: int | None,
                needed_by: str) -> Collective:
    outputs = _outputs(instr, kind, is_async)
    result_bytes = sum(a.nbytes for a in outputs)
    if kind == CollectiveKind.COLLECTIVE_PERMUTE:
        axes = axes_of_pairs(mesh, instr.source_target_pairs)
        group = 2
    else:
        groups = parse_replica_groups(instr.replica_groups, mesh.num_devices)
        axes = axes_of_groups(mesh, groups)
        group = len(groups[0]) if groups else mesh.num_devices
        if axes is None:   # part of an axis: a sub-axis XLA names it by, else its size
            axes = replica_group_axes(instr.replica_groups) or (f"?{group}",)
    own = instr.source
    src = consumer.source if consumer is not None else own
    stack = user_stack(consumer.stack if consumer is not None else instr.stack)
    own_stack = user_stack(instr.stack)
    return Collective(
        id=instr.name,
        kind=kind,
        axes=tuple(axes),
        bytes=_moved(kind, result_bytes, group),
        result_bytes=result_bytes,
        shape=", ".join(str(a) for a in outputs),
        op_path=consumer.op_name if consumer is not None else instr.op_name,
        source=_source(stack[0]) if stack else _source(src),
        is_async=is_async,
        in_loop=in_loop,
        xla_op_path=instr.op_name,
        xla_source=_source(own_stack[0]) if own_stack else _source(own),
        needed_by=needed_by,
        stack=tuple(_source(f) for f in stack),
        trips=trips,
    )


def _source(src: Source | None) -> Source | None:
    return shown(src) if src else None


def _outputs(instr: Instruction, kind: CollectiveKind, is_async: bool) -> tuple[ArrayType, ...]:
    """The arrays a collective produces, without the operand copies `*-start` carries."""
    arrays = tuple(a for a in instr.result if a.dtype != "token")
    if is_async and instr.is_tuple and kind in (CollectiveKind.ALL_GATHER, CollectiveKind.COLLECTIVE_PERMUTE,
                                                  CollectiveKind.ALL_TO_ALL, CollectiveKind.REDUCE_SCATTER):
        # `(operands..., outputs..., [contexts])`: keep the outputs.
        if kind == CollectiveKind.COLLECTIVE_PERMUTE and len(arrays) >= 2:
            return (arrays[1],)
        half = len(arrays) // 2
        return arrays[half:] if half else arrays
    return arrays


def _moved(kind: CollectiveKind, nbytes: int, n: int) -> int:
    if n <= 1:
        return 0
    if kind == CollectiveKind.ALL_REDUCE:
        return 2 * nbytes * (n - 1) // n
    if kind == CollectiveKind.REDUCE_SCATTER:
        return nbytes * (n - 1)  # the result is 1/n of the input
    if kind in (CollectiveKind.COLLECTIVE_PERMUTE, CollectiveKind.COLLECTIVE_BROADCAST):
        return nbytes
    return nbytes * (n - 1) // n


def _loop_bodies(module: HloModule) -> set[str]:
    bodies: set[str] = set()
    for instr in module.instructions():
        if instr.opcode == "while":
            bodies.update(instr.called)
    # Computations called from inside a loop body are in the loop too.
    changed = True
    while changed:
        changed = False
        for instr in module.instructions():
            if instr.computation in bodies:
                new = set(instr.called) - bodies
                if new:
                    bodies |= new
                    changed = True
    return bodies
