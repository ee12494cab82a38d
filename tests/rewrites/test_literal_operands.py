"""A body the rewrite enters (a jitted helper holding the routed MoE) whose caller passes it a
Python number: JAX binds that operand as a literal, which is not hashable. The emitter once
looked each operand up among the per-shard values ("TypeError: unhashable type: 'Literal'",
met on MaxText's deepseek3-tiny preset, tests/integrations/test_maxtext_presets.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import shardlint
from shardlint.examples.steps import routed_moe
from shardlint.jaxpr import is_literal

from support.cause_steps import TOP_K, _batch, _moe_params


@jax.jit
def scaled_moe(params, x_BSD, scale):
    return x_BSD + scale * routed_moe(params, x_BSD, TOP_K)


def step(params, x_BSD):
    return jax.value_and_grad(lambda p: jnp.mean(scaled_moe(p, x_BSD, 0.5) ** 2))(params)


def test_a_literal_operand_of_a_rewritten_body(mesh):
    args = (_moe_params(mesh), _batch(mesh))
    jaxpr = jax.make_jaxpr(step)(*args)
    calls = [e for e in jaxpr.eqns if e.primitive.name in ("pjit", "jit")]
    assert any(is_literal(a) for e in calls for a in e.invars), jaxpr
    fixed = shardlint.rewrite(step, mesh, args=args)     # verified on random inputs
    assert fixed.changed is True
    moe = routed_moe.__code__.co_filename.split("/shardlint/", 1)[1]
    assert not [f for f in shardlint.analyze(fixed, *args).findings if f.source and f.source.file.endswith(moe)]
