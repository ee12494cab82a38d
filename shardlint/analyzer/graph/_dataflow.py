"""Which values of the partitioned program are weights and which are activations.

A gather of a weight (FSDP, ZeRO) is wanted; a gather of an activation over an axis that
sharded it is the lost memory shardlint exists to find. The answer is read from the values,
never from where an argument sits in the step's signature:

- a *weight* is a floating-point argument of the step that has only been moved: re-laid,
  sliced, converted, carried through loops and calls, or moved by a collective (`MOVES`).
  Any op that computes (dot, reduce, sort, top_k, compare, select, arithmetic) makes an
  activation, even from weights alone; integer and boolean values are never weights;
- a floating-point argument is a *token input* (an activation the step was handed, as a
  layer-level step takes `x`), not a parameter, when the program treats it as tokens: its
  rows are gathered or scattered at indices computed from floating-point values (tokens
  sorted by the expert a router chose; an embedding table is read at token ids, which are
  integers), or it is sorted, ranked, summed cumulatively or scattered (`TOKEN_OPCODES`).
  The analysis adds the collectives XLA placed for such ops (`_causes`).

Every value carries its provenance: the entry parameters it was made from, one bit each,
and a COMPUTED bit once anything computed on the way. A move passes on the union of its
operands' bits (so data-dependent indices make a slice computed), a computing op adds
COMPUTED. The walk enters loop bodies (the carried tuple element by element, so stacked
weights sliced per layer stay weights while the activation carry is computed), calls,
conditionals and the fusions that hold a collective, to a fixpoint; any other fusion is a
pure function of its operands, evaluated op by op once per distinct operand provenance.
"""

from __future__ import annotations

import dataclasses

from ..._vocab import COLLECTIVE_KINDS
from ..parse import HloModule, Instruction
from ..._ops import TOKEN_OPCODES

COMPUTED = 1

# HLO ops that move or re-lay a value without computing from it.
MOVES = frozenset({
    "parameter", "get-tuple-element", "tuple", "bitcast", "bitcast-convert", "copy", "copy-start",
    "copy-done", "convert", "reshape", "transpose", "broadcast", "slice", "dynamic-slice",
    "dynamic-update-slice", "gather", "concatenate", "pad", "reverse", "optimization-barrier",
    "domain", "add-dependency", "async-start", "async-update", "async-done",
    "all-gather", "all-gather-start", "all-gather-done", "all-to-all", "collective-permute",
    "collective-permute-start", "collective-permute-done", "collective-broadcast",
    "constant", "iota", "partition-id", "replica-id", "after-all",
})
# Custom calls that only annotate or move a value (sharding and memory-space markers).
_MOVING_TARGETS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
                             "MoveToHost", "MoveToDevice", "LayoutConstraint",
                             "xla.sdy.ShardingConstraint"})
# Ops that read their operand at indices (operand 0; the indices from operand 1 on).
_INDEXED = frozenset({"gather", "dynamic-slice", "dynamic-update-slice", "scatter"})
_CONTROL = frozenset({"while", "conditional", "call", "fusion", "async-start"})


def is_float(dtype: str) -> bool:
    """An HLO element type that can hold a weight: f16, bf16, f32, f64, f8 variants."""
    return dtype.startswith("f") or dtype == "bf16"


def moves(instr: Instruction) -> bool:
    return instr.opcode in MOVES or (
        instr.opcode == "custom-call" and instr.custom_call_target in _MOVING_TARGETS)


def param_bit(number: int) -> int:
    return 1 << (number + 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Provenance:
    """Each value's provenance bits (tuple elements merged), which entry parameters may be
    weights, and which of those the program treats as tokens."""

    bits: dict[str, int]
    weight_bits: int      # bits of the floating-point parameters (the user's named ones, if named)
    tokens: int           # of those, the ones the program treats as tokens

    def of(self, name: str) -> int:
        return self.bits.get(name, COMPUTED)

    def moved_weights(self, bits: int) -> int:
        """The weight bits of a value that only moves parameters (0 for anything else)."""
        return bits & self.weight_bits if not bits & ~self.weight_bits else 0

    def is_weight(self, name: str) -> bool:
        """A moved parameter, none of whose arguments carries tokens."""
        moved = self.moved_weights(self.of(name))
        return bool(moved) and not moved & self.tokens

    def is_weight_parameter(self, number: int) -> bool:
        """Entry parameter `number` holds a weight: a floating-point parameter the program
        never treats as tokens."""
        bit = param_bit(number)
        return bool(bit & self.weight_bits) and not bit & self.tokens

    def with_tokens(self, bits: int) -> Provenance:
        return dataclasses.replace(self, tokens=self.tokens | (bits & self.weight_bits))


def _union(marks) -> int:
    if isinstance(marks, tuple):
        out = 0
        for m in marks:
            out |= _union(m)
        return out
    return marks


def _join(a, b):
    """Provenance that holds a's and b's. None yet (0, what a value has before the walk
    reaches its sources, e.g. a loop body's parameter before its loop binds it) joins as
    nothing, so that it does not merge a tuple's elements that arrive later."""
    if a == 0 or b == 0:
        return b if a == 0 else a
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_join(x, y) for x, y in zip(a, b))
    return _union(a) | _union(b)


class _Flow:
    def __init__(self, module: HloModule, weight_bits: int):
        self.module = module
        self.weight_bits = weight_bits
        self.values: dict[str, object] = {}
        self.bound: dict[str, dict[int, object]] = {}   # computation -> parameter -> marks
        self.applied: dict[tuple, object] = {}   # (computation, operand marks) -> result marks
        self.tokens = 0
        self.changed = True

    def run(self) -> dict[str, int]:
        entry = self.module.entry
        self.inside = _walked(self.module)
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

    def _apply(self, computation: str, operands: tuple):
        """The marks of a computation's result on operands with these marks, op by op in
        the order XLA prints them (uses after definitions); memoised."""
        key = (computation, operands)
        if key not in self.applied:
            comp = self.module.computations.get(computation)
            values: dict[str, object] = {}
            result = _computed(operands)
            for instr in comp.instructions if comp is not None else ():
                if instr.opcode == "parameter":
                    number = instr.parameter_number or 0
                    marks = operands[number] if number < len(operands) else 0
                else:
                    marks = self._eval(instr, False, tuple(values.get(o, 0) for o in instr.operands))
                values[instr.name] = marks
                if instr.is_root:
                    result = marks
            self.applied[key] = result
        return self.applied[key]

    def _eval(self, instr: Instruction, in_entry: bool, operands: tuple | None = None):
        if operands is None:
            operands = tuple(self._operand(instr, i) for i in range(len(instr.operands)))
        self._see_tokens(instr, operands)
        marks = self._flow(instr, in_entry, operands)
        if isinstance(marks, int) and not marks & COMPUTED and marks & self.weight_bits \
                and instr.result and not instr.is_tuple and not is_float(instr.result[0].dtype):
            return marks | COMPUTED   # integers and booleans are never weights
        return marks

    def _see_tokens(self, instr: Instruction, operands: tuple) -> None:
        """Moved parameters that this op treats as tokens (see the module docstring)."""
        if not operands:
            return
        if instr.opcode in TOKEN_OPCODES or (
                instr.opcode == "custom-call" and "topk" in instr.custom_call_target.lower()):
            read = operands[:1] + (operands[2:] if instr.opcode == "scatter" else ())
        elif instr.opcode in _INDEXED and _from_floats(_union(operands[1:]), self.weight_bits):
            read = operands[:1] + (operands[2:] if instr.opcode == "scatter" else ())
        else:
            return
        for marks in read:
            self.tokens |= self._moved(marks)

    def _moved(self, marks) -> int:
        """The weight bits of marks that only move parameters."""
        bits = _union(marks) if not isinstance(marks, int) else marks
        return bits & self.weight_bits if bits and not bits & ~self.weight_bits else 0

    def _flow(self, instr: Instruction, in_entry: bool, operands: tuple):
        op = instr.opcode
        if op == "parameter":
            number = instr.parameter_number or 0
            if in_entry:
                return param_bit(number)
            return self.bound.get(instr.computation, {}).get(number, 0)
        if op == "get-tuple-element":
            marks = operands[0] if operands else 0
            index = instr.tuple_index
            if isinstance(marks, tuple) and index is not None and index < len(marks):
                return marks[index]
            return _union(marks)
        if op == "tuple":
            return operands
        if op in _CONTROL and op != "while" and not any(c in self.inside for c in instr.called):
            # A fusion whose insides hold no collective: a pure function of its operands.
            roots = [self._apply(c, operands) for c in instr.called]
            return roots[0] if len(roots) == 1 else _union(tuple(roots) + operands)
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
            taken = _union(tuple(self._root(b) for b in branches))
            return taken | _computed(operands[:1])   # a data-dependent branch computes
        if op in _CONTROL:   # fusion, call, async-start holding a collective: walked
            for comp in instr.called:
                for number, marks in enumerate(operands):
                    self._bind(comp, number, marks)
            roots = [self._root(c) for c in instr.called]
            return roots[0] if len(roots) == 1 else _union(tuple(roots) + operands)
        return _union(operands) if moves(instr) else _computed(operands)


def _from_floats(bits: int, weight_bits: int) -> bool:
    """Computed from floating-point arguments (router logits, not token ids)."""
    return bool(bits & COMPUTED and bits & weight_bits)


def _computed(marks) -> int:
    """What an op that computes makes of its operands: their provenance, computed."""
    bits = _union(marks)
    return bits | COMPUTED if bits else 0


def _walked(module: HloModule) -> set[str]:
    """Computations walked op by op: loop bodies and conditions, branches and calls, and
    fusions that hold a collective (themselves or in what they call). Reducers, sort
    comparators and other fusions are not: the ops calling them compute or move as a whole."""
    holding = {i.computation for i in module.instructions()
               if i.opcode.removesuffix("-start") in COLLECTIVE_KINDS}
    changed = True
    while changed:
        changed = False
        for instr in module.instructions():
            if instr.computation not in holding and any(c in holding for c in instr.called):
                holding.add(instr.computation)
                changed = True
    control = {c for i in module.instructions() if i.opcode in ("while", "conditional", "call")
               for c in i.called}
    return holding | control


def provenance(module: HloModule, named: frozenset[int] | None = None) -> Provenance:
    """Every value's provenance in the partitioned `module`. The floating-point entry
    parameters may be weights (of them only those in `named`, where the user named the
    parameters: `params_argnums`)."""
    weight_bits = 0
    for instr in module.entry.instructions:
        number = instr.parameter_number
        if instr.opcode == "parameter" and number is not None and instr.result \
                and is_float(instr.result[0].dtype) and (named is None or number in named):
            weight_bits |= param_bit(number)
    flow = _Flow(module, weight_bits)
    bits = flow.run()
    return Provenance(bits=bits, weight_bits=weight_bits, tokens=flow.tokens)
