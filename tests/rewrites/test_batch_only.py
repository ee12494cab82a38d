"""Routing that loses a batch axis alone (only the batch sharded, or the context degree 1
of a sweep), and MoE shapes other than flatten-then-sort: rewritten per shard over the
axes that were lost, with the same numbers."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
from jax.sharding import PartitionSpec as P

import shardlint
from shardlint.rewrites import verify_same

from support import build_mesh, rewrite_steps

# name: (make, mesh axes, the axes the routing loses, whether the gathered tokens are most
# of temp: the flattened sequence is; the routing tensors of a layer that runs every expert
# on every token are small next to its [batch, seq, experts, mlp] pass, which stays sharded)
CASES = {
    "flatten, top_k, sort; batch over data": (rewrite_steps.make_batch_only_step, {"data": 8}, ("data",), True),
    "experts first, then top_k selects; data x context": (
        rewrite_steps.make_select_after_experts_step, {"data": 2, "context": 4}, ("data", "context"), False),
    "experts first, then top_k selects; batch over data": (
        lambda mesh: rewrite_steps.make_select_after_experts_step(mesh, P("data", None, None)), {"data": 8},
        ("data",), False),
}


@pytest.mark.parametrize("name", CASES)
def test_routing_that_loses_its_axes_is_rewritten_per_shard(name):
    make, axes, lost, shrinks = CASES[name]
    mesh = build_mesh(axes)
    fn, args = make(mesh)
    before = shardlint.analyze(fn, *args)
    routing = [f for f in before.findings if f.op in ("top_k", "sort", "gather")]
    assert routing and {a for f in routing for a in f.axes} == set(lost)
    fixed = shardlint.rewrite(fn, mesh, args=args, analysis=before, verify=False)
    assert fixed.changed is True
    after = shardlint.analyze(fixed, *args)
    assert after.findings == () and after.all_gathers() == ()
    # What the rewrite adds (its psums, the transpose of its shard_map) points at the user's lines.
    sources = [c.source for c in after.collectives] + [b.source for b in after.memory.peak_buffers]
    assert not [s for s in sources if s and "shardlint/rewrites" in s.file], sources
    if shrinks:
        assert after.memory.temp_bytes < before.memory.temp_bytes / 2
    assert verify_same(fn, fixed, args, rtol=1e-5, atol=1e-6)


def test_the_readme_model_with_only_the_batch_sharded_is_rewritten_from_the_cli(run_cli, tmp_path):
    """The README's model.py, its x sharded over `data` alone, `--mesh data=8 --rewrite`:
    its findings over data go, and the exit code is a clean analysis's."""
    model = dict(_regenerate().model_files())["model.py"]
    sharded = 'P("data", "context", None)'
    assert sharded in model
    (tmp_path / "model.py").write_text(model.replace(sharded, 'P("data", None, None)'))
    target = f"{tmp_path / 'model.py'}:make_step"
    plain = run_cli("analyze", target, "--mesh", "data=8")
    assert plain.returncode == 1 and "2 finding(s)" in plain.stdout and "over data" in plain.stdout, plain.stdout
    fixed = run_cli("analyze", target, "--mesh", "data=8", "--rewrite", "--json", str(tmp_path / "after.json"))
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "finding(s)" not in fixed.stdout, fixed.stdout
    # What the rewrite adds (its psums, its shard_map's transpose) points at the model's lines.
    assert "shardlint/rewrites" not in (tmp_path / "after.json").read_text()


def _regenerate():
    """docs/regenerate.py, which reads the README's model.py out of the README."""
    path = pathlib.Path(__file__).resolve().parents[2] / "docs" / "regenerate.py"
    spec = importlib.util.spec_from_file_location("regenerate", path)
    module = sys.modules.setdefault("regenerate", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module
