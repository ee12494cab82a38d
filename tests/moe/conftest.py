"""Shared pieces of the moe tests: tiny shapes, Auto meshes, one compile per case.

Compiles dominate the run time on a 2-core machine, so every (layer, mesh) step is
compiled once per session (`compiled_vjp`, cached by a key the test chooses) and both the
numerics and the HLO tests read the same executable.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint import moe

from support import make_mesh

B, S, D, F, E, K = 4, 16, 16, 32, 8, 2
RTOL = ATOL = 1e-5


def config(**overrides: Any) -> moe.MoeConfig:
    fields = dict(num_experts=E, top_k=K, emb_dim=D, mlp_dim=F)
    fields.update(overrides)
    return moe.MoeConfig(**fields)


def activations(shape=(B, S, D), seed: int = 1) -> tuple[jax.Array, jax.Array]:
    kx, kr = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, shape), jax.random.normal(kr, shape)


@dataclasses.dataclass
class CompiledStep:
    """`(params, x, r) -> (y, dparams, dx)` compiled once, with its placed arguments."""

    compiled: Any
    args: tuple[Any, ...]

    def run(self) -> tuple[Any, Any, Any]:
        return jax.device_get(self.compiled(*self.args))

    @property
    def hlo(self) -> str:
        return self.compiled.as_text()


def vjp_step(layer: Callable[..., jax.Array]) -> Callable[..., Any]:
    def step(params, x_BSD, r_BSD):
        y_BSD, vjp = jax.vjp(layer, params, x_BSD)
        dparams, dx_BSD = vjp(r_BSD)
        return y_BSD, dparams, dx_BSD
    return step


_CACHE: dict[Any, CompiledStep] = {}


def compiled_vjp(key: Any, layer, params, x, r, mesh=None, x_spec=None,
                 param_specs=None) -> CompiledStep:
    if key not in _CACHE:
        if mesh is not None:
            put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
            specs = param_specs or jax.tree.map(lambda _: P(), params)
            params = jax.tree.map(put, params, specs)
            x, r = put(x, x_spec), put(r, x_spec)
        args = (params, x, r)
        _CACHE[key] = CompiledStep(jax.jit(vjp_step(layer)).lower(*args).compile(), args)
    return _CACHE[key]


def assert_tree_close(actual, expected, rtol: float = RTOL, atol: float = ATOL) -> None:
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="session")
def moe_testlib():
    """The helpers above, for test modules (conftest is not importable by name)."""
    import types
    return types.SimpleNamespace(
        B=B, S=S, D=D, F=F, E=E, K=K, make_mesh=make_mesh, config=config,
        activations=activations, compiled_vjp=compiled_vjp,
        assert_tree_close=assert_tree_close, P=P, jnp=jnp)
