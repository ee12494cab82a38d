"""Trace a step's jaxpr again at one shard's shapes, where its Python cannot.

A step that builds a value from its configuration rather than from its input (a causal
mask of the configured sequence length) does not trace with the sequence divided: the
mask meets shard-sized scores. The per-shard trace is then made from the global jaxpr
instead, equation for equation, each bound again on shard-sized operands (a body that
JAX shares between calls stays shared). Operands give most results their shapes; a
broadcast follows its operand; a reshape keeps its segments. Where an op meets operands
at other sizes (elementwise, a concatenation, a contraction, a scatter's indices), the
one that shrank along fewer dimensions is rebuilt at the size it meets, back to where it
was made (a broadcast or iota at that size, a constant sliced), and the trace starts
again.

What this trace cannot tell, it says (`Retraced`), and the planner refuses a region that
reads or makes it:
- stand-ins: what is rebuilt from a constant has a shard's shape but not its content (a
  sliced mask is the first shard's), and so has what is computed from it and constants
  alone. Outside the regions the rewritten step runs globally, so there they do no harm.
- guessed splits: a reshape that splits a shrunk dimension in two (tokens back into batch
  and sequence) gives the shrinking to the outer dimension first; only a value of a known
  shape that the result meets settles it (the residual stream it is added to).
Numbers the step's Python drew from array sizes (a mean's 1/T, jnp's index wrap-around)
keep their global values here.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from .. import _jax
from .._errors import first_line
from ._refusals import user_line
from ._replay import read
from ._shard_shapes import FOLLOWS_FIRST, Unfit, broadcast_shape, elementwise, fitted, mend, reshaped
from ._subjaxprs import sub_of

_ATTEMPTS = 64


@dataclasses.dataclass(frozen=True)
class Retraced:
    jaxpr: object            # ClosedJaxpr at one shard's shapes, equation for equation
    # global Vars whose per-shard value has a shard's shape only: the stand-ins and what
    # is computed from them and constants alone, in bodies too
    stand_ins: frozenset
    # results of reshapes that split a shrunk dimension in a way nothing they met settled
    guessed: frozenset = frozenset()
    why: str | None = None   # why the step's own trace was not used (`_trace` says)


class _Meets(Exception):
    """An op met operands at other sizes: rebuild them at these shapes."""

    def __init__(self, resized: dict):
        super().__init__()
        self.resized = resized


def retrace(closed, avals) -> Retraced:
    """`closed` (a ClosedJaxpr at global shapes) traced again on `avals`."""
    graph = _Graph(closed.jaxpr)
    for _ in range(_ATTEMPTS):
        replay = _Replay(graph.sizes)
        try:
            jaxpr = jax.make_jaxpr(lambda *xs: replay.run(closed.jaxpr, closed.consts, xs))(*avals)
        except _Meets as meets:
            graph.rebuild(meets.resized, replay.shapes)
            continue
        return Retraced(jaxpr, _from_configuration(closed.jaxpr, graph.stand_ins), frozenset(replay.unsettled))
    raise Unfit(f"its values did not settle at one shard's shapes in {_ATTEMPTS} traces")


def _from_configuration(jaxpr, stand_ins: set) -> frozenset:
    """`stand_ins` and the values computed from them and from constants alone (no input
    of the step), in the bodies too (a body's input is what the call's operand is)."""
    found = set(stand_ins)
    fixed = set(jaxpr.constvars)   # computed from constants alone

    def walk(jaxpr) -> None:
        fixed.update(jaxpr.constvars)
        for eqn in jaxpr.eqns:
            ins = [a for a in eqn.invars if not _jax.is_literal(a)]
            sub = sub_of(eqn)
            if sub is not None:
                for a, inner in zip(eqn.invars, sub.jaxpr.invars):
                    if _jax.is_literal(a) or a in fixed:
                        fixed.add(inner)
                    elif a in found:
                        found.add(inner)
                walk(sub.jaxpr)
                for out, inner in zip(eqn.outvars, sub.jaxpr.outvars):
                    if inner in found:
                        found.add(out)
                    elif _jax.is_literal(inner) or inner in fixed:
                        fixed.add(out)
            elif all(a in found or a in fixed for a in ins):
                (found if any(a in found for a in ins) else fixed).update(eqn.outvars)

    walk(jaxpr)
    return frozenset(found)


class _Replay:
    def __init__(self, sizes: dict):
        self.sizes = sizes
        self.shapes: dict = {}    # Var -> its per-shard shape in this trace
        self.guesses: dict = {}   # Var -> the split whose guessed shape it has
        self.unsettled: set = set()   # splits not met by a value of a known shape yet
        self.bodies: dict = {}    # (body, operand types) -> the body traced again

    def run(self, jaxpr, consts, invals) -> list:
        env = {v: self._const(v, c) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, invals))
        self.shapes.update((v, np.shape(x)) for v, x in env.items())
        for eqn in jaxpr.eqns:
            outs = self._bind(eqn, [read(env, a) for a in eqn.invars])
            env.update(zip(eqn.outvars, outs))
            self.shapes.update((v, np.shape(x)) for v, x in zip(eqn.outvars, outs))
        return [read(env, v) for v in jaxpr.outvars]

    def _const(self, var, value):
        shape = self.sizes.get(var)
        return value if shape is None else np.asarray(value)[tuple(slice(0, n) for n in shape)]

    def _bind(self, eqn, invals) -> list:
        sub = sub_of(eqn)
        if sub is not None:
            return self._call(eqn, sub, invals)
        params = dict(eqn.params)
        name = eqn.primitive.name
        resized = self.sizes.get(eqn.outvars[0]) if len(eqn.outvars) == 1 else None
        if name == "broadcast_in_dim":
            params["shape"] = resized or broadcast_shape(eqn, np.shape(invals[0]))
        elif name == "iota" and resized:
            params["shape"] = resized
        elif name == "reshape" and resized:
            params["new_sizes"] = resized
        elif name == "reshape" and params.get("dimensions") is None:
            params["new_sizes"], guessed = reshaped(eqn.invars[0].aval.shape, np.shape(invals[0]),
                                                     params["new_sizes"])
            if guessed:
                self.guesses[eqn.outvars[0]] = (eqn.outvars[0], guessed)
                self.unsettled.add(eqn.outvars[0])
        try:
            with _jax.as_traced(eqn):
                out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        except (TypeError, ValueError, AssertionError) as e:   # add_any asserts its types
            resized = mend(eqn, invals)
            if resized:
                raise _Meets(resized) from None
            raise Unfit(f"{name}{user_line(eqn)} does not bind at one shard's shapes: {first_line(e)}") from None
        if elementwise(eqn):
            self._settle(eqn)
        return list(out) if eqn.primitive.multiple_results else [out]

    def _settle(self, eqn) -> None:
        """A guessed split met by a value of a known shape along the split's dimensions is
        settled; what is computed from guessed values alone has their guess."""
        shape = eqn.outvars[0].aval.shape
        operands = [a for a in eqn.invars if not _jax.is_literal(a) and fitted(a.aval.shape, shape, shape)]
        guessed = [a for a in operands if a in self.guesses]
        for a in guessed:
            split, dims = self.guesses[a]
            if any(b not in self.guesses and all(b.aval.shape[d] == shape[d] for d in dims) for b in operands):
                self.unsettled.discard(split)
        if guessed and all(a in self.guesses or a.aval.shape != shape for a in operands):
            self.guesses.update((v, self.guesses[guessed[0]]) for v in eqn.outvars)

    def _call(self, eqn, sub, invals) -> list:
        """Binds a call again with its body traced again on the shard-sized operands."""
        avals = [jax.ShapeDtypeStruct(np.shape(x)[1:] if sub.stacks and k >= sub.sliced_from else np.shape(x),
                                      inner.aval.dtype, weak_type=getattr(inner.aval, "weak_type", False))
                 for k, (x, inner) in enumerate(zip(invals, sub.jaxpr.invars))]
        key = (id(sub.jaxpr), tuple((a.shape, a.dtype, a.weak_type) for a in avals))
        if key not in self.bodies:   # a body JAX shares between calls stays shared
            self.bodies[key] = jax.make_jaxpr(lambda *xs: self.run(sub.jaxpr, sub.consts, xs))(*avals)
        body = self.bodies[key]
        params = dict(eqn.params)
        if isinstance(params[sub.key], type(body)):
            params[sub.key] = body
        elif body.consts:   # an open body (checkpoint) that now needs constants
            raise Unfit(f"the body of {eqn.primitive.name} needs constants at one shard's shapes")
        else:
            params[sub.key] = body.jaxpr
        with _jax.as_traced(eqn):
            out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        return list(out) if eqn.primitive.multiple_results else [out]


class _Graph:
    """Where each value of a jaxpr and its bodies was made: the equation, a constant, or
    the operand of the call whose body takes it."""

    def __init__(self, jaxpr):
        self.sizes: dict = {}     # Var -> the shape its per-shard value is rebuilt at
        self.stand_ins: set = set()
        self.producer: dict = {}
        self.constvars: set = set()
        self.outer: dict = {}     # body input -> (the call's operand, whether one slice of it)
        self._index(jaxpr)

    def _index(self, jaxpr) -> None:
        self.constvars.update(jaxpr.constvars)
        for eqn in jaxpr.eqns:
            self.producer.update((v, eqn) for v in eqn.outvars)
            sub = sub_of(eqn)
            if sub is None:
                continue
            self.constvars.update(sub.jaxpr.constvars)
            for k, (a, inner) in enumerate(zip(eqn.invars, sub.jaxpr.invars)):
                if not _jax.is_literal(a):
                    self.outer[inner] = (a, sub.stacks and k >= sub.sliced_from)
            self._index(sub.jaxpr)

    def rebuild(self, resized: dict, shapes: dict) -> None:
        """Makes each Var of `resized` at its shape in the next trace (`shapes`: this
        trace's), rebuilding what it is made from."""
        done: set = set()
        for var, shape in resized.items():
            self._rebuild(var, shape, shapes, done)

    def _rebuild(self, var, shape: tuple, shapes: dict, done: set) -> None:
        if var in done:
            if self.sizes[var] != shape:
                raise Unfit(f"{var.aval.str_short()} meets values of two sizes at one shard's shapes")
            return
        if self.sizes.get(var) == shape:   # rebuilt so before, and still not what it meets
            raise Unfit(f"{var.aval.str_short()} does not settle at one shard's shapes")
        done.add(var)
        self.sizes[var] = shape
        if var in self.constvars:
            self.stand_ins.add(var)
            return
        sources = self._sources(var, shape, shapes)
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
            if var not in self.outer:
                raise Unfit(f"an input of the step ({var.aval.str_short()}) keeps its size per shard "
                            "and meets a shard's tokens")
            operand, sliced = self.outer[var]
            return [(operand, (shapes[operand][0], *shape) if sliced else shape)]
        name = eqn.primitive.name
        operands = [a for a in eqn.invars if not _jax.is_literal(a)]
        sub = sub_of(eqn)
        if sub is not None:   # the body's result at the same place
            k = eqn.outvars.index(var)
            inner = sub.jaxpr.outvars[k]
            stacked = sub.stacks and k >= sub.sliced_from - _jax.scan_counts(eqn.params)[0]
            if _jax.is_literal(inner):
                raise Unfit(f"{var.aval.str_short()} made by {name} meets a value of another size")
            return [(inner, shape[1:] if stacked else shape)]
        if name == "iota":
            return []
        if name == "reshape":
            operand = eqn.invars[0]
            if math.prod(shape) == math.prod(shapes[operand]):
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
                                    for d, n in enumerate(shapes[operand])))]
        if name == "concatenate":
            axis = eqn.params["dimension"]
            return [(a, shape[:axis] + (shapes[a][axis],) + shape[axis + 1:]) for a in operands]
        if elementwise(eqn) or name in FOLLOWS_FIRST:
            wanted_of = [(a, fitted(a.aval.shape, var.aval.shape, shape))
                      for a in (operands[:1] if name in FOLLOWS_FIRST else operands)]
            return [(a, wanted) for a, wanted in wanted_of if wanted is not None]
        raise Unfit(f"{var.aval.str_short()} made by {name} meets a value of another size")
