"""The decoder example: its arguments are laid out as designed on 1x8, 2x4 and 2x2x2
meshes, the step trains (finite loss, gradients shaped like the parameters, the same
numbers on every mesh), and the analyzer finds the lost context sharding at the
reference MoE's flatten, the line found by reading `RoutedMoE.__call__`.

Each (mesh, step) is compiled once per module (functools.cache): compiles dominate the
run time on a 2-core machine. The rewrite case (the CLI target as it is, analyzed before
and after `shardlint.rewrite(..., verify=True)`) is marked slow.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardlint
from shardlint._source import display_path
from shardlint.examples import decoder
from shardlint.moe import RoutedMoE

from support import build_mesh

# One layer for the compiled cases: it holds every op of the model and halves their
# compile time. The slow rewrite case runs the default (two-layer) CLI target.
CFG = decoder.DecoderConfig(layers=1)
MESHES = {
    "1x8": {"data": 1, "context": 8},
    "2x4": {"data": 2, "context": 4},
    "2x2x2": {"data": 2, "fsdp": 2, "context": 2},
}


@functools.cache
def _made(name: str):
    mesh = build_mesh(MESHES[name])
    step, args = decoder.make_step(mesh, CFG)
    return mesh, step, args


@functools.cache
def _analysis(name: str) -> shardlint.Analysis:
    _, step, args = _made(name)
    return shardlint.analyze(step, *args)


@functools.cache
def _values():
    """Real parameters and token batches, unsharded (the same numbers for every mesh)."""
    k_params, k_tokens, k_targets = jax.random.split(jax.random.key(0), 3)
    params = decoder.init_params(k_params, CFG)
    shape = (CFG.batch, CFG.seq)
    tokens = jax.random.randint(k_tokens, shape, 0, CFG.vocab, jnp.int32)
    targets = jax.random.randint(k_targets, shape, 0, CFG.vocab, jnp.int32)
    return params, tokens, targets


@functools.cache
def _run(name: str):
    _, step, args = _made(name)
    placed = jax.tree.map(lambda v, a: jax.device_put(v, a.sharding), _values(), args)
    loss, grads = jax.jit(step)(*placed)
    return float(loss), jax.tree.map(np.asarray, grads)


def _flatten_line() -> tuple[str, int]:
    """File and line of the reshape that flattens (batch, seq) in RoutedMoE.__call__."""
    lines, first = inspect.getsourcelines(RoutedMoE.__call__)
    hits = [first + i for i, text in enumerate(lines) if ".reshape(" in text]
    # Analyses show paths relative to the working directory or their sys.path root.
    return display_path(inspect.getsourcefile(RoutedMoE)), hits[0]  # the first reshape is the flatten


# (mesh axes, expected specs of: tokens, embed, wq, wo, MoE wi_0, shared wi_0)
SPECS = [
    ({"data": 1, "context": 8},
     (P("data", "context"), P(None, None), P(None, None, None), P(None, None, None),
      P(None, None, None), P(None, None))),
    ({"data": 2, "context": 4},
     (P("data", "context"), P(None, None), P(None, None, None), P(None, None, None),
      P(None, None, None), P(None, None))),
    ({"data": 2, "fsdp": 2, "context": 2},
     (P(("data", "fsdp"), "context"), P(None, "fsdp"), P("fsdp", None, None),
      P(None, None, "fsdp"), P(None, "fsdp", None), P("fsdp", None))),
    ({"data": 2, "context": 2, "expert": 2},
     (P("data", "context"), P(None, None), P(None, None, None), P(None, None, None),
      P("expert", None, None), P(None, None))),
    ({"fsdp": 2, "context": 2, "tensor": 2},
     (P("fsdp", "context"), P("tensor", "fsdp"), P("fsdp", "tensor", None),
      P("tensor", None, "fsdp"), P(None, "fsdp", "tensor"), P("fsdp", "tensor"))),
]


@pytest.mark.parametrize("axes, expected", SPECS,
                         ids=[",".join(f"{k}={n}" for k, n in a.items()) for a, _ in SPECS])
def test_args_are_laid_out_as_designed(axes, expected):
    mesh, cfg = build_mesh(axes), decoder.DecoderConfig()
    _, (params, tokens, targets) = decoder.make_step(mesh, cfg)
    layer = params["layers"][0]
    got = (tokens.sharding.spec, params["embed"].sharding.spec, layer["wq"].sharding.spec,
           layer["wo"].sharding.spec, layer["moe"]["moe"]["wi_0"].sharding.spec,
           layer["moe"]["shared_expert"]["wi_0"].sharding.spec)
    assert got == expected
    assert targets.sharding == tokens.sharding
    assert (tokens.shape, tokens.dtype) == ((cfg.batch, cfg.seq), jnp.int32)
    assert len(params["layers"]) == cfg.layers
    # Shapes are init_params' shapes, every leaf on this mesh; specs are param_specs'.
    real = jax.eval_shape(decoder.init_params, jax.random.key(0), cfg)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), real)
    specs = decoder.param_specs(mesh, cfg)
    assert jax.tree.map(lambda a: a.sharding.spec, params) == specs
    assert all(a.sharding.mesh == mesh for a in jax.tree.leaves(params))


def test_spec_keeps_only_the_mesh_axes():
    mesh = build_mesh({"fsdp": 2, "context": 4})
    assert decoder.spec(mesh, decoder.BATCH, decoder.SEQ, None) == P("fsdp", "context", None)
    assert decoder.spec(mesh, decoder.HEADS, "context", ("data",)) == P(None, "context", None)


def test_sizes_that_do_not_divide_are_refused_with_every_reason(mesh):
    bad = decoder.DecoderConfig(batch=3, seq=30)
    with pytest.raises(ValueError, match=r"batch=3 does not divide over data(.|\n)*"
                                         r"seq=30 does not divide over context \(4 shards\)"):
        decoder.make_step(mesh, bad)


@pytest.mark.parametrize("name", list(MESHES))
def test_step_trains_on_real_parameters(name):
    loss, grads = _run(name)
    params = _values()[0]
    assert np.isfinite(loss) and loss > 0
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
        assert g.shape == p.shape and np.all(np.isfinite(g))
    # Gradient reaches the routed experts and the attention of every layer.
    for layer in grads["layers"]:
        assert np.any(layer["moe"]["moe"]["wi_0"] != 0)
        assert np.any(layer["wk"] != 0)


def test_every_mesh_computes_the_same_loss_and_gradients():
    want_loss, want = _run("2x4")
    for name in MESHES:
        loss, grads = _run(name)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", list(MESHES))
def test_analysis_finds_the_moe_flatten_losing_context(name):
    path, line = _flatten_line()
    analysis = _analysis(name)
    at_flatten = [f for f in analysis.findings
                  if f.source is not None and f.source.file == path and f.source.line == line]
    assert at_flatten, [(f.op, str(f.source)) for f in analysis.findings]
    batch = tuple(a for a in decoder.BATCH if a in MESHES[name] and MESHES[name][a] > 1)
    for f in at_flatten:
        assert (f.op, f.kind, f.feeds_grouped_matmul) == ("reshape", "lost-sharding", True)
        assert "context" in f.axes
        assert f.operand_spec[1] == ("context",)
        assert set(f.operand_spec[0]) == set(batch)
    # One forward flatten per layer, each named by its layer's scope.
    forward = sorted(f.op_path for f in at_flatten if "transpose(" not in f.op_path)
    assert len(forward) == CFG.layers
    assert all(f"layer_{i}" in p for i, p in enumerate(forward))
    # The lost sharding costs an all-gather over context at that line.
    assert any(c.kind == "all-gather" and "context" in c.axes and c.source is not None
               and (c.source.file, c.source.line) == (path, line)
               for c in analysis.collectives)


@pytest.mark.slow
def test_rewrite_leaves_only_the_kv_gathers_over_context(mesh):
    # A step of its own: rewrite finds RoutedMoE calls by tracing, which a step already
    # run under jax.jit (its trace cached) would hide.
    step, args = decoder.make_step(mesh)
    path, line = _flatten_line()
    before = shardlint.analyze(step, *args)
    flattens = [f for f in before.findings if f.feeds_grouped_matmul and f.source is not None
                and (f.source.file, f.source.line) == (path, line)]
    layers = decoder.DecoderConfig().layers
    assert len([f for f in flattens if "transpose(" not in f.op_path]) == layers
    fixed = shardlint.rewrite(step, mesh, args=args, analysis=before, verify=True)
    after = shardlint.analyze(fixed, *args)
    assert not [f for f in after.findings if "context" in f.axes]
    # What is left over context is attention's K/V gather (XLA may gather the normed
    # input once instead of K and V apiece and name it after the norm: both sit in the
    # layer's "attention" scope), once or twice per layer, in the decoder's own source.
    context_gathers = [c for c in after.all_gathers() if "context" in c.axes]
    decoder_file = inspect.getsourcefile(decoder)
    assert all(c.source is not None and c.source.file == decoder_file
               and "/attention/" in c.op_path for c in context_gathers), context_gathers
    for i in range(layers):
        assert 1 <= len([c for c in context_gathers if f"layer_{i}" in c.op_path]) <= 2
    assert after.memory.temp_bytes < before.memory.temp_bytes / 2
