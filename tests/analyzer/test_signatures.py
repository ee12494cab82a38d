"""Weights or activations from the values, not from the step's signature.

Each routed layer of `signature_steps` is analyzed and rewritten in three signatures:
`step(x, *weights)` with gradients for every argument (x comes back like a parameter),
`step(params, opt_state, batch, rng)`, and `step(batch, params)` (the batch first, the
parameters last). Every collective gets the same cause in every signature it appears in
(the signatures differ in what else they compute: dx, the momentum), the gathers of
computed routing tensors are never `weights`, the FSDP gathers of weights always are, and
the rewrite rewrites the same regions everywhere with the same numbers. A job's dump
written with `--xla_dump_to` alone gives the verdicts of a dump with the propagation pass.
"""

from __future__ import annotations

import collections
import warnings

import pytest

import shardlint
from shardlint.rewrites import verify_same

from support import make_mesh, signature_steps
from support.signature_steps import LAYERS, SIGNATURES

MESHES = {"2x4": (2, 4), "4x2": (4, 2)}


def _key(c) -> tuple:
    """A collective as the same op of the layer moves it, whatever the signature."""
    return (c.kind, c.axes, c.shape, c.needed_by, str(c.source))


# data=4 x context=2 with -m slow (CI's time limit): fifteen more analyses per environment.
@pytest.fixture(scope="module", params=[pytest.param(m, marks=pytest.mark.slow) if m == "4x2" else m
                                        for m in MESHES])
def analyses(request):
    """{layer: {signature: Analysis}} on one mesh."""
    mesh = make_mesh(MESHES[request.param], ("data", "context"))
    out = {}
    for layer in LAYERS:
        out[layer] = {}
        for sig in SIGNATURES:
            step, args = signature_steps.make(layer, sig, mesh)
            out[layer][sig] = shardlint.analyze(step, *args)
    return out


@pytest.mark.parametrize("layer", LAYERS)
def test_every_collective_gets_the_same_cause_in_every_signature(analyses, layer):
    causes = collections.defaultdict(set)
    for sig, analysis in analyses[layer].items():
        for c in analysis.collectives:
            causes[_key(c)].add(c.cause)
    assert {k: v for k, v in causes.items() if len(v) > 1} == {}
    for sig, analysis in analyses[layer].items():
        lost = {c.axes for c in analysis.all_gathers() if c.cause == "lost"}
        assert ("context",) in lost, (sig, analysis.collectives)


@pytest.mark.parametrize("layer", [name for name in LAYERS if name != "fsdp_weights"])
def test_computed_routing_tensors_are_never_weights(analyses, layer):
    """Gate logits, one-hot masks and top-k indices are computed from the tokens: whatever
    they are gathered for, they are activations (before, `step(x, *weights)` called them
    weights and printed "no findings"). These layers' parameters are replicated, so no
    gather of theirs is a weight's."""
    for sig, analysis in analyses[layer].items():
        assert analysis.by_cause("weights") == (), sig
        assert analysis.findings, sig


def test_fsdp_weight_gathers_are_weights_in_every_signature(analyses):
    for sig, analysis in analyses["fsdp_weights"].items():
        gathered = [c for c in analysis.all_gathers() if c.cause == "weights"]
        assert gathered, (sig, analysis.collectives)
        assert all(c.needed_by == "dot_general" for c in gathered), (sig, gathered)


def _rewritten(layer: str) -> dict:
    """{signature: (step, args, rewritten step)} of one layer on data=2 x context=4."""
    mesh = make_mesh(MESHES["2x4"], ("data", "context"))
    out = {}
    for sig in SIGNATURES:
        step, args = signature_steps.make(layer, sig, mesh)
        with warnings.catch_warnings():
            warnings.simplefilter("error", shardlint.NothingToRewrite)
            fixed = shardlint.rewrite(step, mesh, args=args, capacity="per-shard")
        out[sig] = step, args, fixed
    return out


# The constrained scatter, the per-shard capacity and the flatten with FSDP weights by default;
# the scanned layers and the flatten with replicated weights with -m slow (CI's time limit).
_SLOW_REWRITES = {"scan_remat", "flatten_ragged_dot"}


@pytest.mark.parametrize("layer", [pytest.param(name, marks=pytest.mark.slow) if name in _SLOW_REWRITES else name
                                   for name in LAYERS])
def test_the_same_regions_are_rewritten_in_every_signature(layer):
    """The token arguments come from the lost value (sharded like its batch and sequence),
    not from their place: each signature rewrites as many regions, over the same axes,
    leaves no gather of an activation and computes the same loss and gradients."""
    notes = set()
    for sig, (step, args, fixed) in _rewritten(layer).items():
        assert fixed.changed is True, (sig, fixed.notes)
        notes.add(next(n for n in fixed.notes if n.startswith("rewrote")))
        after = shardlint.analyze(fixed, *args)
        assert not after.by_cause("lost"), (sig, after.by_cause("lost"))
        assert verify_same(step, fixed, args, rtol=1e-5, atol=1e-5)
    assert len(notes) == 1, notes


def test_params_argnums_names_the_parameters_for_the_rewrite_too(mesh):
    """With the parameters named, nothing is inferred: the batch-first step is rewritten
    as it is without the name."""
    step, args = signature_steps.make("flatten_ragged_dot", "batch_then_params", mesh)
    fixed = shardlint.rewrite(step, mesh, args=args, params_argnums=(1,))
    assert fixed.changed is True
    assert verify_same(step, fixed, args)


def test_a_rng_draw_is_not_drawn_again_per_shard(mesh):
    """The train step's dropout mask is drawn over (batch, seq, emb) from its rng: the
    backward region reads it. Drawn again at one shard's size it would be another mask
    (the rewrite once computed another loss, |diff| 1e-5 at a loss of 2e-3); the region
    takes the global draw's slice instead."""
    step, args = signature_steps.make("flatten_ragged_dot", "params_opt_state_batch_rng", mesh)
    fixed = shardlint.rewrite(step, mesh, args=args)
    assert verify_same(step, fixed, args, rtol=1e-5, atol=1e-6)
