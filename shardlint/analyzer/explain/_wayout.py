"""What a finding says: the words for what its collectives do, and a way out that promises
only what `shardlint analyze --rewrite` does.

An all-gather gathers a value; an all-to-all (or a permute) moves shards between devices and
gathers nothing. Messages and headlines name each axis with the verb of the collectives that
communicate over it (`_vocab.words`).

The rewrite runs a routed layer per shard. Its planner (`rewrites._lost.lost_in`) reads the
lost findings: a flatten of (batch, seq) that feeds the experts with the sequence sharded,
or a routing op whose operand has its token dimensions sharded, and it starts a region at a
routing op on a lossy line whose result reaches an expert matmul. A way out names
`--rewrite` only where the finding is such an op (`rewrite_reaches`): a flatten (`reshape`)
or an op of `_ops.PER_SHARD_OPS` (top_k, sort, scatter, gather, argmax, a cumulative sum),
that feeds a grouped matmul (`feeds_grouped_matmul`), whose lost axes shard its operand's
token dimensions: the sequence (second) dimension of a flatten's operand; the first two of
a routing op's operand of rank 3 or more, the first of one of rank 1 or 2 (tokens already
flattened). A cumulative sum is run per shard only with `--per-shard-capacity`.
"""

from __future__ import annotations

from ..._ops import CUMULATIVE, PER_SHARD_OPS

REWRITE = "`shardlint analyze --rewrite`"


def rewrite_reaches(op: str, axes: tuple[str, ...], feeds: bool,
                    operand_spec: tuple[tuple[str, ...], ...]) -> bool:
    """Whether the rewrite's planner runs this finding's op per shard (module docstring)."""
    if not feeds:
        return False
    if op == "reshape":
        tokens = operand_spec[1:2]
    elif op in PER_SHARD_OPS:
        tokens = operand_spec[:2] if len(operand_spec) >= 3 else operand_spec[:1]
    else:
        return False
    return bool(set(axes) & {a for dim in tokens for a in dim})


def _by_rewrite(op: str, axes, feeds, operand_spec) -> str:
    """` (`--rewrite` does that ...)` where it does, else ''."""
    if not rewrite_reaches(op, axes, feeds, operand_spec):
        return ""
    flag = " with --per-shard-capacity (each shard then drops by its own capacity)" if op in CUMULATIVE else ""
    return f" ({REWRITE} does that for this routing op, which feeds the experts{flag})"


def dropped_way_out(op: str, axes, feeds: bool, operand_spec) -> str:
    """The way out of a propagation drop."""
    if op == "reshape" and rewrite_reaches(op, axes, feeds, operand_spec):
        return ("flatten (batch, seq) per shard: route, sort and run the grouped matmul inside "
                "jax.shard_map over the axes that shard batch and sequence "
                f"(shardlint.moe.ShardedRoutedMoE, or {REWRITE})")
    if op == "reshape":
        return ("keep (batch, seq) as separate dimensions (einsum over both), or flatten "
                "inside jax.shard_map; a merged dim keeps seq's sharding only when batch "
                "is fully sharded first")
    return (f"{op} needs the whole dimension on every device: compute it per shard inside "
            f"jax.shard_map{_by_rewrite(op, axes, feeds, operand_spec)}, or over a dimension "
            "that is not sharded")


def unsplit_way_out(op: str, axes, feeds: bool, operand_spec) -> str:
    """The way out of an op the partitioner could not split."""
    return (f"{op} cannot be split along the sharded dimension: compute it per shard inside "
            "jax.shard_map over the axes that shard batch and sequence"
            f"{_by_rewrite(op, axes, feeds, operand_spec)}, or keep the dimension it works "
            "along unsharded")


def resharded_way_out(op: str, axes, feeds: bool, operand_spec) -> str:
    """The way out of an op whose operand the partitioner moved to another sharding."""
    over = ", ".join(axes)
    if op == "reshape":
        return (f"the merged dimension cannot keep {over}, so XLA's partitioner moves it to "
                "another dimension: flatten per shard inside jax.shard_map over the axes that "
                "shard batch and sequence"
                + (f" ({REWRITE} does that for a flatten that feeds the experts)"
                   if rewrite_reaches(op, axes, feeds, operand_spec) else "")
                + ", or keep (batch, seq) as separate dimensions")
    return (f"{op} can run sharded, but an operand arrives sharded along another dimension than "
            f"the one {op} is computed along, so XLA's partitioner moves it over {over}: shard "
            "the operands alike where they are made (a sharding constraint on the one that differs)")


def contracted_way_out(axes) -> str:
    """The way out of a dispatch that sums sharded tokens into capacity slots."""
    over = ", ".join(axes)
    return (f"route, dispatch and run the experts on each shard's own tokens, with a capacity "
            f"per shard (GShard groups), inside jax.shard_map over the axes that shard batch and "
            f"sequence ({REWRITE} --per-shard-capacity does that; each shard then drops by its "
            f"own capacity), or use a dropless grouped matmul that keeps the tokens sharded over "
            f"{over} (MaxText: sparse_matmul=true)")
