"""Every collective of the partitioned program, attributed to mesh axes, bytes and source.

Collectives are found wherever XLA put them: synchronous or async (`*-start`; the
matching `*-done` is the same transfer and is skipped), inside fusions and async
wrappers, in loop bodies, tuple-shaped or not. Bytes are what one device moves, with the
usual ring estimates (documented in the README): all-gather and all-to-all receive
(n-1)/n of their result, reduce-scatter sends (n-1)/n of its input, all-reduce moves
2(n-1)/n of its buffer, collective-permute sends its buffer once.

Where a collective comes from: XLA's own label (`xla_op_path`, `xla_source`) changes
across versions (JAX 0.12 labels a gather of an argument with the argument's name), so
`op_path`/`source` attribute it to the op that needs it: an all-gather or all-to-all to
the first real op that reads its result, a reduction to the op that produced the partial
sums (XLA's label). The analysis then moves collectives caused by a finding to the
finding's op, and `_causes.py` says why each one is there.

A collective in a while body runs once per iteration: `trips` is the product of the
known trip counts of the loops around it (None when XLA does not know one).
"""

from __future__ import annotations

from .._vocab import COLLECTIVE_KINDS, CollectiveKind
from ._devices import MeshInfo, axes_of_groups, axes_of_pairs, parse_replica_groups, replica_group_axes
from ._hlo import ArrayType, HloModule, Instruction
from ._model import Collective, Source
from ._ops import NEEDS_WHOLE
from ._stack import shown, user_stack
from ._trips import executions

_PASS_THROUGH = {"get-tuple-element", "bitcast", "copy", "tuple", "reshape", "transpose",
                 "all-gather-done", "all-to-all-done", "collective-permute-done", "async-done",
                 "copy-start", "copy-done", "convert"}
_READ_BY_CONSUMER = {CollectiveKind.ALL_GATHER, CollectiveKind.ALL_TO_ALL, CollectiveKind.RAGGED_ALL_TO_ALL,
                     CollectiveKind.COLLECTIVE_BROADCAST}


def collectives_of(module: HloModule, mesh: MeshInfo) -> tuple[Collective, ...]:
    loop_bodies = _loop_bodies(module)
    trips = executions(module)
    users = _users(module)
    found = []
    for instr in module.instructions():
        kind, is_async = _kind(instr.opcode)
        if kind is None:
            continue
        consumer = None
        if kind in _READ_BY_CONSUMER:
            consumer = _consumer(instr, users)
            if not _contracts(consumer):  # a weight or K/V gather is for the dot reading it
                consumer = _needing(instr, users, module) or consumer
        found.append(_collective(instr, kind, is_async, mesh, instr.computation in loop_bodies, consumer,
                                 trips.get(instr.computation, 1)))
    return tuple(found)


def _needed_by(instr: Instruction, consumer: Instruction | None) -> str:
    """The op that needed the collective: XLA's label (the op it was partitioning) when that
    op needs a whole dimension, else the first op reading the result when that one does,
    else XLA's label (gathers placed where a value is made, for an op further on)."""
    own = primitive_of(instr.op_name)
    if own in NEEDS_WHOLE or consumer is None:
        return own
    theirs = primitive_of(consumer.op_name)
    return theirs if theirs in NEEDS_WHOLE or not own else own


def primitive_of(op_path: str) -> str:
    """The JAX primitive an op path ends in: `jit(step)/jvp()/scatter-add` -> `scatter-add`.

    XLA joins the names of merged ops with ';' (JAX 0.12): the first one names it. A path
    without '/' is an argument's name (JAX 0.12 labels a gathered argument so): no op."""
    first = op_path.split(";", 1)[0]
    if "/" not in first:
        return ""
    last = first.rsplit("/", 1)[1]
    return last.split("(", 1)[0].strip(")") or last


def transform_of(op_path: str) -> str:
    """The transformations an op path's op ran under: `jit(step)/transpose(jvp())/mul` ->
    `jit(step)/transpose(jvp())`. XLA joins the names of ops it merged with ';' (JAX 0.12):
    the first one decides."""
    first = op_path.split(";", 1)[0]
    return first.rsplit("/", 1)[0] if "/" in first else ""


def _users(module: HloModule) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = {}
    for instr in module.instructions():
        for operand in instr.operands:
            users.setdefault(operand, []).append(instr)
    return users


def _first_reader(instr: Instruction, users, pick, hops: int | None = None, past=lambda op: True):
    """Walks the ops reading the collective's result, nearest first, and returns the
    `pick(op, via)` that is not None (`via`: the name of the value `op` reads on the way;
    within `hops` steps when given, and on past an op only where `past(op)`). Of several at
    the same distance, one in the transformation of XLA's label on the collective wins (a
    gather made in the forward pass is for the forward op, though the backward reads it
    too), then the one earliest in the user's source, not the one XLA printed first: XLA
    prints the same module in different orders (JAX 0.12's dump and `as_text()`)."""
    frontier, seen, depth = [instr], {instr.name}, 0
    while frontier and (hops is None or depth < hops):
        nxt, found = [], []
        for node in frontier:
            for user in users.get(node.name, ()):
                if user.name in seen:
                    continue
                seen.add(user.name)
                picked = pick(user, node.name)
                if picked is not None:
                    found.append(picked)
                if past(user):
                    nxt.append(user)
        if found:
            return min(found, key=lambda op: (transform_of(op.op_name) != transform_of(instr.op_name),
                                              _in_source_order(op)))
        frontier, depth = nxt, depth + 1
    return None


def _in_source_order(instr: Instruction) -> tuple:
    src = instr.source
    return (src is None, src.file if src else "", src.line if src else 0, instr.name)


def _consumer(instr: Instruction, users) -> Instruction | None:
    """The first op past layout-only ops that reads the collective's result."""
    return _first_reader(instr, users,
                         lambda u, via: None if u.opcode in _PASS_THROUGH or u.source is None else u)


def _contracts(instr: Instruction | None) -> bool:
    return instr is not None and (instr.opcode in ("dot", "convolution")
                                  or primitive_of(instr.op_name) in ("dot_general", "conv_general_dilated"))


def _needing(instr: Instruction, users, module: HloModule, hops: int = 6) -> Instruction | None:
    """The nearest op reading the collective's result (within `hops` ops) that needs a whole
    dimension, looking inside fusions: the op the gather was placed for. The walk stops at
    a contraction: what a dot makes is a new value, not the gathered one passed on (the
    embedding's scatter-add in the backward is not what an attention all-to-all was for)."""
    return _first_reader(instr, users, lambda u, via: _op_needing_whole(u, via, module, users),
                         hops, past=lambda u: not _contracts(u))


def _op_needing_whole(instr: Instruction, via: str, module: HloModule, users) -> Instruction | None:
    """`instr`, or the op inside the fusion `instr` that reads the value `via` (through the
    fusion's parameters bound to it), when that op needs a whole dimension. Ops inside the
    fusion that `via` does not reach do not count: XLA shares one constant across the
    module under the metadata of the first op that made it (a scatter-add's zeros inside
    an attention fusion)."""
    if _needs_whole(instr):
        return instr
    if instr.opcode != "fusion":
        return None
    bound = {k for k, name in enumerate(instr.operands) if name == via}
    for callee in instr.called:
        comp = module.computations.get(callee)
        if comp is None:
            continue
        reached = [i for i in comp.instructions if i.opcode == "parameter" and i.parameter_number in bound]
        seen = {i.name for i in reached}
        while reached:
            inner = reached.pop()
            if _needs_whole(inner):
                return inner
            for user in users.get(inner.name, ()):
                if user.computation == comp.name and user.name not in seen:
                    seen.add(user.name)
                    reached.append(user)
    return None


def _needs_whole(instr: Instruction) -> bool:
    return primitive_of(instr.op_name) in NEEDS_WHOLE and instr.opcode not in _PASS_THROUGH


def _kind(opcode: str) -> tuple[CollectiveKind | None, bool]:
    if opcode.endswith("-done"):
        return None, False
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return (CollectiveKind(base), opcode != base) if base in COLLECTIVE_KINDS else (None, False)


def _collective(instr: Instruction, kind: CollectiveKind, is_async: bool, mesh: MeshInfo,
                in_loop: bool, consumer: Instruction | None, trips: int | None) -> Collective:
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
    needed_by = _needed_by(instr, consumer)
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
