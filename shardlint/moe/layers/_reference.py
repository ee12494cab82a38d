"""RoutedMoE: the reference layer, and the shape of the bug.

It flattens (batch, seq, emb) into (tokens, emb) over the *global* arrays, as MaxText's
RoutedMoE does, and then routes, sorts and multiplies all tokens at once. Numerically this
is the definition the sharded layer must match. Under context parallelism (seq sharded
over a mesh axis) the flatten merges a replicated-or-batch-sharded major dimension with a
sequence-sharded minor one; XLA cannot express that as a tiled sharding, so it all-gathers
the sequence and the memory saving of context parallelism is lost inside this layer.
It is kept deliberately unchanged so tests and benchmarks can show that.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Iterator

import jax

from ._config import MoeConfig
from ._experts import Params, init_moe_params, moe_tokens


# Who serves RoutedMoE calls instead of the layer itself: `shardlint.rewrite`'s swap route
# sets it for the duration of one trace. A context variable, so nothing patches the class
# and a trace elsewhere (another thread, another context) is not affected.
_served_by: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "shardlint_routed_moe_served_by", default=None)


@contextlib.contextmanager
def served_by(call: Callable | None) -> Iterator[None]:
    """Inside, `RoutedMoE(cfg)(params, x)` returns `call(layer, params, x)` (None: the
    layer itself)."""
    token = _served_by.set(call)
    try:
        yield
    finally:
        _served_by.reset(token)


@dataclasses.dataclass(frozen=True)
class RoutedMoE:
    """Routed SwiGLU experts over globally flattened tokens.

    `params = RoutedMoE(cfg).init(key)` is a dict {"gate": [D, E], "wi_0": [E, D, F],
    "wi_1": [E, D, F], "wo": [E, F, D]}; the same pytree serves ShardedRoutedMoE.
    """

    cfg: MoeConfig

    def init(self, key: jax.Array) -> Params:
        return init_moe_params(key, self.cfg)

    def __call__(self, params: Params, x_BSD: jax.Array) -> jax.Array:
        serve = _served_by.get()
        if serve is not None:
            return serve(self, params, x_BSD)
        B, S, D = x_BSD.shape
        with jax.named_scope("moe/flatten"):
            x_TD = x_BSD.reshape(B * S, D)
        y_TD = moe_tokens(x_TD, params, self.cfg)
        return y_TD.reshape(B, S, D)
