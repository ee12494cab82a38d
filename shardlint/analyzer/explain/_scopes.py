"""Collectives rolled up by the layer that holds them, forward and backward apart.

As PyTorch's CommDebugMode counts communication per module, the roll-up groups an
analysis's collectives by the named scopes and module paths of their op path
(`jax.named_scope("moe/route")`, Flax module names, a `jax.named_call` layer) and by
direction (`transpose(...)` in the path is the backward pass). Each scope's totals include
its sub-scopes; bytes are per device and per step (a loop body's collective counts once
per iteration). Collectives XLA merged from several ops, or with no scope at all, sit at
the root.
"""

from __future__ import annotations

import collections
import dataclasses

from .._model import Analysis
from ..._op_paths import BACKWARD, FORWARD, scope_of


@dataclasses.dataclass(frozen=True)
class Traffic:
    count: int = 0
    bytes: int = 0          # per device, per step

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.count + other.count, self.bytes + other.bytes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScopeNode:
    """One scope of the tree: its own name, its full path, what it and its sub-scopes move
    in each direction, by collective kind, and its sub-scopes by name."""

    name: str
    path: tuple[str, ...]
    forward: Traffic
    backward: Traffic
    kinds: tuple[tuple[str, Traffic], ...]          # (kind, forward + backward)
    children: tuple[ScopeNode, ...] = ()

    @property
    def total(self) -> Traffic:
        return self.forward + self.backward

    def walk(self):
        """This node and every node below it, depth first, each with its depth."""
        stack = [(self, 0)]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            stack.extend((c, depth + 1) for c in reversed(node.children))


def scope_tree(analysis: Analysis) -> ScopeNode:
    """The root scope (the whole step) with every collective of the analysis below it."""
    own: dict[tuple[str, ...], dict[str, Traffic]] = collections.defaultdict(
        lambda: collections.defaultdict(Traffic))
    kinds: dict[tuple[str, ...], dict[str, Traffic]] = collections.defaultdict(
        lambda: collections.defaultdict(Traffic))
    for c in analysis.collectives:
        direction, scope = scope_of(c.op_path)
        moved = Traffic(c.trips or 1, c.step_bytes)
        for depth in range(len(scope) + 1):   # every enclosing scope counts it too
            prefix = scope[:depth]
            own[prefix][direction] += moved
            kinds[prefix][c.kind] += moved
    return _node((), own, kinds)


def _node(path, own, kinds) -> ScopeNode:
    children = sorted({p[: len(path) + 1] for p in own if len(p) > len(path) and p[: len(path)] == path})
    return ScopeNode(
        name=path[-1] if path else "step", path=path,
        forward=own[path][FORWARD], backward=own[path][BACKWARD],
        kinds=tuple(sorted(kinds[path].items(), key=lambda kv: -kv[1].bytes)),
        children=tuple(_node(c, own, kinds) for c in children))
