"""shardlint's closed sets of words, defined once: causes, finding kinds, collective kinds,
gate change states and the small role sets that records carry.

Each is a `StrEnum` whose values are the words the JSON documents, the baseline files and
the messages have always used, so a member compares equal to its string, `json.dumps`
writes it as that string and `f"{member}"` prints it: outputs stay byte-identical while the
code names the words instead of repeating them. This module imports nothing from
shardlint, so every layer may import it.
"""

from __future__ import annotations

import enum


class Cause(enum.StrEnum):
    """Why a collective is in the partitioned program."""

    LOST = "lost"              # an activation gathered / all-to-all'd over an axis that sharded it, unasked
    REQUESTED = "requested"    # a constraint, reshard, out_sharding or shard_map spec asked for it
    WEIGHTS = "weights"        # a gather of a parameter-derived value (FSDP / ZeRO)
    REDUCTION = "reduction"    # all-reduce / reduce-scatter of partial sums
    LAYOUT = "layout"          # all-to-all / collective-permute that the code asked for (EP, Ulysses)


class FindingKind(enum.StrEnum):
    """How a finding's sharding was lost."""

    DROPPED = "lost-sharding"                  # propagation dropped the axis at the op (reshape, sort, ...)
    UNSPLIT = "unsplit-op"                     # the partitioner could not split the op: it gathered inputs
    RESHARDED = "resharded-operand"            # the op's operands came sharded differently: one was moved
    REMATERIALIZED = "full-rematerialization"  # XLA logged an involuntary full rematerialization


class CollectiveKind(enum.StrEnum):
    """A collective as HLO names it (the `*-start` of an async one drops its suffix)."""

    ALL_GATHER = "all-gather"
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    COLLECTIVE_PERMUTE = "collective-permute"
    RAGGED_ALL_TO_ALL = "ragged-all-to-all"
    COLLECTIVE_BROADCAST = "collective-broadcast"


class ChangeState(enum.StrEnum):
    """A gate key's change against the baseline: new and grown fail the gate."""

    NEW = "new"
    GROWN = "grown"
    GONE = "gone"
    SHRUNK = "shrunk"


class ArgumentRole(enum.StrEnum):
    """What one leaf of a step's positional arguments is to the compiled program."""

    WEIGHT = "weight"          # a parameter the program only moves
    INPUT = "input"            # an activation it is handed (integers, token inputs)
    UNUSED = "unused"          # jit dropped it


class BufferRole(enum.StrEnum):
    """Which allocation of XLA's buffer assignment a buffer lies in."""

    TEMP = "temp"
    ARGUMENT = "argument"
    OUTPUT = "output"
    CONSTANT = "constant"
    OTHER = "other"            # thread-local scratch, another memory space


# Tuples in the order the words have always been listed in (messages name them so).
CAUSES = tuple(Cause)
FINDING_KINDS = tuple(FindingKind)
COLLECTIVE_KINDS = tuple(CollectiveKind)
