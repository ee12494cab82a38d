"""Token-sized constants a shard rebuilds at its own size.

JAX hoists loop-invariant values out of a scan body (iotas over tokens, `arange(T) // K`)
and a step's constants may be token-sized too. Inside a shard the region needs them at
the shard's size, which the per-shard trace computed: a builder replays the per-shard
trace's equations that make such a value from constants alone, also across a body
boundary (a scan's hoisted constant is built in the outer jaxpr).
"""

from __future__ import annotations

import numpy as np

from .. import _jax
from ._replay import bind_eqn, read


class Builders:
    """Token-sized values built from constants alone (iota, zeros, `arange(T) // K`): a
    shard rebuilds them at its own size by replaying the per-shard trace's equations."""

    def __init__(self, jaxpr, local, local_consts, producer, scaled, built_in, local_of,
                 positional_in=frozenset(), unsure=frozenset()):
        self.eqns, self.l_eqns = jaxpr.eqns, local.eqns
        # Values a retraced per-shard trace cannot tell (`_trace.Traces.unsure`): never built.
        self.unsure = unsure
        self.producer, self.scaled, self.built_in = producer, scaled, built_in
        self.positional_in = positional_in   # the built_in values that hold positions
        self.local_consts = dict(zip(local.constvars, local_consts))
        # The constants the per-shard trace has too (the traces pair values by use, `pair_vars`).
        self.local_constvar = {v: local_of[v] for v in jaxpr.constvars if v in local_of}
        self._memo: dict = {}
        self._positions: dict = {}

    def leaves(self) -> dict:
        """The token-sized values of this jaxpr that are buildable with no equation of it
        (built in an outer jaxpr, or constants), and whether each holds positions."""
        return {v: self.holds_positions(v) for v in (*self.built_in, *self.local_constvar)
                if v in self.scaled}

    def holds_positions(self, v) -> bool:
        """Whether a buildable value's content is positions (built from an iota, or a
        constant that is not the same everywhere): per shard they are local ones."""
        if v not in self._positions:
            self._positions[v] = False
            if v in self.built_in:
                found = v in self.positional_in
            elif v in self.local_constvar:
                value = np.asarray(self.local_consts[self.local_constvar[v]])
                found = value.size > 1 and not bool(np.all(value == value.flat[0]))
            elif v in self.producer:
                eqn = self.eqns[self.producer[v]]
                found = eqn.primitive.name == "iota" or any(
                    self.holds_positions(u) for u in _vars(eqn.invars))
            else:   # a constant only the global trace has: not buildable, no positions
                found = False
            self._positions[v] = found
        return self._positions[v]

    def can_build(self, v) -> bool:
        if v in self._memo:
            return self._memo[v]
        self._memo[v] = False
        p = self.producer.get(v)
        ok = v not in self.unsure and (v in self.built_in or v in self.local_constvar or (
            p is not None and all(self.can_build(u) for u in _vars(self.eqns[p].invars))))
        self._memo[v] = ok
        return ok

    def builder(self, v):
        """A function of a per-body memo that returns `v` at one shard's size."""
        if v in self.built_in:
            return self.built_in[v]
        if v in self.local_constvar:
            value = self.local_consts[self.local_constvar[v]]
            return lambda memo: value
        p = self.producer[v]
        g_eqn, l_eqn = self.eqns[p], self.l_eqns[p]
        inputs = [None if _jax.is_literal(a) else self.builder(a) for a in g_eqn.invars]
        position = g_eqn.outvars.index(v)
        key = (id(self), p)

        def build(memo):
            if key not in memo:
                invals = [read({}, la) if b is None else b(memo) for la, b in zip(l_eqn.invars, inputs)]
                memo[key] = bind_eqn(l_eqn, invals, manual=True)
            return memo[key][position]

        return build


def _vars(atoms):
    return [a for a in atoms if not _jax.is_literal(a)]
