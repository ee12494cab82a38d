"""A rewritten step is trained with as the original is: called in a loop it compiles once
(the count read from JAX's own compile events, not from timings), and after 5 steps the
parameters equal the original loop's. One case per route: the `shardlint.moe` swap, the
jaxpr rewrite of a plain function, a `jax.jit` step with shardings and donation, and
`nnx.jit` with `nnx.Optimizer`. A rewritten step is built per distinct shardings too: the
same shapes sharded otherwise are analyzed afresh, not served the first plan."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardlint
from shardlint.examples import decoder
from shardlint.rewrites import JittedStep, SwappedStep
from shardlint.rewrites._verify import random_like

from support import cause_steps

STEPS = 5
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"   # jax._src.dispatch
_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _compiles.append(event) if event == _COMPILE_EVENT else None)


@contextlib.contextmanager
def counted(into: list[int]):
    """Appends the number of XLA compiles JAX reported inside the block."""
    before = len(_compiles)
    yield
    into.append(len(_compiles) - before)


_sgd = jax.jit(lambda params, grads: jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))


def _train(step, params, batch, returns_grads: bool):
    """STEPS calls of the step, each updating the parameters; (params, compiles per call)."""
    compiles: list[int] = []
    for _ in range(STEPS):
        with counted(compiles):
            out = jax.block_until_ready(step(params, *batch))
        params = _sgd(params, out[1]) if returns_grads else out[0]
    return params, compiles


def _assert_close(got, want):
    """At `verify_same`'s float32 tolerance: after 5 SGD steps the decoder's parameters
    drift by up to 3.5e-6 between two runs of the *original* step on meshes data=2 x
    context=4 and data=8 (the same sums in another order; the rewrite's 5.5e-6)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


# route: (make the step, whether it returns (loss, grads) rather than (params, loss))
ROUTES = {
    "swap (shardlint.moe decoder)": (lambda mesh: decoder.make_step(mesh), True),
    "jaxpr (plain function, scan+remat)": (cause_steps.make_scanned_layers_step, True),
    "pre-jitted, donated": (cause_steps.make_prejitted_step, False),
}


@pytest.mark.parametrize("route", ROUTES)
def test_a_training_loop_compiles_once_and_trains_as_the_original(route, mesh):
    make, returns_grads = ROUTES[route]
    step, args = make(mesh)
    # Not verified on random inputs first: that would compile the step before the loop,
    # and the loop itself compares the numbers.
    fixed = shardlint.rewrite(step, mesh, args=args, verify=False)
    assert fixed.changed is True
    assert isinstance(fixed, SwappedStep) == route.startswith("swap")
    params, *batch = random_like(args)
    # The original is donated in one case: each loop gets its own copy of the inputs.
    want, _ = _train(step if not returns_grads else jax.jit(step), jax.tree.map(jax.numpy.copy, params),
                     batch, returns_grads)
    got, compiles = _train(fixed, params, batch, returns_grads)
    assert compiles[0] >= 1 and compiles[1:] == [0] * (STEPS - 1), compiles
    _assert_close(got, want)


def test_an_nnx_jit_loop_compiles_once_and_trains_as_the_original(mesh):
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    from flax import nnx

    step, (model, optimizer, x) = cause_steps.make_nnx_step(mesh, concrete=True)
    fixed = shardlint.rewrite(step, mesh, args=(model, optimizer, x))
    assert fixed.changed is True
    states = []
    for run in (step, fixed):
        m, o = nnx.clone(model), nnx.clone(optimizer)
        compiles: list[int] = []
        for _ in range(STEPS):
            with counted(compiles):
                jax.block_until_ready(run(m, o, x))
        states.append((nnx.state(m), nnx.state(o)))
    assert compiles[1:] == [0] * (STEPS - 1), compiles
    _assert_close(states[1], states[0])


def test_other_shardings_of_the_same_shapes_get_their_own_build(mesh):
    """Sequence sharded over context: the flatten loses it, and the step is rewritten. The
    same shapes replicated: nothing is lost, and the step must run as it is rather than
    inside the first plan's shard_map. With the batch over both axes and the sequence whole,
    the sort and top_k lose both: a plan of its own, per shard over both as batch axes."""
    step, args = cause_steps.make_scanned_layers_step(mesh)
    fixed = shardlint.rewrite(step, mesh, args=args)
    params, x = args

    def sharded(spec):
        return params, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    with pytest.warns(shardlint.NothingToRewrite):
        lowered = fixed.lower(*sharded(P()))
    assert "shard_map" not in lowered.as_text() and "manual" not in lowered.as_text()
    assert fixed.lower(*args).as_text().count("manual") > 0
    batch_only = sharded(P(("data", "context"), None, None))
    assert fixed.lower(*batch_only).as_text().count("manual") > 0
    assert fixed.notes[-1] == "rewrote 2 routed region(s) to run per shard over data, context"
    for other in (sharded(P()), batch_only):
        real = random_like(other)
        _assert_close(fixed(*real), jax.jit(step)(*real))


def test_the_rewritten_step_behaves_as_a_jitted_function(mesh):
    step, args = cause_steps.make_scanned_layers_step(mesh)
    fixed = shardlint.rewrite(step, mesh, args=args)
    assert isinstance(fixed, JittedStep) and isinstance(fixed, shardlint.rewrites.Wrapped)
    want = jax.eval_shape(step, *args)
    got = fixed.eval_shape(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(got)] == [(a.shape, a.dtype) for a in jax.tree.leaves(want)]
    assert fixed.trace(*args).lower().as_text() == fixed.lower(*args).as_text()


def test_a_swapped_pre_jitted_step_keeps_its_shardings_and_donation(mesh):
    """The swap route (models on shardlint.moe) traces the Python a jax.jit wraps again: the
    step's own jit equation goes round the new body, so its in/out shardings and donated
    parameters are the original's."""
    step, args = decoder.make_step(mesh)
    shardings = jax.tree.map(lambda a: a.sharding, args)
    jitted = jax.jit(step, in_shardings=shardings, donate_argnums=0)
    fixed = shardlint.rewrite(jitted, mesh, args=args)
    assert isinstance(fixed, SwappedStep)
    want, got = jitted.lower(*args).compile(), fixed.lower(*args).compile()
    assert got.input_shardings == want.input_shardings
    assert want.memory_analysis().alias_size_in_bytes > 0
    assert got.memory_analysis().alias_size_in_bytes == want.memory_analysis().alias_size_in_bytes
