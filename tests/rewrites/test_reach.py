"""The rewrite reaches the MoE where training code has it: scanned and rematerialized
layers, pre-jitted steps with shardings and donation, `nnx.jit` with `nnx.Optimizer`, FSDP
weights. After it no `lost` finding is left, every output (loss, gradients, updated
parameters) is unchanged, and per-device temp memory falls with the context degree."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import shardlint
from shardlint.rewrites import verify_same
from shardlint.jaxpr import sub_of

from support import build_mesh, cause_steps, context_mesh, rewrite_steps
from support.cause_steps import LAYERS

# name: (make, its keyword arguments, rewrite's keyword arguments)
CASES = {
    "scan+remat": (cause_steps.make_scanned_layers_step, {}, {}),
    "scan": (cause_steps.make_scanned_layers_step, {"remat": False}, {}),
    "python loop+remat": (rewrite_steps.make_remat_loop_step, {}, {}),
    # The forward is a call of the scan's known part (closed_call / eval_jaxpr).
    "remat around the scan": (rewrite_steps.make_remat_around_scan_step, {}, {}),
    "pre-jitted, donated": (cause_steps.make_prejitted_step, {}, {}),
    "nnx.jit + nnx.Optimizer": (cause_steps.make_nnx_step, {}, {}),
    "nnx.scan + nnx.remat, nnx.Optimizer": (cause_steps.make_nnx_step, {"scanned": True}, {}),
    "fsdp weights": (rewrite_steps.make_fsdp_moe_step, {}, {}),
    # MaxText's dense path in miniature: top_k and a scatter into [batch, seq, experts].
    "scatter dispatch, no flatten": (cause_steps.make_scatter_dispatch_step, {}, {}),
    "scatter dispatch, scanned+remat": (rewrite_steps.make_scanned_scatter_step, {"remat": True}, {}),
    # Without remat the forward saves the scatter's per-shard (batch, seq, expert) indices
    # for the backward, which reads them per shard too.
    "scatter dispatch, scanned": (rewrite_steps.make_scanned_scatter_step, {}, {}),
    # JAX hands the scan one table per shard and two globally: the traces pair by use.
    "size-cached tables, scanned+remat": (rewrite_steps.make_size_cached_tables_step, {}, {}),
    # Every expert on every token, then the top-k outputs picked by advanced indexing.
    "every expert, then pick": (rewrite_steps.make_every_expert_step, {}, {}),
    "every expert, then pick; scan+remat": (cause_steps.make_scanned_layers_step,
                                            {"moe": rewrite_steps.every_expert_moe}, {}),
    "nnx.scan + nnx.remat, every expert, then pick": (cause_steps.make_nnx_step,
                                                      {"scanned": True, "moe": rewrite_steps.every_expert_moe}, {}),
    # GShard capacity, opted in to per-shard capacity; at this factor nothing drops.
    "gshard, per-shard capacity": (rewrite_steps.make_gshard_step, {"capacity_factor": 4.0},
                                   {"capacity": "per-shard"}),
}


@functools.cache
def _case(name: str, context: int = 4):
    if name.startswith("nnx"):
        pytest.importorskip("flax")
        pytest.importorskip("optax")
    make, kwargs, rewrite_kwargs = CASES[name]
    mesh = context_mesh(context)
    fn, args = make(mesh, **kwargs)
    before = shardlint.analyze(fn, *args)
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before, **rewrite_kwargs)
    after = shardlint.analyze(fixed, *args)
    return mesh, fn, args, fixed, before, after


@pytest.mark.parametrize("name", CASES)
def test_no_lost_sharding_is_left(name):
    *_, fixed, before, after = _case(name)
    assert fixed.changed is True
    assert any(f.cause == "lost" and "context" in f.axes for f in before.findings)
    assert after.findings == ()
    # What gathers are left move weights (FSDP) as the code asked, never activations.
    assert {c.cause for c in after.all_gathers()} <= {"weights"}
    if name.startswith("every expert"):   # its expert einsums kept their tokens sharded:
        assert after.memory.temp_bytes < before.memory.temp_bytes   # the routing and the pick gathered
    elif not name.startswith("scatter"):  # there the activations were sharded all along
        assert after.memory.temp_bytes < before.memory.temp_bytes / 2


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("nnx")])
def test_loss_and_every_gradient_are_unchanged(name):
    _, fn, args, fixed, *_ = _case(name)
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scanned", [False, True], ids=["one layer", "nnx.scan"])
def test_nnx_step_updates_model_and_optimizer_as_the_original(scanned, mesh):
    pytest.importorskip("flax")
    from flax import nnx

    step, (model, optimizer, x) = cause_steps.make_nnx_step(mesh, concrete=True, scanned=scanned)
    fixed = shardlint.rewrite(step, mesh, args=(model, optimizer, x))
    assert fixed.changed is True
    results = []
    for run in (step, fixed):
        m, o = nnx.clone(model), nnx.clone(optimizer)
        loss = run(m, o, x)
        results.append((loss, nnx.state(m), nnx.state(o)))
    (want_loss, *want_states), (got_loss, *got_states) = results
    np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss), rtol=1e-5, atol=1e-6)
    for want, got in zip(want_states, got_states):
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_pre_jitted_step_keeps_its_donation_and_shardings():
    mesh, fn, args, fixed, *_ = _case("pre-jitted, donated")
    want = fn.lower(*args).compile()
    got = fixed.lower(*args).compile()
    assert got.input_shardings == want.input_shardings
    assert got.output_shardings == want.output_shardings
    # The parameters are donated: XLA aliases them to the updated parameters.
    assert want.memory_analysis().alias_size_in_bytes > 0
    assert got.memory_analysis().alias_size_in_bytes == want.memory_analysis().alias_size_in_bytes


@pytest.mark.parametrize("name", ["scan+remat", "scan"])
def test_scanned_step_keeps_its_scans_and_layer_count(name):
    _, fn, args, fixed, *_ = _case(name)

    def scans(jaxpr):
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                found.append(eqn.params["length"])
            sub = sub_of(eqn)
            if sub is not None:
                found += scans(sub.jaxpr)
        return found

    want = scans(jax.make_jaxpr(fn)(*args).jaxpr)
    got = scans(jax.make_jaxpr(fixed)(*args).jaxpr)
    assert want == [LAYERS, LAYERS]     # forward and backward
    assert got == want


@functools.cache
def _temps(make, context: int) -> tuple[int, int]:
    """Per-device temp bytes of `make`'s step before and after the rewrite, on `context`
    devices that shard only the sequence (the batch per device stays the same)."""
    mesh = build_mesh({"data": 1, "context": context})
    fn, args = make(mesh)
    before = shardlint.analyze(fn, *args)
    if context == 1:
        return before.memory.temp_bytes, before.memory.temp_bytes
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before)
    return before.memory.temp_bytes, shardlint.analyze(fixed, *args).memory.temp_bytes


@pytest.mark.parametrize("context", [2, 4, 8])
@pytest.mark.parametrize("make", [cause_steps.make_scanned_layers_step, rewrite_steps.make_config_mask_step],
                         ids=["scan+remat", "config-length mask"])
def test_temp_memory_falls_with_the_context_degree(make, context):
    before, after = _temps(make, context)
    # Ideal per-device temp: the unsharded sequence's (one device) over the context
    # degree. The rewritten step stays within 15% of it; the original does not.
    ideal = _temps(make, 1)[0] / context
    assert after <= 1.15 * ideal
    assert before > 1.15 * ideal


def test_flattened_routing_leaving_the_step_is_refused_never_miscomputed(mesh):
    """Tokens in per-shard order mean something else outside the region: the rewrite
    refuses to return them and names the line of the op that made them (top_k)."""
    fn, args = rewrite_steps.make_routing_returned_step(mesh)
    with pytest.raises(shardlint.RewriteError,
                       match=r"per-shard value \(int32\[512,2\] at shardlint/examples/steps\.py:\d+.*"
                             r"leaves the routed region"):
        shardlint.rewrite(fn, mesh, args=args)


@functools.cache
def _config_mask_case(built_in_step: bool):
    mesh = context_mesh(4)
    fn, args = rewrite_steps.make_config_mask_step(mesh, built_in_step=built_in_step)
    before = shardlint.analyze(fn, *args)
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before)
    return fn, args, fixed, before, shardlint.analyze(fixed, *args)


def _in_the_moe(analysis):
    return [f for f in analysis.findings if f.source and f.source.file.endswith("examples/steps.py")]


@pytest.mark.parametrize("built_in_step", [False, True], ids=["closed-over mask", "mask built in the step"])
def test_config_length_mask_is_rewritten(built_in_step):
    """The mask of the configured length meets a shard's scores: the attention stays global,
    and the MoE runs per shard."""
    fn, args, fixed, before, after = _config_mask_case(built_in_step)
    assert fixed.changed is True
    assert _in_the_moe(before) and _in_the_moe(after) == []
    # The attention's own findings (its scores read the whole sequence) stay: not the MoE's.
    assert {f.source.file for f in after.findings} == {"tests/support/rewrite_steps.py"}
    assert after.memory.temp_bytes < before.memory.temp_bytes / 2
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-6)


# Code outside the routed region that does not run at one shard's shapes stays as the user
# wrote it, at global shapes; only the MoE runs per shard. name: (make, keyword arguments).
OUTSIDE = {
    # The step's Python takes another branch at a shard's sequence length; the jaxpr keeps
    # the branch the step runs.
    "a branch on the sequence length": (rewrite_steps.make_size_branch_step, {}),
    "a branch on the sequence length that mixes tokens": (rewrite_steps.make_size_branch_step, {"mixing": True}),
    # A [seq, seq] parameter of the configured length contracted with the sequence.
    "a contraction with the configured length": (rewrite_steps.make_token_mixing_step, {}),
}


@pytest.mark.parametrize("name", OUTSIDE)
def test_code_outside_the_region_that_cannot_run_per_shard_stays_global(name, mesh):
    make, kwargs = OUTSIDE[name]
    fn, args = make(mesh, **kwargs)
    before = shardlint.analyze(fn, *args)
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before, verify=False)
    assert fixed.changed is True
    assert _in_the_moe(before) and _in_the_moe(shardlint.analyze(fixed, *args)) == []
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-6)


def test_a_configured_table_read_in_the_routed_region_is_refused_at_its_line(mesh):
    """Sliced to a shard's size, a table of the configured length is the first shard's:
    which part each shard needs, the per-shard pass cannot say (tokens in per-shard order
    are not a block of the global order)."""
    fn, args = rewrite_steps.make_scaled_tokens_step(mesh)
    with pytest.raises(shardlint.RewriteError, match=r"mul at tests/support/rewrite_steps\.py:\d+ in the routed "
                                                     r"region reads float32\[512,1\], whose part on each shard "
                                                     r"is not known"):
        shardlint.rewrite(fn, mesh, args=args)


def test_cli_takes_the_token_axes_and_report_shows_a_refusal(tmp_path, capsys):
    from shardlint import cli

    out = tmp_path / "report.html"
    code = cli.main(["report", "shardlint.examples.steps:make_capacity_step", "--mesh", "data=2,context=4",
                     "--out", str(out), "--batch-axes", "data", "--seq-axes", "context"])
    assert code == 1                      # the original's findings
    page = out.read_text()
    assert 'data-figure="rewrite-note"' in page and "The rewrite was refused: " in page and "capacity" in page
    assert "The rewrite was refused" in capsys.readouterr().err
    assert cli.main(["report", "shardlint.examples.steps:make_capacity_step", "--mesh", "data=2,context=4",
                     "--out", str(out), "--per-shard-capacity"]) == 0
    assert 'data-figure="rewrite-note"' not in out.read_text()
    # A step with nothing to rewrite: the page says so instead of comparing it with itself.
    assert cli.main(["report", "shardlint.examples.steps:make_per_shard_step", "--mesh", "data=2,context=4",
                     "--out", str(out)]) == 0
    page = out.read_text()
    assert "Nothing was rewritten: the analysis finds no sharding lost" in page
    assert "before → after rewrite" not in page
    assert cli.main(["analyze", "shardlint.examples.steps:make_step", "--mesh", "data=2,context=4",
                     "--rewrite", "--seq-axes", "ctx"]) == 2
    assert "not axes of the mesh" in capsys.readouterr().err


def test_gshard_capacity_is_refused_by_default_with_the_opt_in(mesh):
    fn, args = rewrite_steps.make_gshard_step(mesh)
    with pytest.raises(shardlint.RewriteError, match=r"rewrite_steps\.py:\d+ .*capacity.*capacity='per-shard'"):
        shardlint.rewrite(fn, mesh, args=args)


def test_per_shard_capacity_changes_which_tokens_drop(mesh):
    # Where the capacity drops tokens, per-shard capacity drops others: the numbers differ
    # and verification says so. That is why it is opt-in.
    fn, args = rewrite_steps.make_gshard_step(mesh, capacity_factor=1.0)
    fixed = shardlint.rewrite(fn, mesh, args=args, capacity="per-shard")
    assert fixed.changed is True
    with pytest.raises(shardlint.RewriteError, match="different numbers"):
        verify_same(fn, fixed, args, rtol=1e-5, atol=1e-6)



def test_jax_refusing_the_emitted_step_is_a_rewrite_error(monkeypatch, mesh):
    # Whatever JAX raises while tracing the rewritten step reaches the user as a
    # RewriteError that says so, never as a raw traceback.
    from shardlint.rewrites.routes import _jaxpr as _rewritten

    def broken_emit(plan, mesh):
        def run(*flat):
            raise ValueError("Incompatible shapes for broadcasting: (4, 16) and (8, 16)")
        return run

    monkeypatch.setattr(_rewritten, "emit", broken_emit)
    fn, args = cause_steps.make_scanned_layers_step(mesh)
    with pytest.raises(shardlint.RewriteError, match=r"rewritten step does not trace.*ValueError: Incompatible"):
        shardlint.rewrite(fn, mesh, args=args)


def test_shardlint_failing_while_tracing_the_rewritten_step_says_so_and_keeps_the_cause(monkeypatch, mesh, capsys):
    """An exception raised in shardlint's own code (here a KeyError in its emit stage, as
    the issue's `KeyError: Var(id=...)` came from its origins pass) is a RewriteError that
    names it as shardlint's bug, where it was raised, and keeps it as its cause, so that
    --traceback prints the whole chain."""
    from shardlint.cli import main
    from shardlint.rewrites.emit import _emit
    from shardlint.rewrites.routes import _jaxpr as _rewritten

    def lookup(*flat):
        raise KeyError("Var(id=1):bool[256,256]")

    lookup.__code__ = lookup.__code__.replace(co_filename=_emit.__file__)   # raised in shardlint's emit
    monkeypatch.setattr(_rewritten, "emit", lambda plan, mesh: lookup)
    fn, args = cause_steps.make_scanned_layers_step(mesh)
    with pytest.raises(shardlint.RewriteError) as raised:
        shardlint.rewrite(fn, mesh, args=args)
    message = str(raised.value)
    assert message.startswith("shardlint failed while tracing the rewritten step")
    assert "KeyError: 'Var(id=1):bool[256,256]' (raised at shardlint/rewrites/emit/_emit.py:" in message
    assert "bug of shardlint's" in message and isinstance(raised.value.__cause__, KeyError)

    assert main(["analyze", "shardlint.examples.steps:make_step", "--mesh", "data=2,context=4", "--rewrite",
                 "--traceback"]) == 2
    err = capsys.readouterr().err
    assert "shardlint: error: shardlint failed while tracing the rewritten step" in err
    assert "KeyError: 'Var(id=1):bool[256,256]'" in err and "The above exception was the direct cause" in err
    assert 'emit/_emit.py", line' in err     # the frame that raised it, in the printed chain


def test_a_layer_inside_custom_jvp_is_reached(mesh):
    # A forward function whose MoE sits in a custom_jvp (a fused layer with its own
    # derivative rule): the body is entered and inlined in the rewritten step.
    from shardlint.examples.steps import routed_moe

    @jax.custom_jvp
    def layer(params, x_BSD):
        return routed_moe(params, x_BSD, cause_steps.TOP_K)

    @layer.defjvp
    def _layer_jvp(primals, tangents):
        return layer(*primals), jax.numpy.zeros_like(primals[1])

    args = (cause_steps._moe_params(mesh), cause_steps._batch(mesh))
    assert any(e.primitive.name == "custom_jvp_call" for e in jax.make_jaxpr(layer)(*args).jaxpr.eqns)
    before = shardlint.analyze(layer, *args)
    fixed = shardlint.rewrite(layer, mesh, args=args, analysis=before)
    assert fixed.changed is True and before.findings
    assert shardlint.analyze(fixed, *args).findings == ()
    assert verify_same(layer, fixed, args, rtol=1e-5, atol=1e-6)
