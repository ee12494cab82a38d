"""Where values come from in a traced step (`shardlint.rewrites.trace._origins`), on jaxprs JAX
makes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardlint.jaxpr import is_literal
from shardlint.rewrites.trace._origins import from_configuration


def test_a_call_whose_body_returns_a_literal_is_configuration_there():
    """keras's jitted helpers return Python constants: the body's output is a Literal."""

    def step(x):
        doubled, one = jax.jit(lambda y: (y * 2, 1.0))(x)
        return doubled + one

    jaxpr = jax.make_jaxpr(step)(jnp.ones(3)).jaxpr
    (call,) = [e for e in jaxpr.eqns if "jaxpr" in e.params]
    assert is_literal(call.params["jaxpr"].jaxpr.outvars[1])
    # The input is no stand-in: nothing is computed from configuration alone but the literal.
    assert from_configuration(jaxpr, set()) == frozenset()
    # A stand-in's value flows through the call; the literal does not join it.
    (x,) = jaxpr.invars
    found = from_configuration(jaxpr, {x})
    assert call.outvars[0] in found and call.outvars[1] not in found
