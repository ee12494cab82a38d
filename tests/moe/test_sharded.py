"""ShardedRoutedMoE == RoutedMoE (outputs and gradients), and its compiled HLO keeps the
token axis sharded where the reference all-gathers it.

Each case is (mesh, x sharding, layer keywords); one compiled vjp step per case serves
both the numerics and the HLO assertions. The layer runs in its default, memory-lean
layout (weights' embed dimension sharded over the token axes; the expert matrices gathered
whole along it in pieces, the router kernel in one) unless a case asks for
`weight_gather="ring"` (the expert matrices' slices passed round those axes) or
`weight_axes=()` (weights whole on every token shard).
"""

from __future__ import annotations

import collections
import math
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlint import moe
from shardlint.moe.layers._axes import as_axes
from shardlint.moe.layers._layout import EMBED_DIMS

DP_CP = ("data", "context")
CASES = {
    # id: (mesh shape, mesh axis names, x spec, ShardedRoutedMoE keywords)
    "cp1x8": ((1, 8), DP_CP, P("data", "context"), {}),
    "cp2x4": ((2, 4), DP_CP, P("data", "context"), {}),
    "cp4x2": ((4, 2), DP_CP, P("data", "context"), {}),
    "ep_a2a": ((2, 2, 2), DP_CP + ("expert",), P(("data", "expert"), "context"),
               {"expert_axis": "expert"}),
    "ep_psum": ((2, 2, 2), DP_CP + ("expert",), P("data", "context"),
                {"expert_axis": "expert"}),
    "tp": ((2, 2, 2), DP_CP + ("tensor",), P("data", "context"), {"tensor_axis": "tensor"}),
    "tp_seq_parallel": ((2, 2, 2), DP_CP + ("tensor",), P("data", ("context", "tensor")),
                        {"tensor_axis": "tensor"}),
    "ep_tp": ((2, 2, 2), ("context", "expert", "tensor"), P("expert", "context"),
              {"expert_axis": "expert", "tensor_axis": "tensor"}),
    # expert and tensor parallelism over the data x context axes themselves
    "ep_data_2x4": ((2, 4), DP_CP, P("data", "context"), {"expert_axis": "data"}),
    "ep_data_4x2": ((4, 2), DP_CP, P("data", "context"), {"expert_axis": "data"}),
    # an expert axis of one device that shards no tokens (MaxText's mesh at context 1)
    "ep_one_device": ((2, 4, 1), DP_CP + ("expert",), P("data", "context"),
                      {"expert_axis": "expert"}),
    "tp_context_4x2": ((4, 2), DP_CP, P("data", "context"), {"tensor_axis": "context"}),
    "tp_context_1x8": ((1, 8), DP_CP, P("data", "context"), {"tensor_axis": "context"}),
    # the weights whole on every token shard (the layout before weight_axes existed)
    "cp2x4_whole": ((2, 4), DP_CP, P("data", "context"), {"weight_axes": ()}),
    "ep_a2a_whole": ((2, 2, 2), DP_CP + ("expert",), P(("data", "expert"), "context"),
                     {"expert_axis": "expert", "weight_axes": ()}),
    # the expert matrices' slices passed round the weight axes instead of gathered whole
    "cp2x4_ring": ((2, 4), DP_CP, P("data", "context"), {"weight_gather": "ring"}),
    "ep_a2a_ring": ((2, 2, 2), DP_CP + ("expert",), P(("data", "expert"), "context"),
                    {"expert_axis": "expert", "weight_gather": "ring"}),
    "tp_seq_parallel_ring": ((2, 2, 2), DP_CP + ("tensor",), P("data", ("context", "tensor")),
                             {"tensor_axis": "tensor", "weight_gather": "ring"}),
    "cp4x2_ring_context": ((4, 2), DP_CP, P("data", "context"),
                           {"weight_gather": "ring", "weight_axes": "context"}),
}
STRATEGIES = {"sparse": {}, "dense": {"strategy": "dense"},
              # capacity large enough to drop nothing, but computed, not defaulted
              "dense_cf": {"strategy": "dense", "capacity_factor": 4.0}}


def _axes(spec):
    as_tuple = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
    return {"batch_axes": as_tuple(spec[0]), "seq_axes": as_tuple(spec[1])}


@pytest.fixture(scope="module")
def lib(moe_testlib):
    return moe_testlib


def reference_step(lib, strategy):
    cfg = lib.config(**STRATEGIES[strategy])
    layer = moe.RoutedMoE(cfg)
    x, r = lib.activations()
    return lib.compiled_vjp(("ref", strategy), layer, layer.init(jax.random.key(0)), x, r)


def sharded_step(lib, case, strategy):
    shape, names, x_spec, kwargs = CASES[case]
    cfg = lib.config(**STRATEGIES[strategy])
    mesh = lib.make_mesh(shape, names)
    layer = moe.ShardedRoutedMoE(cfg, mesh, **_axes(x_spec), **kwargs)
    x, r = lib.activations()
    return lib.compiled_vjp(("sharded", case, strategy), layer,
                            layer.init(jax.random.key(0)), x, r, mesh, x_spec,
                            layer.param_specs())


NUMERIC_CASES = [(c, "sparse") for c in CASES] + [(c, "dense") for c in CASES] + [
    ("cp2x4", "dense_cf"), ("ep_a2a", "dense_cf")]


@pytest.mark.parametrize("case,strategy", NUMERIC_CASES)
def test_sharded_equals_reference_outputs_and_gradients(lib, case, strategy):
    want_y, want_dp, want_dx = reference_step(lib, strategy).run()
    y, dp, dx = sharded_step(lib, case, strategy).run()
    assert float(np.abs(want_y).max()) > 0.1  # the comparison is not between zeros
    lib.assert_tree_close(y, want_y)
    lib.assert_tree_close(dx, want_dx)
    lib.assert_tree_close(dp, want_dp)


@pytest.mark.parametrize("case", ["cp2x4", "ep_a2a", "tp_seq_parallel", "ep_data_4x2"])
def test_param_shardings_are_the_layout_and_gradients_leave_in_it(lib, case):
    shape, names, x_spec, kwargs = CASES[case]
    layer = moe.ShardedRoutedMoE(lib.config(), lib.make_mesh(shape, names), **_axes(x_spec),
                                 **kwargs)
    shardings = layer.param_shardings()
    params = jax.eval_shape(layer.init, jax.random.key(0))
    assert jax.tree.structure(shardings) == jax.tree.structure(params)
    assert {k: s.spec for k, s in shardings.items()} == layer.param_specs()
    assert all(s.mesh == layer.mesh for s in shardings.values())
    # memory-lean: each device holds 1/devices of every expert weight, the router's D sliced
    for k in ("wi_0", "wi_1", "wo"):
        local = shardings[k].shard_shape(params[k].shape)
        assert np.prod(local) * layer.mesh.size == np.prod(params[k].shape), (k, local)
    weight_degree = int(np.prod([layer.mesh.shape[a] for a in layer.weight_axes]))
    assert shardings["gate"].shard_shape((lib.D, lib.E)) == (lib.D // weight_degree, lib.E)
    compiled = sharded_step(lib, case, "sparse").compiled
    dparams = compiled.output_shardings[1]
    for k, s in shardings.items():
        assert dparams[k].is_equivalent_to(s, params[k].ndim), (k, dparams[k], s)


# ---- compiled HLO: which collectives exist, and on what shapes ----

_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\(?[a-z0-9]+\[[^=]*?)\s+(?P<kind>all-gather|all-reduce|all-to-all|"
    r"reduce-scatter|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


def collectives(hlo: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    found = []
    for m in _COLLECTIVE.finditer(hlo):
        dims = [tuple(int(d) for d in a.split(",") if d) for a in _ARRAY.findall(m["shape"])]
        found.append((m["kind"], dims))
    return found


def _local(layer, name, shape) -> tuple[int, ...]:
    """Per-device shape of a weight."""
    spec = tuple(layer.param_specs()[name]) + (None,) * len(shape)
    degree = lambda entry: int(np.prod([layer.mesh.shape[a] for a in as_axes(entry)]))
    return tuple(n // degree(spec[d]) for d, n in enumerate(shape))


def _pieces(layer, name, shape) -> tuple[int, tuple[int, ...], set[tuple[int, ...]]]:
    """How a weight gathered whole comes: in how many pieces (the expert matrices in 2 per
    weight device, or fewer where that does not divide their K; the router kernel in one),
    the gather's result (each device's piece of its slice, stacked over the n devices),
    and the shapes its gradient's piece is reduced on: whole along D (shard_map's psum of
    a gathered value's gradient over its own device) and reduce-scattered (one device's
    piece, before its stacking dim is dropped)."""
    local = _local(layer, name, shape)
    n, asked = layer.weight_slices.size, layer.weight_slices.pieces
    pieces = 1 if name == "gate" else math.gcd(asked, local[-2])
    piece = local[:-2] + (local[-2] // pieces, local[-1])
    whole = tuple(d * n if i == EMBED_DIMS[name] else d for i, d in enumerate(piece))
    return pieces, (n,) + piece, {whole, (1,) + piece}


def _weight_shapes(layer, params) -> set[tuple[int, ...]]:
    """Global and per-device shapes of the weights and of their gradients' pieces (their
    gradients' reductions)."""
    return {()} | {tuple(w.shape) for w in params.values()} | {
        _local(layer, k, w.shape) for k, w in params.items()} | set().union(
        *(_pieces(layer, k, w.shape)[2] for k, w in params.items()))


HLO_CASES = ["cp2x4", "cp1x8", "ep_a2a", "cp2x4_ring", "ep_a2a_ring", "cp2x4_whole",
             "ep_a2a_whole"]


@pytest.mark.parametrize("case", HLO_CASES)
@pytest.mark.parametrize("strategy", ["sparse", "dense"])
def test_sharded_hlo_moves_no_activations(lib, case, strategy):
    step = sharded_step(lib, case, strategy)
    shape, names, x_spec, kwargs = CASES[case]
    layer = moe.ShardedRoutedMoE(lib.config(**STRATEGIES[strategy]),
                                 lib.make_mesh(shape, names), **_axes(x_spec), **kwargs)
    params = step.args[0]
    weights = _weight_shapes(layer, params)
    found = collectives(step.hlo)
    assert found, "a data-parallel step reduces its weight gradients"
    kinds = {kind for kind, _ in found}
    allowed = {"all-reduce"} | ({"all-to-all"} if "expert_axis" in kwargs else set())
    if layer.weight_axes:
        # each weight gathered whole piece by piece, for the forward pass and again for
        # the backward pass (behind an optimization barrier, which XLA:CPU may drop and
        # then merge the two passes' first pieces), in a loop after the first piece when
        # there is more than one; each piece's gradient reduce-scattered. Under the ring,
        # the expert matrices and their gradients move as one device's slice per
        # collective-permute instead.
        travelling = ("wi_0", "wi_1", "wo") if layer.weight_gather == "ring" else ()
        allowed |= {"all-gather", "reduce-scatter"} | (
            {"collective-permute"} if travelling else set())
        gathered = collections.Counter(dims[0] for kind, dims in found if kind == "all-gather")
        pieces = [_pieces(layer, k, w.shape) for k, w in params.items() if k not in travelling]
        at_most = collections.Counter()
        for count, piece, _ in pieces:
            at_most[piece] += 2 if count == 1 else 4
        assert gathered.keys() == at_most.keys(), found
        assert all(gathered[s] <= n for s, n in at_most.items()), found
        assert "reduce-scatter" in kinds, found
        permuted = {dims[0] for kind, dims in found if kind == "collective-permute"}
        assert permuted == {_local(layer, k, params[k].shape) for k in travelling}, found
    else:
        assert "all-gather" not in kinds, found
    assert kinds <= allowed, found
    for kind, dims in found:
        if kind in ("all-reduce", "reduce-scatter"):  # weight gradients, the scalar loss
            assert set(dims) <= weights, (kind, dims, weights)
    if "expert_axis" in kwargs:
        assert "all-to-all" in kinds


def test_reference_all_gathers_the_sequence(lib):
    """The bug reproduces: the reference's flatten gathers the context-sharded sequence."""
    _, names, x_spec, _ = CASES["cp2x4"]
    mesh = lib.make_mesh((2, 4), names)
    layer = moe.RoutedMoE(lib.config())
    x, r = lib.activations()
    step = lib.compiled_vjp(("ref_on_mesh", "cp2x4"), layer, layer.init(jax.random.key(0)),
                            x, r, mesh, x_spec)
    gathers = [dims for kind, dims in collectives(step.hlo) if kind == "all-gather"]
    local_batch = lib.B // mesh.shape["data"]
    assert (local_batch, lib.S, lib.D) in {d for dims in gathers for d in dims}, gathers
    # and it still computes the same thing
    lib.assert_tree_close(step.run(), reference_step(lib, "sparse").run())


def test_named_scopes_name_the_parts(lib):
    hlo = sharded_step(lib, "ep_a2a", "sparse").hlo
    scopes = set(re.findall(r'op_name="[^"]*?(moe/[a-z_]+)', hlo))
    assert {"moe/route", "moe/sort", "moe/experts", "moe/combine", "moe/dispatch",
            "moe/all_to_all"} <= scopes, scopes


def test_expert_parallel_buckets_never_drop_even_if_every_token_picks_one_device(lib):
    """Worst case for the all-to-all buckets: all tokens route to experts 0 and 1, which
    live on the same device of the expert axis. Dropless means still equal."""
    cfg = lib.config()
    shape, names, x_spec, kwargs = CASES["ep_a2a"]
    mesh = lib.make_mesh(shape, names)
    layer = moe.ShardedRoutedMoE(cfg, mesh, **_axes(x_spec), **kwargs)
    params = dict(layer.init(jax.random.key(0)))
    params["gate"] = params["gate"].at[:, :].set(-1.0).at[:, 0].set(2.0).at[:, 1].set(1.0)
    x, r = lib.activations()
    x = abs(x)  # positive features: logits order experts 0 > 1 > the rest for every token
    _, experts = moe.route(x.reshape(-1, lib.D), params["gate"], cfg)
    assert set(np.unique(np.asarray(experts)).tolist()) == {0, 1}
    want = lib.compiled_vjp("ref_skewed", moe.RoutedMoE(cfg), params, x, r).run()
    got = lib.compiled_vjp("ep_skewed", layer, params, x, r, mesh, x_spec,
                           layer.param_specs()).run()
    lib.assert_tree_close(got, want)


def test_dense_with_drops_is_the_reference_applied_per_shard(lib):
    """Documented semantics: the sharded dense layer's capacity is per local group."""
    cfg = lib.config(strategy="dense", capacity_factor=1.0)
    shape, names, x_spec, _ = CASES["cp2x4"]
    mesh = lib.make_mesh(shape, names)
    layer = moe.ShardedRoutedMoE(cfg, mesh, **_axes(x_spec))
    params = layer.init(jax.random.key(0))
    x, r = lib.activations()
    y = np.asarray(lib.compiled_vjp("dense_drop", layer, params, x, r, mesh, x_spec,
                                    layer.param_specs()).run()[0])
    ref = jax.jit(moe.RoutedMoE(cfg))
    b, s = lib.B // shape[0], lib.S // shape[1]
    per_shard = np.concatenate([
        np.concatenate([np.asarray(ref(params, x[i * b:(i + 1) * b, j * s:(j + 1) * s]))
                        for j in range(shape[1])], axis=1) for i in range(shape[0])], axis=0)
    np.testing.assert_allclose(y, per_shard, rtol=1e-5, atol=1e-5)
    global_ref = np.asarray(ref(params, x))
    assert not np.allclose(y, global_ref, atol=1e-3), "capacity 1.0 should drop differently"
