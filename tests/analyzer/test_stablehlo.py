"""Reading what the user asked for from the lowered StableHLO (MLIR bindings)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint.analyzer.parse._stablehlo import asked_for
from shardlint.examples import steps


def _line(function, text):
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_sharding_constraints_with_their_specs_and_lines(mesh):
    fn, args = steps.make_attention_step(mesh)
    asked = asked_for(jax.jit(fn).lower(*args).compiler_ir("stablehlo"))
    constraints = {(a.line, a.dims) for a in asked if a.op == "sharding_constraint"}
    k_line = _line(steps.attention_kv_gather, "k = jax.lax.with_sharding_constraint")
    v_line = _line(steps.attention_kv_gather, "v = jax.lax.with_sharding_constraint")
    gathered = (("data",), (), (), ())
    assert constraints == {(k_line, gathered), (v_line, gathered)}
    assert all(a.file.endswith("examples/steps.py") for a in asked)


def test_shard_map_specs_are_read(mesh):
    fn, args = steps.make_per_shard_step(mesh)
    asked = asked_for(jax.jit(fn).lower(*args).compiler_ir("stablehlo"))
    maps = [a for a in asked if a.op == "shard_map"]
    assert maps and all(a.file.endswith("examples/steps.py") for a in maps)


def test_a_step_that_asks_for_nothing(mesh):
    fn, args = steps.make_step(mesh)
    assert [a for a in asked_for(jax.jit(fn).lower(*args).compiler_ir("stablehlo"))
            if a.op != "shard_map"] == []


def _marker(tag: str) -> int:
    with open(__file__) as fh:
        return next(n for n, line in enumerate(fh, 1) if line.rstrip().endswith(f"# <- {tag}"))


def _constrain(x):
    return jax.lax.with_sharding_constraint(x, P("data", None))  # <- constrain


def _layer(x):
    return _constrain(x) * 2  # <- layer


def _model(x):
    return _layer(x) + 1  # <- model


def test_a_constraint_in_a_helper_carries_the_whole_stack(mesh):
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", "context")))
    with jax.set_mesh(mesh):
        module = jax.jit(_model).lower(x).compiler_ir("stablehlo")
    (asked,) = [a for a in asked_for(module) if a.op == "sharding_constraint"]
    assert [line for _, line in asked.stack[:3]] == [_marker("constrain"), _marker("layer"), _marker("model")]
    assert all(file == __file__ for file, _ in asked.stack[:3])
    assert (asked.file, asked.line) == asked.stack[0]
    assert asked.dims == (("data",), ()) and asked.shape == (8, 16)


def test_shard_map_carries_its_stack_and_shape(mesh):
    fn, args = steps.make_per_shard_step(mesh)
    maps = [a for a in asked_for(jax.jit(fn).lower(*args).compiler_ir("stablehlo")) if a.op == "shard_map"]
    assert maps and all(a.stack and (a.file, a.line) == a.stack[0] and a.shape for a in maps)
