"""A reference for `capacity="per-shard"`: the original layer run on each shard's tokens.

With per-shard capacity the rewrite gives each shard's tokens a capacity of their own
(GShard groups; what MaxText's inference-only `generate_masks_subgroup` does per context
partition), so the rewritten step cannot be checked against the original one, which
computes one capacity from the whole sequence. It is checked against the original *layer*
called once per shard instead: the tokens are split into the blocks the mesh gives each
device (the batch over its mesh axes, the sequence over its own), the layer runs on each
block as written, and the blocks' outputs are put back in place. Nothing of shardlint's
rewrite is used here, so the comparison checks the rewrite, not itself.

`per_shard` does that for any layer; `maxtext_dense_moe_per_shard` serves MaxText's
`RoutedMoE.dense_matmul` (the capacity path) that way for the duration of a trace.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding


def blocks_of(x, mesh=None) -> tuple[int, int]:
    """How many blocks the mesh cuts `x`'s batch (dim 0) and sequence (dim 1) into: the
    product of the sizes of the mesh axes that shard each, read from its NamedSharding."""
    sharding = x.sharding
    assert isinstance(sharding, NamedSharding), sharding
    mesh = mesh or sharding.mesh
    spec = tuple(sharding.spec) + (None, None)

    def degree(entry):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        return math.prod(mesh.shape[a] for a in names)

    return degree(spec[0]), degree(spec[1])


def per_shard(layer: Callable, batch_blocks: int, seq_blocks: int, *, token_args: tuple[int, ...] = (0,),
              token_kwargs: tuple[str, ...] = ()) -> Callable:
    """`layer` run separately on each of `batch_blocks` x `seq_blocks` blocks of its token
    arguments (the positional ones in `token_args`, the keyword ones in `token_kwargs`:
    `[batch, seq, ...]` arrays, or None), its outputs put back together. An output leaf
    must be a `[batch block, seq block, ...]` array or None: anything else (a statistic
    over the layer's tokens) has no per-shard meaning and is refused."""

    def run(*args, **kwargs):
        tokens = [args[i] for i in token_args] + [kwargs.get(k) for k in token_kwargs]
        b, s = next(x.shape[:2] for x in tokens if x is not None)
        if b % batch_blocks or s % seq_blocks:
            raise ValueError(f"[{b}, {s}] does not split into {batch_blocks} x {seq_blocks} blocks")
        bb, sb = b // batch_blocks, s // seq_blocks
        rows = []
        for i in range(batch_blocks):
            row = []
            for j in range(seq_blocks):
                def block(x):
                    return None if x is None else x[i * bb:(i + 1) * bb, j * sb:(j + 1) * sb]

                a = [block(x) if k in token_args else x for k, x in enumerate(args)]
                kw = {k: block(x) if k in token_kwargs else x for k, x in kwargs.items()}
                out = layer(*a, **kw)
                for leaf in jax.tree_util.tree_leaves(out):
                    if leaf.shape[:2] != (bb, sb):
                        raise ValueError(f"{layer.__name__} returns {leaf.shape}, not a [{bb}, {sb}, ...] "
                                         "block: it has no per-shard reference")
                row.append(out)
            rows.append(jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=1), *row))
        return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=0), *rows)

    return run


@contextlib.contextmanager
def maxtext_dense_moe_per_shard(batch_blocks: int, seq_blocks: int):
    """MaxText's `RoutedMoE.dense_matmul` (routing, capacity masks, dispatch, experts,
    combine) runs on each block of its tokens while this is entered: trace the step
    inside it. Its load-balance loss and bias updates must be off (None): they are
    statistics over all of the layer's tokens."""
    from maxtext.layers import moe

    original = moe.RoutedMoE.dense_matmul

    def routed(self, inputs, gate_logits, pre_bias_logits, *weights, input_ids=None,
               forced_routed_experts=None):
        def one_block(inputs, gate_logits, pre_bias_logits, *weights, input_ids=None,
                      forced_routed_experts=None):
            output, lb_loss, bias_updates = original(self, inputs, gate_logits, pre_bias_logits, *weights,
                                                     input_ids=input_ids,
                                                     forced_routed_experts=forced_routed_experts)
            if lb_loss is not None or bias_updates is not None:
                raise ValueError("the per-shard reference needs load_balance_loss_weight=0 and no "
                                 "routed bias updates: they are statistics over all tokens")
            return output

        one_block.__name__ = "RoutedMoE.dense_matmul"
        split = per_shard(one_block, batch_blocks, seq_blocks, token_args=(0, 1, 2),
                          token_kwargs=("input_ids", "forced_routed_experts"))
        return split(inputs, gate_logits, pre_bias_logits, *weights, input_ids=input_ids,
                     forced_routed_experts=forced_routed_experts), None, None

    moe.RoutedMoE.dense_matmul = routed
    try:
        yield
    finally:
        moe.RoutedMoE.dense_matmul = original
