"""A step whose XLA compile takes seconds: the example's routed MoE unrolled `layers` times
(a Python loop, no scan), forward and backward. A CLI target for the tests that interrupt a
compile (`tests/cli/test_interrupt.py`): `path/to/compile_heavy.py:make_step`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardlint.examples import steps


def make_step(mesh, layers: int = 24):
    _, args = steps.make_step(mesh)

    def step(params, x_BSD):
        def loss(p):
            h_BSD = x_BSD
            for _ in range(layers):
                h_BSD = jnp.tanh(h_BSD + steps.routed_moe(p, h_BSD, top_k=2))
            return jnp.mean(h_BSD ** 2)

        return jax.value_and_grad(loss)(params)

    return step, args
