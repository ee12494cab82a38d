"""Where each value of a step's jaxpr was made, and how to make it again at the size an op
meets it with at one shard's shapes (`_shard_shapes`'s pass asks, and starts again).

A value is made again back to where it was made: an iota or a broadcast scalar at any size,
a constant sliced (a stand-in: the first shard's content, unless it is the same everywhere
or an arange), an elementwise result from its operands at their fitted sizes. What cannot
be made from its sources at that size (a random draw, a token-mixing contraction) is a
placeholder of that size: a shape, no content. Where even that cannot be (a value met at two
sizes), the op that met it gives placeholders from then on (`opaque`).
"""

from __future__ import annotations

import math

import numpy as np

from ... import _jax
from ..._errors import ShardlintError, shardlint_bug
from ..shard import FOLLOWS_FIRST, Unfit, elementwise, fitted, reshaped
from ...jaxpr import is_literal, sub_of, variables


class ResizeAndRetry(Exception):
    """An op met operands at other sizes: the pass stops (it runs inside `jax.eval_shape`,
    which an exception leaves cleanly), the graph makes them again at these shapes
    (`Graph.rebuild`), and the pass runs again."""

    def __init__(self, eqn, resized: dict):
        super().__init__()
        self.eqn, self.resized = eqn, resized


class Graph:
    """Where each value of a jaxpr and its bodies was made: the equation, a constant, or
    the operand of the call whose body takes it; and what the passes so far decided."""

    def __init__(self, jaxpr, consts):
        self.sizes: dict = {}     # Var -> the shape its per-shard value is made at
        # constants sliced to a shard's size: the first shard's content, not each one's
        self.stand_ins: set = set()
        # results made at the size they are met with, not from their operands: a shape, no
        # content (the region reads the real value where it reads one)
        self.placeholders: set = set()
        self.opaque: dict = {}    # id(eqn) -> why it does not bind at one shard's shapes
        self.producer: dict = {}
        self.constants: dict = {}  # constvar -> its value
        self.outer: dict = {}     # body input -> (the call's operand, whether one slice of it)
        self.caller: dict = {}    # id(a body's equation) -> the equation whose body it is in
        self._index(jaxpr, consts)

    def _index(self, jaxpr, consts, caller=None) -> None:
        self.constants.update(zip(jaxpr.constvars, consts))
        for eqn in jaxpr.eqns:
            self.producer.update((v, eqn) for v in eqn.outvars)
            if caller is not None:
                self.caller[id(eqn)] = caller
            sub = sub_of(eqn)
            if sub is None:
                continue
            for k, (a, inner) in enumerate(zip(eqn.invars, sub.jaxpr.invars)):
                if not is_literal(a):
                    self.outer[inner] = (a, sub.stacks and k >= sub.sliced_from)
            self._index(sub.jaxpr, sub.consts, eqn)

    def line_of(self, eqn) -> str:
        """` at file:line` of the user's line that traced `eqn`, or of the call it is in (an
        op inside a jitted helper, `jnp.where`'s, has none of its own)."""
        while eqn is not None:
            line = _jax.eqn_line(eqn)
            if line:
                return line
            eqn = self.caller.get(id(eqn))
        return ""

    def iota_dimension(self, var) -> int | None:
        """The dimension of `var` along which it counts 0, 1, 2, ... where it is an iota
        (broadcast, converted, or passed into a body: JAX hoists a loop's one-hot iota out
        of a scan), else None."""
        if var in self.outer:
            operand, sliced = self.outer[var]
            return None if sliced else self.iota_dimension(operand)
        eqn = self.producer.get(var)
        if eqn is None:
            return None
        name, operand = eqn.primitive.name, eqn.invars[0] if eqn.invars else None
        sub = sub_of(eqn)
        if name == "iota":
            return eqn.params["dimension"]
        if sub is not None and not sub.stacks:
            inner = sub.jaxpr.outvars[eqn.outvars.index(var)]
            return None if is_literal(inner) else self.iota_dimension(inner)
        if operand is None or is_literal(operand):
            return None
        if name == "convert_element_type":
            return self.iota_dimension(operand)
        if name == "broadcast_in_dim":
            found = self.iota_dimension(operand)
            return None if found is None else eqn.params["broadcast_dimensions"][found]
        return None

    def unbound(self, eqn, why: str) -> None:
        """`eqn` does not bind at one shard's shapes: its results are placeholders from now on."""
        self.opaque[id(eqn)] = why
        self.placeholders.update(eqn.outvars)

    def rebuild(self, resize: ResizeAndRetry, shapes: dict) -> None:
        """Makes each value the op met at its shape in the next pass (`shapes`: this
        pass's), rebuilding what it is made from. Where that cannot be (a value that would
        have two sizes, or is still not what it meets), the op that met them gives
        placeholders from then on."""
        sizes, stand_ins, placeholders = dict(self.sizes), set(self.stand_ins), set(self.placeholders)
        done: set = set()
        try:
            for var, shape in resize.resized.items():
                self._rebuild(var, shape, shapes, done)
        except Unfit as e:
            self.sizes, self.stand_ins, self.placeholders = sizes, stand_ins, placeholders
            self.unbound(resize.eqn, str(e))
        except ShardlintError:
            raise
        except Exception as e:   # shardlint's own bug: said with the op it was working on
            raise shardlint_bug(f"making the operands of {resize.eqn.primitive.name}"
                                f"{self.line_of(resize.eqn)} again at one shard's shapes", e) from e

    def _rebuild(self, var, shape: tuple, shapes: dict, done: set) -> None:
        if var in done:
            if self.sizes[var] != shape:
                raise Unfit(f"{var.aval.str_short()} meets values of two sizes at one shard's shapes")
            return
        if self.sizes.get(var) == shape:   # made so before, and still not what it meets
            raise Unfit(f"{var.aval.str_short()} does not settle at one shard's shapes")
        if var not in self.producer and var not in self.outer and var not in self.constants:
            raise Unfit(f"an input of the step ({var.aval.str_short()}) keeps its size per shard")
        done.add(var)
        self.sizes[var] = shape
        if var in self.constants:
            if not _made_at_any_size(self.constants[var]):
                self.stand_ins.add(var)
            return
        try:
            sources = self._sources(var, shape, shapes)
        except Unfit:   # what it is made from cannot give that size: a placeholder of it
            self.placeholders.add(var)
            return
        for source, wanted in sources:
            if shapes.get(source) != wanted:
                self._rebuild(source, wanted, shapes, done)
        if any(source in self.stand_ins for source, _ in sources):
            self.stand_ins.add(var)

    def _sources(self, var, shape: tuple, shapes: dict) -> list:
        """(value, the shape it must have) for each value `var` is made from, for `var`
        to have `shape`; an iota or a broadcast scalar is made at any size."""
        eqn = self.producer.get(var)
        if eqn is None:   # a body's input: the call's operand
            operand, sliced = self.outer[var]
            return [(operand, (_now(operand, shapes)[0], *shape) if sliced else shape)]
        if id(eqn) in self.opaque:
            raise Unfit(f"{var.aval.str_short()} is made by {eqn.primitive.name}, which does not bind per shard")
        name = eqn.primitive.name
        operands = variables(eqn.invars)
        sub = sub_of(eqn)
        if sub is not None:   # the body's result at the same place
            k = eqn.outvars.index(var)
            inner = sub.jaxpr.outvars[k]
            stacked = sub.stacks and k >= sub.sliced_from - _jax.scan_counts(eqn.params)[0]
            if is_literal(inner):
                raise Unfit(f"{var.aval.str_short()} made by {name} meets a value of another size")
            return [(inner, shape[1:] if stacked else shape)]
        if name == "iota":
            return []
        if name == "reshape":
            operand = eqn.invars[0]
            if math.prod(shape) == math.prod(_now(operand, shapes)):
                return []
            return [(operand, reshaped(var.aval.shape, shape, operand.aval.shape)[0])]
        if name == "broadcast_in_dim":
            out = var.aval.shape
            return [(a, tuple(shape[d] if n == out[d] else n
                              for n, d in zip(a.aval.shape, eqn.params["broadcast_dimensions"])))
                    for a in operands[:1] if a.aval.shape]
        if name.startswith(("reduce_", "arg")) and "axes" in eqn.params:   # reduced dims kept
            rest = iter(shape)
            operand = eqn.invars[0]
            return [(operand, tuple(n if d in eqn.params["axes"] else next(rest)
                                    for d, n in enumerate(_now(operand, shapes))))]
        if name == "concatenate":
            axis = eqn.params["dimension"]
            return [(a, shape[:axis] + (_now(a, shapes)[axis],) + shape[axis + 1:]) for a in operands]
        if elementwise(eqn) or name in FOLLOWS_FIRST:
            wanted_of = [(a, fitted(a.aval.shape, var.aval.shape, shape))
                         for a in (operands[:1] if name in FOLLOWS_FIRST else operands)]
            return [(a, wanted) for a, wanted in wanted_of if wanted is not None]
        raise Unfit(f"{var.aval.str_short()} made by {name} meets a value of another size")


def _now(var, shapes: dict) -> tuple:
    """`var`'s shape in this pass; its global one where the pass has not made it (a jitted
    helper's result, made from nothing, that no op has met at another size yet)."""
    return shapes.get(var, var.aval.shape)


def _made_at_any_size(value) -> bool:
    """Whether a constant's leading block is what making it at that size gives: the same
    value everywhere, or positions 0, 1, 2, ... along one dimension (an arange computed
    once), which a shard takes as its own positions."""
    value = np.asarray(value)
    if value.size <= 1 or bool(np.all(value == value.flat[0])):
        return True
    return any(np.array_equal(value, np.broadcast_to(
        np.arange(n).reshape([n if k == d else 1 for k in range(value.ndim)]), value.shape))
        for d, n in enumerate(value.shape))


def from_configuration(jaxpr, stand_ins: set) -> frozenset:
    """`stand_ins` and the values computed from them and from constants alone (no input
    of the step), in the bodies too (a body's input is what the call's operand is)."""
    found = set(stand_ins)
    fixed = set(jaxpr.constvars)   # computed from constants alone

    def walk(jaxpr) -> None:
        fixed.update(jaxpr.constvars)
        for eqn in jaxpr.eqns:
            ins = variables(eqn.invars)
            sub = sub_of(eqn)
            if sub is not None:
                for a, inner in zip(eqn.invars, sub.jaxpr.invars):
                    if is_literal(a) or a in fixed:
                        fixed.add(inner)
                    elif a in found:
                        found.add(inner)
                walk(sub.jaxpr)
                for out, inner in zip(eqn.outvars, sub.jaxpr.outvars):
                    if is_literal(inner) or inner in fixed:   # a body may return a literal
                        fixed.add(out)
                    elif inner in found:
                        found.add(out)
            elif all(a in found or a in fixed for a in ins):
                (found if any(a in found for a in ins) else fixed).update(eqn.outvars)

    walk(jaxpr)
    return frozenset(found)
