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
    CONTRACTED = "contracted-tokens"           # a dispatch summed sharded tokens away: experts replicated


class CollectiveKind(enum.StrEnum):
    """A collective as HLO names it (the `*-start` of an async one drops its suffix)."""

    ALL_GATHER = "all-gather"
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    COLLECTIVE_PERMUTE = "collective-permute"
    RAGGED_ALL_TO_ALL = "ragged-all-to-all"
    COLLECTIVE_BROADCAST = "collective-broadcast"


# The collectives that sum partial results (an all-reduce, a reduce-scatter).
REDUCTIONS = frozenset({CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER})


def verb_of(kind: str) -> str:
    """What a collective does to a value, as findings word it: an all-gather `gathered` it;
    an all-to-all, a permute or a broadcast `moved` it (shards change place, nothing is
    gathered); an all-reduce or reduce-scatter `reduced` it."""
    if kind == CollectiveKind.ALL_GATHER:
        return "gathered"
    if kind in REDUCTIONS:
        return "reduced"
    return "moved"


def words(collectives) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(verb, axes) for what these collectives (records with `kind` and `axes`) do, each verb
    once, in the order gathered, moved, reduced."""
    axes: dict[str, list[str]] = {"gathered": [], "moved": [], "reduced": []}
    for c in collectives:
        axes[verb_of(c.kind)].extend(c.axes)
    return tuple((verb, tuple(dict.fromkeys(over))) for verb, over in axes.items() if over)


def present(verb: str) -> str:
    """`gathered` -> `gathers`: a verb of `words` in the present tense."""
    return {"gathered": "gathers", "moved": "moves", "reduced": "reduces"}[verb]


def said(pairs, present_tense: bool = False) -> str:
    """`gathered over data and moved over context` (pairs from `words`); `present_tense`:
    `gathers over data and moves over context`."""
    return " and ".join(f"{present(verb) if present_tense else verb} over {', '.join(over)}"
                        for verb, over in pairs)


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
