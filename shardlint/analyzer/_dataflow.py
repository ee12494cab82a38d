"""Which of the step's inputs each value of the partitioned program depends on.

A gather of a weight (FSDP, ZeRO) is wanted; a gather of an activation over an axis that
sharded it is the lost memory shardlint exists to find. XLA's partitioned module says
which is which once its values are traced back to the entry parameters: a value derived
from a data input (the batch) is an activation, one derived only from parameters is a
weight. This module propagates two marks, DATA and WEIGHTS, forward from the entry
parameters through every computation of the module to a fixpoint: through fusions and
calls (parameters bound to operands), while loops (the carried tuple element by element,
so stacked weights sliced per layer stay weights while the activation carry is data),
conditionals and tuples. Marks only grow, so the walk ends after a few passes.
"""

from __future__ import annotations

from ._collectives import KINDS
from ._hlo import HloModule, Instruction

DATA = 1
WEIGHTS = 2

# A value's marks are an int for an array and a tuple of marks for a tuple-shaped value.


def _union(marks) -> int:
    if isinstance(marks, tuple):
        out = 0
        for m in marks:
            out |= _union(m)
        return out
    return marks


def _join(a, b):
    """Marks that hold a's and b's. No marks (0, what a value has before the walk reaches
    its sources, e.g. a loop body's parameter before its loop binds it) join as nothing,
    so that they do not merge a tuple's elements that arrive later."""
    if a == 0 or b == 0:
        return b if a == 0 else a
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_join(x, y) for x, y in zip(a, b))
    return _union(a) | _union(b)


class _Flow:
    def __init__(self, module: HloModule, entry_marks: dict[int, int]):
        self.module = module
        self.entry_marks = entry_marks
        self.values: dict[str, object] = {}
        self.bound: dict[str, dict[int, object]] = {}   # computation -> parameter -> marks
        self.changed = True

    def run(self) -> dict[str, int]:
        entry = self.module.entry
        self.inside = _holding_collectives(self.module)
        order = [entry] + [c for c in self.module.computations.values()
                           if c.name in self.inside and c is not entry]
        for _ in range(64):
            if not self.changed:
                break
            self.changed = False
            for comp in order:
                for instr in comp.instructions:
                    self._set(instr.name, self._eval(instr, comp.name == entry.name))
        return {name: _union(m) for name, m in self.values.items()}

    def _set(self, name: str, marks) -> None:
        old = self.values.get(name)
        new = marks if old is None else _join(old, marks)
        if new != old:
            self.values[name] = new
            self.changed = True

    def _bind(self, computation: str, number: int, marks) -> None:
        params = self.bound.setdefault(computation, {})
        old = params.get(number)
        new = marks if old is None else _join(old, marks)
        if new != old:
            params[number] = new
            self.changed = True

    def _operand(self, instr: Instruction, position: int):
        marks = self.values.get(instr.operands[position], 0)
        index = instr.operand_indices[position] if position < len(instr.operand_indices) else None
        if index is not None and isinstance(marks, tuple):  # JAX 0.12's inline `%value#1`
            return marks[index] if index < len(marks) else _union(marks)
        return marks

    def _root(self, computation: str, default=0):
        """The marks of a computation's result; `default` while it is not computed yet."""
        comp = self.module.computations.get(computation)
        if comp is None:
            return default
        root = next((i for i in comp.instructions if i.is_root), None)
        return self.values.get(root.name, default) if root is not None else default

    def _eval(self, instr: Instruction, in_entry: bool):
        op = instr.opcode
        operands = [self._operand(instr, i) for i in range(len(instr.operands))]
        if op == "parameter":
            number = instr.parameter_number or 0
            if in_entry:
                return self.entry_marks.get(number, 0)
            return self.bound.get(instr.computation, {}).get(number, 0)
        if op == "get-tuple-element":
            marks = operands[0] if operands else 0
            index = instr.tuple_index
            if isinstance(marks, tuple) and index is not None and index < len(marks):
                return marks[index]
            return _union(marks)
        if op == "tuple":
            return tuple(operands)
        if instr.called and not any(c in self.inside for c in instr.called):
            return _union(tuple(operands))  # nothing inside is asked about: its inputs' marks
        if op == "while":
            body, cond = instr.loop_body or "", instr.loop_condition or ""
            # Before the body is walked its result has no marks yet: joining a default 0
            # would merge the carried tuple's elements and make every sliced weight data.
            root = self._root(body, default=None)
            carried = (operands[0] if root is None else _join(operands[0], root)) if operands else 0
            for comp in (body, cond):
                self._bind(comp, 0, carried)
            return carried
        if op == "conditional":
            branches = instr.called
            for i, branch in enumerate(branches):
                if i + 1 < len(operands):
                    self._bind(branch, 0, operands[i + 1])
            return _union(tuple(self._root(b) for b in branches) + tuple(operands[:1]))
        if op in ("fusion", "call", "async-start"):
            for comp in instr.called:
                for number, marks in enumerate(operands):
                    self._bind(comp, number, marks)
            roots = [self._root(c) for c in instr.called]
            return roots[0] if len(roots) == 1 else _union(tuple(roots) + tuple(operands))
        return _union(tuple(operands))


def _holding_collectives(module: HloModule) -> set[str]:
    """Computations that hold a collective, themselves or in what they call: only their
    insides need walking; any other call passes on the marks of its inputs."""
    holding = {i.computation for i in module.instructions()
               if i.opcode.removesuffix("-start") in KINDS}
    changed = True
    while changed:
        changed = False
        for instr in module.instructions():
            if instr.computation not in holding and any(c in holding for c in instr.called):
                holding.add(instr.computation)
                changed = True
    return holding


def input_marks(module: HloModule, entry_marks: dict[int, int]) -> dict[str, int]:
    """DATA / WEIGHTS marks of every instruction result (all tuple elements merged).

    `entry_marks` maps an entry parameter number to the marks of the argument it holds.
    """
    return _Flow(module, entry_marks).run()
