"""Token-sized constants a shard rebuilds at its own size.

JAX hoists loop-invariant values out of a scan body (iotas over tokens, `arange(T) // K`)
and a step's constants may be token-sized too. Inside a shard the region needs them at
the shard's size: a builder binds the equations that make such a value from constants
alone again at one shard's shapes (`shard.ShardBinder`), also across a body boundary (a
scan's hoisted constant is built in the outer jaxpr).
"""

from __future__ import annotations

import numpy as np

from ...jaxpr import is_literal, variables
from ..shard import ShardBinder


class Builders:
    """Token-sized values built from constants alone (iota, zeros, `arange(T) // K`): a
    shard rebuilds them at its own size by binding their equations again there."""

    def __init__(self, jaxpr, consts, producer, scaled, built_in, binder: ShardBinder,
                 positional_in=frozenset(), unsure=frozenset()):
        self.eqns = jaxpr.eqns
        # Values the per-shard pass cannot tell (`trace.ShardShapes.unsure`): never built.
        self.unsure = unsure
        self.producer, self.scaled, self.built_in = producer, scaled, built_in
        self.binder = binder
        self.positional_in = positional_in   # the built_in values that hold positions
        self.consts = dict(zip(jaxpr.constvars, consts))
        self._memo: dict = {}
        self._positions: dict = {}

    def leaves(self) -> dict:
        """The token-sized values of this jaxpr that are buildable with no equation of it
        (built in an outer jaxpr, or constants), and whether each holds positions."""
        return {v: self.holds_positions(v) for v in (*self.built_in, *self.consts)
                if v in self.scaled and v not in self.unsure}

    def holds_positions(self, v) -> bool:
        """Whether a buildable value's content is positions (built from an iota, or a
        constant that is not the same everywhere): per shard they are local ones."""
        if v not in self._positions:
            self._positions[v] = False
            if v in self.built_in:
                found = v in self.positional_in
            elif v in self.consts:
                value = np.asarray(self.consts[v])
                found = value.size > 1 and not bool(np.all(value == value.flat[0]))
            elif v in self.producer:
                eqn = self.eqns[self.producer[v]]
                found = eqn.primitive.name == "iota" or any(
                    self.holds_positions(u) for u in variables(eqn.invars))
            else:
                found = False
            self._positions[v] = found
        return self._positions[v]

    def can_build(self, v) -> bool:
        if v in self._memo:
            return self._memo[v]
        self._memo[v] = False
        p = self.producer.get(v)
        ok = v not in self.unsure and (v in self.built_in or v in self.consts or (
            p is not None and all(self.can_build(u) for u in variables(self.eqns[p].invars))))
        self._memo[v] = ok
        return ok

    def builder(self, v):
        """A function of a per-body memo that returns `v` at one shard's size."""
        if v in self.built_in:
            return self.built_in[v]
        if v in self.consts:
            value = self.binder.constant(v, self.consts[v])
            return lambda memo: value
        p = self.producer[v]
        eqn = self.eqns[p]
        inputs = [None if is_literal(a) else self.builder(a) for a in eqn.invars]
        position = eqn.outvars.index(v)
        key = (id(self), p)

        def build(memo):
            if key not in memo:
                invals = [self.binder.operand(eqn, k, a, b(memo) if b is not None else None)
                          for k, (a, b) in enumerate(zip(eqn.invars, inputs))]
                memo[key] = self.binder.bind(eqn, invals)
            return memo[key][position]

        return build

