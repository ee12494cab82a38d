"""RewrittenStep: the step with its routed-expert regions re-emitted per shard (the jaxpr route).

Built once per distinct arguments (`JittedStep`): the token axes come from the caller or
from where the analysis found the sharding lost (`_lost`); the step is traced once, at its
global shapes, and its values' shapes on one shard found from that jaxpr (`_trace`); the
regions that lose the sequence sharding are planned (`_regions`) and emitted inside
`shard_map`, their own equations bound at one shard's shapes (`_emit`), and the result is
jitted as the original was (`_jitted`). A step with nothing to rewrite runs as it is, and a
`NothingToRewrite` warning says so.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import jax
from jax.sharding import NamedSharding

from ... import _jax
from ..._errors import NothingToRewrite, RewriteError
from ..._token_axes import TokenAxes
from ..._wrapped import as_jitted
from ..emit import emit
from ...jaxpr import jitted_like
from ..trace import Lost, lost_in, Tokens, trace_step
from ..plan import plan_regions
from .._step import JittedStep


class RewrittenStep(JittedStep):
    """A step whose routed-expert regions run per shard; same signature and outputs.

    Built once per distinct arguments (`JittedStep`): the token axes come from `axes`
    when given, else from the analysis of the step on those arguments' shardings (the
    first build may reuse one already made, `lost`)."""

    def __init__(self, step: Callable, mesh, *, axes: TokenAxes | None = None,
                 progress: Callable[[str], None] | None = None, lost: Lost | None = None,
                 per_shard_capacity: bool = False, params_argnums: tuple[int, ...] | None = None):
        self.step = step
        self.mesh = mesh
        self.axes = axes
        self.params_argnums = params_argnums
        self.lost = lost     # what an analysis of the first arguments built for said
        self.per_shard_capacity = per_shard_capacity
        self.progress = progress or (lambda message: None)
        self.notes: list[str] = []
        self.changed: bool | None = None   # known once built for some arguments

    # The step was traced without a mesh in context, and its equations are replayed the
    # same way: an ambient mesh (the analyzer sets one) would type the replayed values
    # with the Auto mesh and clash with shard_map's manual axes.
    def _context(self):
        return _jax.no_ambient_mesh()

    def _build(self, args):
        flat = jax.tree_util.tree_leaves(args)
        if self.axes is None and not any(isinstance(getattr(x, "sharding", None), NamedSharding) for x in flat):
            raise RewriteError("rewrite needs the arguments' NamedShardings to find the token "
                               "axes: call it on arrays or ShapeDtypeStructs that carry them")
        lost, self.lost = self.lost, None
        if lost is None and self.axes is None:
            lost = lost_in(self.step, args, self.progress, params_argnums=self.params_argnums)
        tokens = Tokens(self.axes) if self.axes else lost.tokens
        if tokens is None:
            return self._unchanged(NOTHING_LOST)
        axes = tokens.axes
        traces = trace_step(self.step, args, dataclasses.replace(tokens, params_argnums=self.params_argnums),
                            self.mesh, per_shard_capacity=self.per_shard_capacity)
        self.traced_in = traces.context
        plan = plan_regions(traces, axes, seed_lines=lost.lines if lost else frozenset(),
                            per_shard_capacity=self.per_shard_capacity)
        if not plan.top.changed:
            return self._unchanged(f"no routed region loses the tokens' sharding over {', '.join(axes.all)}: "
                                   "no reshape folds them before a grouped matmul, and no routing op "
                                   "routing them to the experts is where the analysis found it lost")
        self.changed = True
        self.regions = plan.top.count()
        self.notes.append(f"rewrote {self.regions} routed region(s) to run per shard over "
                          f"{', '.join(axes.all)}")
        self.progress(self.notes[-1])
        return jitted_like(emit(plan, self.mesh), args, lambda: traces.out_tree, traces.jit_eqn,
                           self.__name__)

    def _unchanged(self, why: str):
        self.changed = False
        self.notes.append(f"nothing to rewrite: {why}")
        self.progress(self.notes[-1])
        warn_unchanged(self.notes[-1], stacklevel=6)
        if "_as_is" not in self.__dict__:
            self._as_is = as_jitted(self.step)
        return self._as_is


NOTHING_LOST = ("the analysis finds no sharding lost in routed-expert code (no flatten before "
                "a grouped matmul, no routing op)")


def warn_unchanged(note: str, stacklevel: int) -> None:
    warnings.warn(f"shardlint.rewrite: {note}; the result runs the step as it is",
                  NothingToRewrite, stacklevel=stacklevel)
