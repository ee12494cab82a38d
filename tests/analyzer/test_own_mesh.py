"""Steps are lowered as `jax.jit` lowers them: with no mesh in context unless they need one.

A library that shard_maps over a `Mesh` it builds itself lowers under plain `jax.jit` and
fails inside `jax.set_mesh(mesh)`; pjit-era code needs `with mesh:`; code that reads the
mesh in context lowers without one, to another program. `shardlint analyze` runs on each
(tests/support/own_mesh_steps.py) and reads what the step asked for where it asked it.
"""

from __future__ import annotations

import json

import jax
import pytest
from jax.sharding import AxisType

import shardlint
from shardlint.cli import main
from support import build_mesh
from support import own_mesh_steps as own
from support.markers import marker_line

MESH = "data=2,context=4"
# make_with_mesh_step is pjit-era code on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:jax.experimental.pjit.pjit has been deprecated:DeprecationWarning")


def _line(marker: str) -> int:
    return marker_line(own.__file__, marker)


def _at(record: dict, marker: str) -> bool:
    source = record.get("source") or {}
    return source.get("file", "").endswith("own_mesh_steps.py") and source.get("line") == _line(marker)


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """`shardlint analyze support.own_mesh_steps:<make> --mesh data=2,context=4 --json`:
    (exit code, JSON document or None, stderr), once per step."""
    runs = {}

    def run(make: str, capsys):
        if make not in runs:
            out = tmp_path_factory.mktemp("own") / "a.json"
            code = main(["analyze", f"support.own_mesh_steps:{make}", "--mesh", MESH, "--json", str(out)])
            runs[make] = code, json.loads(out.read_text()) if out.exists() else None, capsys.readouterr().err
        return runs[make]

    return run


@pytest.mark.parametrize("make, names", [("make_own_axis_names_step", "'dp': 2, 'sp': 4"),
                                         ("make_folded_axes_step", "'expert': 8")])
def test_jit_lowers_a_library_mesh_that_set_mesh_refuses(mesh, make, names):
    """The premise, as JAX 0.10 and 0.12 behave: plain jit lowers the step, and the same
    step inside jax.set_mesh(mesh) is refused at the library's shard_map."""
    fn, args = getattr(own, make)(mesh)
    jax.jit(fn).lower(*args)
    with pytest.raises(ValueError, match=f"should match the mesh passed to shard_map Mesh\\({names}"):
        with jax.set_mesh(mesh):
            jax.jit(fn).lower(*args)


def test_cli_analyzes_a_layer_that_shard_maps_over_its_own_axis_names(cli, capsys):
    code, doc, err = cli("make_own_axis_names_step", capsys)
    assert code == 1, err
    assert "mesh in context" not in err   # lowered as plain jit lowers it
    # The routed MoE after the library's block loses context at its flatten, as it does alone.
    flatten = [f for f in doc["findings"] if f["op"] == "reshape" and f["axes"] == ["context"]]
    assert flatten and all(f["feeds_grouped_matmul"] for f in flatten)
    assert {c["kind"] for c in doc["collectives"] if c["cause"] == "lost"} == {"all-gather"}


def test_cli_analyzes_a_moe_over_an_expert_mesh_that_folds_two_axes(cli, capsys):
    code, doc, err = cli("make_folded_axes_step", capsys)
    assert code == 1, err
    assert "mesh in context" not in err
    # What XLA compiled: the flat tokens are moved onto the expert mesh's one axis by an
    # all-to-all over context at the library's flatten; nothing is gathered.
    moved = [c for c in doc["collectives"] if _at(c, "flatten")]
    assert [(c["kind"], c["axes"]) for c in moved] == [("all-to-all", ["context"])]
    assert not [c for c in doc["collectives"] if c["kind"] == "all-gather"]


@pytest.mark.parametrize("make, marker, says", [
    ("make_with_mesh_step", "with mesh", "lowered inside `with mesh:`"),
    ("make_context_mesh_step", "logical", "it reads the mesh in context"),
])
def test_cli_enters_the_mesh_a_step_needs_and_reads_what_it_asked_there(cli, capsys, make, marker, says):
    code, doc, err = cli(make, capsys)
    assert code == 0, err
    assert says in err
    (asked,) = [r for r in doc["requested"] if _at(r, marker)]
    assert asked["op"] == "sharding_constraint" and asked["axes"] == ["context"]
    assert asked["asked"] == [["data"], [], []]


def test_a_mesh_read_that_changes_nothing_lowers_without_one(mesh):
    """Flax linen's constraint lowers to nothing with no mesh in context: the program the
    step lowers to there differs, which is how the analysis knows to enter the mesh."""
    fn, args = own.make_context_mesh_step(mesh)
    assert "sharding_constraint" not in jax.jit(fn).lower(*args).as_text()
    with jax.set_mesh(mesh):
        assert "sharding_constraint" in jax.jit(fn).lower(*args).as_text()


def test_explicit_axes_reshard_is_analyzed_inside_set_mesh():
    mesh = build_mesh({"data": 2, "context": 4}, AxisType.Explicit)
    fn, args = own.make_explicit_reshard_step(mesh)
    said = []
    analysis = shardlint.analyze(fn, *args, progress=said.append)
    assert any("lowered inside jax.set_mesh(mesh)" in m and "Using PartitionSpec" in m for m in said)
    (asked,) = [r for r in analysis.requested if r.source and r.source.line == _line("reshard")]
    assert asked.asked == (("data",), (), ()) and asked.axes == ("context",)


def test_a_step_no_mesh_context_lowers_names_each_failure_and_the_way_out(capsys):
    assert main(["analyze", "support.own_mesh_steps:make_no_context_fits_step", "--mesh", MESH]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    at = f"tests/support/own_mesh_steps.py:{_line('no context fits')} in model (return halve(double(x_BSD))"
    assert line.startswith(f"shardlint: error: tracing the step failed at {at}")
    assert "): RuntimeError: pjit requires a non-empty mesh" in line
    assert "inside `with mesh:`: ValueError: The context mesh cannot be empty" in line
    assert "No mesh context lowers it" in line and "NamedSharding(mesh, spec)" in line


def test_a_broken_step_says_its_error_once(mesh):
    _, args = own.make_own_axis_names_step(mesh)

    def broken(params, x):
        return x @ x  # shapes do not match

    with pytest.raises(shardlint.AnalysisError) as info:
        shardlint.analyze(broken, *args)
    broken_line = broken.__code__.co_firstlineno + 1
    assert str(info.value).startswith(f"tracing the step failed at tests/analyzer/test_own_mesh.py:{broken_line} "
                                      "in broken (return x @ x # shapes do not match): TypeError: dot_general")
    assert "inside" not in str(info.value) and "No mesh context" not in str(info.value)
