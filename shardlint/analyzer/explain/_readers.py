"""Which op a collective was placed for: the op that needed it, read from the partitioned
program around the collective.

XLA's own label on a gather or all-to-all is the op its partitioner was partitioning in
JAX 0.10, and the op that made the moved value in JAX 0.12 (which also marks the copies
and reshards the partitioner inserts, `spmd_generated`). So the label is trusted where
it is the op being partitioned and that op needs a dimension whole; otherwise the
collective is for the op that reads it: the first op past layout ops, the partitioner's
own copies and further collectives of the same value (a gather over context, then one
over data, then the top_k), or, past that, the nearest op within a few that needs a
dimension whole (up to the next contraction, and inside fusions at the ops its value
reaches). A weight or K/V gather read by a dot is for that dot.
"""

from __future__ import annotations

from ..._vocab import CollectiveKind
from ..parse import HloModule, Instruction
from ..._ops import JAXPR_LAYOUT, NEEDS_WHOLE
from ..._source import user_stack

_PASS_THROUGH = {"get-tuple-element", "bitcast", "copy", "tuple", "reshape", "transpose",
                 "all-gather-done", "all-to-all-done", "collective-permute-done", "async-done",
                 "copy-start", "copy-done", "convert"}
# Collectives that pass a value on (the reader of a chain of them is the reader of each).
_MOVING = {CollectiveKind.ALL_GATHER, CollectiveKind.ALL_TO_ALL, CollectiveKind.COLLECTIVE_PERMUTE}
# Ops a fusion may hold and still only move or re-lay its operands.
_LAYOUT_BODY = {"parameter", "copy", "bitcast", "transpose", "reshape", "slice", "concatenate",
                "tuple", "get-tuple-element", "broadcast", "constant", "convert", "bitcast-convert"}


class Readers:
    """The ops of a partitioned module by the values they read, for `placed_for`."""

    def __init__(self, module: HloModule):
        self.module = module
        self.users = _users(module)
        self.by_name = {i.name: i for i in module.instructions()}
        self.marked = any(i.spmd_generated for i in self.by_name.values())

    def placed_for(self, instr: Instruction, kind: CollectiveKind) -> tuple[Instruction, str]:
        """(the op whose line and stack the collective takes, the JAX name of the op that
        needed it)."""
        names_producer = _labels_its_operand(instr, self.by_name, self.marked)
        if _label_needs_it(instr, kind, names_producer):
            return instr, instr.primitive   # the op it was partitioning needs it whole
        consumer = _consumer(instr, self.users, self.module)
        if not _contracts(consumer):  # a weight or K/V gather is for the dot reading it
            consumer = _needing(instr, self.users, self.module) or consumer
        return consumer, _needed_by(instr, consumer, names_producer)


def _label_needs_it(instr: Instruction, kind: CollectiveKind, names_producer: bool) -> bool:
    """XLA's label names the op it was partitioning (not the one that made the value), and
    that op needs a dimension whole. A reshape is a propagation drop: where it cannot keep
    a sharding, propagation drops it (`_detect`, whose drops claim their gathers) or XLA
    moves the axis with an all-to-all; an all-gather labelled with a reshape nothing dropped
    at is for the op after it."""
    own = instr.primitive
    return (own in NEEDS_WHOLE and not names_producer
            and not (own == "reshape" and kind == CollectiveKind.ALL_GATHER))


def _needed_by(instr: Instruction, consumer: Instruction | None, names_producer: bool) -> str:
    """The op that needed the collective: XLA's label where it is the op XLA was
    partitioning (JAX 0.10) and that op needs a whole dimension, else the op reading the
    result when that one does, else XLA's label (gathers placed where a value is made, for
    an op further on). Where the label names the op that made the moved value (JAX 0.12
    labels a collective so), or an op that only re-lays a value (a transpose, a squeeze,
    a convert: the partitioner splits those any way), the reader it is for."""
    own = instr.primitive
    if consumer is None:
        return own
    theirs = consumer.primitive
    relays = own in JAXPR_LAYOUT and own not in NEEDS_WHOLE
    return theirs if theirs in NEEDS_WHOLE or not own or ((names_producer or relays) and theirs) else own


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
    prints the same module in different orders (JAX 0.12's dump and `as_text()`). The
    direction (forward or backward) of XLA's label decides first: a transformation that
    names an einsum (`jvp(bqhd,bkhd->bhqk)`) differs from the label's in either."""
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
            return min(found, key=lambda op: (op.backward != instr.backward,
                                              op.transform != instr.transform,
                                              _in_source_order(op)))
        frontier, depth = nxt, depth + 1
    return None


def _in_source_order(instr: Instruction) -> tuple:
    src = instr.source
    return (src is None, src.file if src else "", src.line if src else 0, instr.name)


def _consumer(instr: Instruction, users, module: HloModule) -> Instruction | None:
    """The first op past layout-only ops (and the partitioner's copies and further
    collectives of the same value: a gather over context, then one over data) that reads
    the collective's result."""
    return _first_reader(instr, users,
                         lambda u, via: None if u.source is None or _moves_only(u, module) else u)


def _moves_only(instr: Instruction, module: HloModule) -> bool:
    """An op that only moves or re-lays the value it reads: a layout op, a collective that
    moves it on, or a fusion of layout ops (XLA's partitioner wraps the copies it inserts
    around a collective in fusions labelled with a neighbouring op: `wrapped_copy`)."""
    if instr.opcode in _PASS_THROUGH or instr.opcode.removesuffix("-start") in _MOVING:
        return True
    if instr.opcode != "fusion":
        return False
    inner = [i for c in instr.called for i in getattr(module.computations.get(c), "instructions", ())]
    return bool(inner) and all(i.opcode in _LAYOUT_BODY and not _needs_whole(i) for i in inner)


def _labels_its_operand(instr: Instruction, by_name, marked: bool) -> bool:
    """XLA's label on the collective is that of the op that made the value it moves: the
    first op upstream, past the partitioner's own copies and collectives, has that label
    or sits on the same line of the user's code.
    Newer XLA (JAX 0.12) labels collectives so and marks what the partitioner inserted
    (`spmd_generated`); where a module has no such mark (JAX 0.10) the label is the op the
    partitioner was partitioning."""
    if not marked or not instr.op_name:
        return False
    seen, frontier = set(), list(instr.operands)
    while frontier:
        operand = by_name.get(frontier.pop())
        if operand is None or operand.name in seen:
            continue
        seen.add(operand.name)
        if (operand.spmd_generated or operand.opcode.removesuffix("-start") in _MOVING
                or operand.opcode in ("get-tuple-element", "tuple") or operand.opcode.endswith("-done")):
            frontier.extend(operand.operands)
            continue
        return operand.op_name == instr.op_name or _user_line(operand) == _user_line(instr) is not None
    return False


def _user_line(instr: Instruction) -> tuple[str, int] | None:
    """(file, line) of the op's innermost user frame: XLA fuses a reshape or a squeeze into
    the op that made its operand, on the same line, and labels the fusion with either."""
    stack = user_stack(instr.stack)
    return (stack[0].file, stack[0].line) if stack else None


def _contracts(instr: Instruction | None) -> bool:
    return instr is not None and (instr.opcode in ("dot", "convolution")
                                  or instr.primitive in ("dot_general", "conv_general_dilated"))


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
    an attention fusion). A fusion labelled with an op that needs a whole dimension needs
    it unless the value reaches that op only as an update it stores whole (`_stores_whole`)."""
    if instr.opcode != "fusion":
        return instr if _needs_whole(instr, via, module) else None
    bound = {k for k, name in enumerate(instr.operands) if name == via}
    stored = False
    for callee in instr.called:
        comp = module.computations.get(callee)
        if comp is None:
            continue
        reached = [(i, None) for i in comp.instructions if i.opcode == "parameter" and i.parameter_number in bound]
        seen = {i.name for i, _ in reached}
        while reached:
            inner, read = reached.pop()
            if read is not None and _needs_whole(inner):
                if not _stores_whole(inner, read, module):
                    return inner
                stored = True
            for user in users.get(inner.name, ()):
                if user.computation == comp.name and user.name not in seen:
                    seen.add(user.name)
                    reached.append((user, inner.name))
    return instr if _needs_whole(instr) and not stored else None


def _needs_whole(instr: Instruction, via: str | None = None, module: HloModule | None = None) -> bool:
    """The op needs a whole dimension of what it reads (of the value `via`, when given)."""
    return (instr.primitive in NEEDS_WHOLE and instr.opcode not in _PASS_THROUGH
            and not (via is not None and _stores_whole(instr, via, module)))


def _stores_whole(instr: Instruction, via: str, module: HloModule) -> bool:
    """A dynamic-update-slice that writes the value `via` as its update, as long as the
    buffer along every dimension but ones of length 1 (a scan stacking a layer's value for
    the backward, at the layer's index): it writes the value's shards where they are and
    needs none of its dimensions whole."""
    if instr.opcode != "dynamic-update-slice" or len(instr.operands) < 2 or instr.operands[1] != via:
        return False
    comp = module.computations.get(instr.computation)
    update = comp.get(via) if comp is not None else None
    if update is None or not update.result or not instr.result:
        return False
    rows, buffer = update.result[0].dims, instr.result[0].dims
    return len(rows) == len(buffer) and all(u in (b, 1) for u, b in zip(rows, buffer))
