"""Every collective of the partitioned program, attributed to mesh axes, bytes and source.

Collectives are found wherever XLA put them: synchronous or async (`*-start`; the
matching `*-done` is the same transfer and is skipped), inside fusions and async
wrappers, in loop bodies, tuple-shaped or not. Bytes are what one device moves, with the
usual ring estimates (documented in the README): all-gather and all-to-all receive
(n-1)/n of their result, reduce-scatter sends (n-1)/n of its input, all-reduce moves
2(n-1)/n of its buffer, collective-permute sends its buffer once.
"""

from __future__ import annotations

from ._devices import MeshInfo, axes_of_groups, axes_of_pairs, parse_replica_groups
from ._hlo import ArrayType, HloModule, Instruction
from ._model import Collective, Source

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
         "ragged-all-to-all", "collective-broadcast")


def collectives_of(module: HloModule, mesh: MeshInfo) -> tuple[Collective, ...]:
    loop_bodies = _loop_bodies(module)
    found = []
    for instr in module.instructions():
        kind, is_async = _kind(instr.opcode)
        if kind is None:
            continue
        found.append(_collective(instr, kind, is_async, mesh, instr.computation in loop_bodies))
    return tuple(found)


def _kind(opcode: str) -> tuple[str | None, bool]:
    if opcode.endswith("-done"):
        return None, False
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return (base, opcode != base) if base in KINDS else (None, False)


def _collective(instr: Instruction, kind: str, is_async: bool, mesh: MeshInfo,
                in_loop: bool) -> Collective:
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
    src = instr.source
    return Collective(
        id=instr.name,
        kind=kind,
        axes=tuple(axes),
        bytes=_moved(kind, result_bytes, group),
        result_bytes=result_bytes,
        shape=", ".join(str(a) for a in outputs),
        op_path=instr.op_name,
        source=Source(src.file, src.line, src.function) if src else None,
        is_async=is_async,
        in_loop=in_loop,
    )


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
