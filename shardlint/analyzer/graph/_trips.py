"""How often each loop, and so each computation, runs per step.

A collective inside a while body runs once per iteration, so its bytes per step are its
bytes times the trip counts of the loops around it. XLA annotates an optimised module's
loops (`Instruction.known_trip_count`); the propagated module carries no annotation, and
the count is read from the loop itself where JAX lowered a counted loop (`scan`,
`fori_loop`).
"""

from __future__ import annotations

from ..parse import Computation, HloModule, Instruction


def trip_count(module: HloModule, loop: Instruction) -> int | None:
    """How often a while loop runs: XLA's annotation where the module carries one (the
    optimised module), else read from the loop's computations (the propagated module)."""
    if loop.known_trip_count is not None:
        return loop.known_trip_count
    return _counted_loop(module, loop)


def executions(module: HloModule) -> dict[str, int | None]:
    """How often each computation runs per step: the product of the known trip counts of
    the while loops around it (None once one of them is unknown)."""
    counts: dict[str, int | None] = {module.entry.name: 1}
    pending = [module.entry.name]
    while pending:
        comp = module.computations.get(pending.pop())
        if comp is None:
            continue
        mine = counts[comp.name]
        for instr in comp.instructions:
            trip = instr.known_trip_count if instr.opcode == "while" else 1
            inner = None if mine is None or trip is None else mine * trip
            for callee in instr.called:
                if callee not in counts:
                    counts[callee] = inner
                    pending.append(callee)
    return counts


def _counted_loop(module: HloModule, loop: Instruction) -> int | None:
    """`for i in range(start, limit)` as JAX lowers `scan` and `fori_loop`: the condition is
    `element < constant`, the body adds 1 to that element, the initial tuple holds a constant."""
    cond, body, caller = (module.computations.get(name or "") for name in (
        loop.loop_condition, loop.loop_body,
        loop.computation))
    if cond is None or body is None or caller is None or not loop.operands:
        return None
    compare, result, init = cond.root, body.root, caller.get(loop.operands[0])
    if (compare is None or compare.opcode != "compare" or compare.attrs.get("direction") != "LT"
            or result is None or init is None or init.opcode != "tuple"):
        return None
    index = _element_of_parameter(cond, compare, 0)
    if index is None or index >= min(len(init.operands), len(result.operands)):
        return None
    start, limit = caller.get(init.operands[index]), cond.get(compare.operands[1])
    add = body.get(result.operands[index])
    if start is None or limit is None or add is None or add.opcode != "add":
        return None
    # The body adds a constant 1 to the counter, on either side of the add.
    steps = [body.get(add.operands[1 - k]) for k in (0, 1)
             if _element_of_parameter(body, add, k) == index]
    step = steps[0].constant_value if steps and steps[0] is not None else None
    first, last = start.constant_value, limit.constant_value
    if step != 1 or not isinstance(first, int) or not isinstance(last, int):
        return None
    return max(last - first, 0)




def _element_of_parameter(comp: Computation, instr: Instruction, operand: int) -> int | None:
    """Which element of the computation's tuple parameter an operand is: a get-tuple-element
    of the parameter, or the parameter with an inline `#N` index (JAX 0.12's propagated dump)."""
    ref = comp.get(instr.operands[operand]) if operand < len(instr.operands) else None
    if ref is None:
        return None
    if ref.opcode == "parameter":
        return instr.operand_indices[operand] if operand < len(instr.operand_indices) else None
    if ref.opcode == "get-tuple-element" and ref.operands:
        source = comp.get(ref.operands[0])
        return ref.tuple_index if source is not None and source.opcode == "parameter" else None
    return None
