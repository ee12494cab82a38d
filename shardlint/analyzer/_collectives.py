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
finding's op.
"""

from __future__ import annotations

from ._devices import MeshInfo, axes_of_groups, axes_of_pairs, parse_replica_groups
from ._hlo import ArrayType, HloModule, Instruction
from ._model import Collective, Source

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
         "ragged-all-to-all", "collective-broadcast")


_PASS_THROUGH = {"get-tuple-element", "bitcast", "copy", "tuple", "reshape", "transpose",
                 "all-gather-done", "all-to-all-done", "collective-permute-done", "async-done",
                 "copy-start", "copy-done", "convert"}
_READ_BY_CONSUMER = {"all-gather", "all-to-all", "ragged-all-to-all", "collective-broadcast"}


def collectives_of(module: HloModule, mesh: MeshInfo) -> tuple[Collective, ...]:
    loop_bodies = _loop_bodies(module)
    users = _users(module)
    found = []
    for instr in module.instructions():
        kind, is_async = _kind(instr.opcode)
        if kind is None:
            continue
        consumer = _consumer(instr, users) if kind in _READ_BY_CONSUMER else None
        found.append(_collective(instr, kind, is_async, mesh, instr.computation in loop_bodies, consumer))
    return tuple(found)


def _users(module: HloModule) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = {}
    for instr in module.instructions():
        for operand in instr.operands:
            users.setdefault(operand.partition("#")[0], []).append(instr)
    return users


def _consumer(instr: Instruction, users) -> Instruction | None:
    """The first op past layout-only ops that reads the collective's result."""
    frontier, seen = [instr], {instr.name}
    while frontier:
        nxt = []
        for node in frontier:
            for user in users.get(node.name, ()):
                if user.name in seen:
                    continue
                seen.add(user.name)
                if user.opcode in _PASS_THROUGH or user.source is None:
                    nxt.append(user)
                else:
                    return user
        frontier = nxt
    return None


def _kind(opcode: str) -> tuple[str | None, bool]:
    if opcode.endswith("-done"):
        return None, False
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return (base, opcode != base) if base in KINDS else (None, False)


def _collective(instr: Instruction, kind: str, is_async: bool, mesh: MeshInfo,
                in_loop: bool, consumer: Instruction | None) -> Collective:
    outputs = _outputs(instr, kind, is_async)
    result_bytes = sum(a.nbytes for a in outputs)
    if kind == "collective-permute":
        axes = axes_of_pairs(mesh, instr.attrs.get("source_target_pairs", ""))
        group = 2
    else:
        groups = parse_replica_groups(instr.attrs.get("replica_groups", "{}"), mesh.num_devices)
        axes = axes_of_groups(mesh, groups)
        group = len(groups[0]) if groups else mesh.num_devices
        if axes is None:
            axes = (f"?{group}",)
    own = instr.source
    src = consumer.source if consumer is not None else own
    return Collective(
        id=instr.name,
        kind=kind,
        axes=tuple(axes),
        bytes=_moved(kind, result_bytes, group),
        result_bytes=result_bytes,
        shape=", ".join(str(a) for a in outputs),
        op_path=consumer.op_name if consumer is not None else instr.op_name,
        source=_source(src),
        is_async=is_async,
        in_loop=in_loop,
        xla_op_path=instr.op_name,
        xla_source=_source(own),
    )


def _source(src) -> Source | None:
    return Source(src.file, src.line, src.function) if src else None


def _outputs(instr: Instruction, kind: str, is_async: bool) -> tuple[ArrayType, ...]:
    """The arrays a collective produces, without the operand copies `*-start` carries."""
    arrays = tuple(a for a in instr.result if a.dtype != "token")
    if is_async and instr.is_tuple and kind in ("all-gather", "collective-permute",
                                                  "all-to-all", "reduce-scatter"):
        # `(operands..., outputs..., [contexts])`: keep the outputs.
        if kind == "collective-permute" and len(arrays) >= 2:
            return (arrays[1],)
        half = len(arrays) // 2
        return arrays[half:] if half else arrays
    return arrays


def _moved(kind: str, nbytes: int, n: int) -> int:
    if n <= 1:
        return 0
    if kind == "all-reduce":
        return 2 * nbytes * (n - 1) // n
    if kind == "reduce-scatter":
        return nbytes * (n - 1)  # the result is 1/n of the input
    if kind in ("collective-permute", "collective-broadcast"):
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
