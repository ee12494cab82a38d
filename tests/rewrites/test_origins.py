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


def test_shapes_that_do_not_settle_name_the_op_that_stopped_the_last_passes(monkeypatch):
    """A pass stops where an op meets operands of other sizes (here the positions, made at
    the whole sequence, added to one shard's tokens) and the next pass makes them again.
    Where the passes run out before the values settle, the refusal names that op and its
    line, not only the count of passes (MaxText's Llama 4 ran out of passes, issue 52)."""
    import pytest

    from shardlint.rewrites.shard import Unfit
    from shardlint.rewrites.trace import _shard_shapes

    def step(x_BSD):
        return x_BSD + jnp.arange(8, dtype=x_BSD.dtype)[None, :, None]   # <- positions

    closed = jax.make_jaxpr(step)(jnp.ones((2, 8, 4)))
    one_shard = [jax.ShapeDtypeStruct((2, 2, 4), jnp.float32)]
    settled = _shard_shapes.shard_shapes(closed, one_shard, {"context": 4})
    assert settled.shapes[closed.jaxpr.outvars[0]] == (2, 2, 4)   # in two passes
    monkeypatch.setattr(_shard_shapes, "_ATTEMPTS", 1)
    with pytest.raises(Unfit) as refused:
        _shard_shapes.shard_shapes(closed, one_shard, {"context": 4})
    line = next(n for n, text in enumerate(open(__file__), 1) if "# <- positions" in text)
    said = str(refused.value)
    assert "add(float32[2,8,4], float32[1,8,1]) at " in said and said.endswith(f"test_origins.py:{line}")
