"""Which mesh axes shard the tokens: one record for the MoE layer and the rewrites.

`ShardedRoutedMoE` reads it from its arguments (`moe._axes`) to write the `in_specs` of
its `shard_map`; a rewrite reads it from where the analysis found the sharding lost, or
from the caller, to know which arguments shrink per shard. A leaf that imports nothing of
shardlint's, so both packages share it without importing each other's private modules.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class TokenAxes:
    """Mesh axes sharding the batch and the sequence dimension of the tokens, and where
    that came from: "explicit" (named by the caller), "array" (a concrete array's
    NamedSharding), "type" (an Explicit-axes type), "rule" (`moe._axes.rule_axes`) or
    "analysis" (the operand the analysis found lost)."""

    batch: tuple[str, ...]
    seq: tuple[str, ...]
    source: str = "explicit"

    @property
    def all(self) -> tuple[str, ...]:
        return self.batch + self.seq

    @property
    def minor(self) -> tuple[str, ...]:
        """The axes that shard the minor part of flattened tokens: the sequence's, or the
        batch's where only the batch is sharded. A reshape folding them with another
        dimension puts tokens in per-shard order."""
        return self.seq or self.batch

    @property
    def x_spec(self) -> P:
        """The PartitionSpec of x_BSD these axes describe."""
        return P(self.batch or None, self.seq or None, None)


def as_axes(entry: Any) -> tuple[str, ...]:
    """A PartitionSpec entry (None, a name or a tuple of names) as a tuple of names."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, Sequence):
        return tuple(entry)
    return ()  # P.UNCONSTRAINED and friends: nothing known


def degree(mesh, names: Sequence[str]) -> int:
    """How many shards the mesh axes `names` make together."""
    return math.prod(mesh.shape[a] for a in names)
