"""Reading what the user asked for from the lowered StableHLO (MLIR bindings)."""

from __future__ import annotations

import inspect

import jax
from jax.sharding import AxisType

from shardlint.analyzer._stablehlo import asked_for
from shardlint.examples import steps


def _mesh():
    return jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Auto,) * 2)


def _line(function, text):
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_sharding_constraints_with_their_specs_and_lines():
    fn, args = steps.make_attention_step(_mesh())
    asked = asked_for(jax.jit(fn).lower(*args).compiler_ir("stablehlo"))
    constraints = {(a.line, a.dims) for a in asked if a.op == "sharding_constraint"}
    k_line = _line(steps.attention_kv_gather, "k = jax.lax.with_sharding_constraint")
    v_line = _line(steps.attention_kv_gather, "v = jax.lax.with_sharding_constraint")
    gathered = (("data",), (), (), ())
    assert constraints == {(k_line, gathered), (v_line, gathered)}
    assert all(a.file.endswith("examples/steps.py") for a in asked)


def test_shard_map_specs_are_read():
    fn, args = steps.make_per_shard_step(_mesh())
    asked = asked_for(jax.jit(fn).lower(*args).compiler_ir("stablehlo"))
    maps = [a for a in asked if a.op == "shard_map"]
    assert maps and all(a.file.endswith("examples/steps.py") for a in maps)


def test_a_step_that_asks_for_nothing():
    fn, args = steps.make_step(_mesh())
    assert [a for a in asked_for(jax.jit(fn).lower(*args).compiler_ir("stablehlo"))
            if a.op != "shard_map"] == []
