"""The per-shard shape pass: every value of a step's jaxpr, bodies included, at one shard's
shapes (`shard_shapes`).

The step's Python is traced once, at its global shapes, as `jax.jit` traces it; none of it
runs again at one shard's shapes. A routed region's per-shard program is its own equations
bound again on shard-sized operands (`shard.ShardBinder`), and everything outside the
regions stays the user's global equations.

Which values carry tokens, and along which dimensions, the same binder finds by running once
over the whole jaxpr on shard-sized inputs, for shapes only (nothing outside a region is
emitted from it). Where an op meets operands at other sizes (elementwise, a concatenation, a
contraction, a scatter's indices), the one that shrank along fewer dimensions is made again at
the size it meets, back to where it was made (`_origins`), and the pass starts again. Code
outside the regions need not run per shard, and where it cannot, the pass does not stop
there: a user's own shard_map (a kernel wrapper that checks the global batch against the
mesh) gives its results the shapes its out_specs give them on one shard, and an op that does
not bind at one shard's shapes (a token-mixing matrix of the configured length, a kernel of
fixed blocks) gives placeholders of the shapes they are next met with.

What the pass cannot tell, it says (`ShardShapes`), and the planner refuses a region that
makes it, or reads it where the shard's block of the real value is not what it needs, naming
the region's op:
- stand-ins: a constant sliced to a shard's size has a shard's shape but the first shard's
  content (a configured table), and so has what is computed from it and constants alone;
  a placeholder (the result of an op that does not bind per shard, made at the size it is
  met with) has a shape and no content: a region may read it only where it arrives as the
  shard's block of the real value (in `(batch, seq, ...)` form), and may hold no op that
  does not bind;
- guessed splits: a reshape that splits a shrunk dimension in two (tokens back into batch
  and sequence) gives the shrinking to the outer dimension first; only a value of a known
  shape that the result meets settles it (the residual stream it is added to).
Numbers the step's Python drew from array sizes (a mean's 1/T) keep their global values:
right for a sum over tokens that is summed across shards after.

With per-shard capacity, the capacity a routed layer compares its running totals with (a
token's position in its expert) is one shard's: a literal that a running total along a token
dimension is ordered against is divided by the number of shards that dimension is split into
(rounded down, at least 1), and so is the number of classes of a one-hot over such positions
(the iota they are compared with for equality), keeping what it adds to the capacity
(MaxText's `capacity + 1`). Wherever the tokens per expert divide evenly among the shards,
that is the step's own formula at a shard's token count (`int(ceil(S*K/E) * factor)`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..._errors import ShardlintError, first_line, shardlint_bug
from ..._source import raised_by_shardlint
from ..shard import declared_shapes, elementwise, fitted, folded, operands_to_resize, reshaped, ShardBinder, Unfit
from ._origins import Graph, ResizeAndRetry, from_configuration
from ..._ops import CUMULATIVE_PRIMITIVES
from ...jaxpr import is_literal, sub_of

_ATTEMPTS = 64
_ORDERINGS = {"lt", "le", "gt", "ge"}
_EQUALITIES = {"eq", "ne"}


@dataclasses.dataclass(frozen=True)
class ShardShapes:
    """What binding the step's jaxpr at one shard's shapes found."""

    shapes: dict          # global Var -> its shape on one shard
    sizes: dict           # global Var -> the shape a value made from nothing is made at
    literals: dict        # (id(eqn), operand position) -> a capacity literal's per-shard value
    folds: dict           # global sizes of dimensions a reshape folds -> their sizes on one shard
    # global Vars whose per-shard value has a shard's shape but not its content (stand-ins,
    # and what is computed from them and constants alone)
    stand_ins: frozenset = frozenset()
    guessed: frozenset = frozenset()   # ... whose shape is a guessed split of the tokens
    # id(eqn) -> why it does not bind at one shard's shapes (JAX's words)
    unbound: dict = dataclasses.field(default_factory=dict)


def shard_shapes(closed, avals, divided: dict[str, int], *, capacity: bool = False, mesh=None) -> ShardShapes:
    """The shape every value of `closed` (a ClosedJaxpr at global shapes, bodies included) has
    when its inputs have `avals`: those of one shard. `divided`: the mesh axes the inputs are
    divided over, with their sizes (for a user's shard_map: its results are divided so
    too). `capacity`: per-shard capacity (see the module docstring). `mesh`: the step's, for
    the shard_maps the step makes over a mesh of its own."""
    graph = Graph(closed.jaxpr, closed.consts)
    literals: dict = {}
    retried = []   # the op that stopped each pass
    for _ in range(_ATTEMPTS):
        shape_pass = _ShapePass(graph, literals, {}, divided, capacity, mesh)
        try:
            jax.eval_shape(lambda *xs: shape_pass.run(closed.jaxpr, closed.consts, xs), *avals)
        except ResizeAndRetry as resize:
            graph.rebuild(resize, shape_pass.shapes)
            retried.append(resize.eqn)
            continue
        stand_ins = from_configuration(closed.jaxpr, graph.stand_ins) | graph.placeholders
        return ShardShapes(shape_pass.shapes, dict(graph.sizes), dict(literals), shape_pass.folds,
                           stand_ins, frozenset(shape_pass.unsettled), dict(graph.opaque))
    raise Unfit(f"after {_ATTEMPTS} passes; {_going_round(graph, retried)}")


def _going_round(graph, retried: list) -> str:
    """The ops that stopped the last passes (their operands came at other sizes and were made
    again), each once with its line: where the passes go round."""
    ops = [f"{eqn.primitive.name}({', '.join(v.aval.str_short() for v in eqn.invars)}){graph.line_of(eqn)}"
           for eqn in retried[-max(1, _ATTEMPTS // 4):]]
    return ("the last ones stopped at ops whose operands came at other sizes (global shapes): "
            f"{'; '.join(dict.fromkeys(ops))}")   # each once (layers repeat them)


class _ShapePass(ShardBinder):
    """The binder run once over the whole jaxpr, for the shapes: it records them, follows
    guessed splits and running totals, and does not stop where an op cannot bind."""

    def __init__(self, graph, literals: dict, folds: dict, divided: dict[str, int], capacity: bool, mesh):
        super().__init__(graph.sizes, literals, folds)
        self.graph, self.divided, self.capacity, self.mesh = graph, divided, capacity, mesh
        self.shapes: dict = {}    # Var -> its shape on one shard
        self.guesses: dict = {}   # Var -> the split whose guessed shape it has
        self.unsettled: set = set()   # splits not met by a value of a known shape yet
        self.counts: dict = {}    # running totals along a token dim -> how many shards split it
        self.capacities: dict = {}   # shards -> (global capacity, a shard's)

    def run(self, jaxpr, consts, invals) -> list:
        self.shapes.update((v, np.shape(x)) for v, x in zip(jaxpr.invars, invals))
        self.shapes.update((v, np.shape(self.constant(v, c))) for v, c in zip(jaxpr.constvars, consts))
        return super().run(jaxpr, consts, invals)

    def bind(self, eqn, invals: list) -> list:
        if self.capacity:
            self._per_shard_capacity(eqn, invals)
        known = lambda a: a not in self.guesses   # noqa: E731
        if id(eqn) in self.graph.opaque or eqn.primitive.name == "shard_map":
            outs = self._placeholders(eqn)
        else:
            # An elementwise op whose operands shrank apart may still bind where a shard's
            # dimension is 1 (one batch row per device): JAX broadcasts it. They meet all
            # the same.
            resized = operands_to_resize(eqn, invals, known_first=known) if elementwise(eqn) else {}
            if resized:
                raise ResizeAndRetry(eqn, resized)
            try:
                outs = super().bind(eqn, invals)
            except (ResizeAndRetry, ShardlintError):
                raise
            except Exception as error:   # JAX refusing these shapes, in whatever words
                if raised_by_shardlint(error) and not isinstance(error, Unfit):
                    # shardlint's own bug: said as one, never as an op that does not bind
                    raise shardlint_bug(f"binding {eqn.primitive.name}{self.graph.line_of(eqn)} at one "
                                        "shard's shapes", error) from error
                resized = operands_to_resize(eqn, invals, known_first=known)
                if resized:
                    raise ResizeAndRetry(eqn, resized) from error
                self.graph.unbound(eqn, f"{type(error).__name__}: {first_line(error)}")
                outs = self._placeholders(eqn)
        outs = [self._placeholder_as_met(v, x) for v, x in zip(eqn.outvars, outs)]
        self.shapes.update((v, np.shape(x)) for v, x in zip(eqn.outvars, outs))
        if eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is None:
            self._fold(eqn, np.shape(invals[0]))
        self._count(eqn, invals)
        if elementwise(eqn):
            self._settle(eqn)
        return outs

    def call(self, eqn, sub, invals) -> list:
        for a, inner in zip(eqn.invars, sub.jaxpr.invars):
            if not is_literal(a) and a in self.counts:
                self.counts[inner] = self.counts[a]
        outs = super().call(eqn, sub, invals)
        for v, inner in zip(eqn.outvars, sub.jaxpr.outvars):
            if not is_literal(inner) and inner in self.counts:
                self.counts[v] = self.counts[inner]
        return outs

    def reshape_sizes(self, eqn, shape_in) -> tuple:
        shape = eqn.invars[0].aval.shape
        sizes, guessed = reshaped(shape, shape_in, eqn.params["new_sizes"], self.folds)
        if guessed:
            self.guesses[eqn.outvars[0]] = (eqn.outvars[0], guessed)
            self.unsettled.add(eqn.outvars[0])
        return sizes

    def _fold(self, eqn, shape_in) -> None:
        """Records the dimensions a reshape folds at their sizes on one shard (whatever made
        its result's size: its operand, or the size it is met with), for a later reshape that
        unfolds them (`folds`)."""
        for run, local in folded(eqn.invars[0].aval.shape, shape_in, eqn.params["new_sizes"]).items():
            self.folds.setdefault(run, local)

    def _placeholders(self, eqn) -> list:
        """Results of the shapes they are made at, or that a user's shard_map gives them on
        one shard, or else their global ones: shapes, not contents."""
        shapes = (declared_shapes(eqn, self.divided, self.mesh) if eqn.primitive.name == "shard_map"
                  else [self.sizes.get(v, v.aval.shape) for v in eqn.outvars])
        return [jnp.zeros(s, v.aval.dtype) for v, s in zip(eqn.outvars, shapes)]

    def _placeholder_as_met(self, var, value):
        """A result the pass must make at the size it is met with, but cannot make from its
        operands: a placeholder of that size."""
        shape = self.sizes.get(var)
        if var in self.graph.placeholders and shape is not None and np.shape(value) != shape:
            return jnp.zeros(shape, var.aval.dtype)
        return value

    def _settle(self, eqn) -> None:
        """A guessed split met by a value of a known shape along the split's dimensions is
        settled; what is computed from guessed values alone has their guess."""
        shape = eqn.outvars[0].aval.shape
        operands = [a for a in eqn.invars if not is_literal(a) and fitted(a.aval.shape, shape, shape)]
        guessed = [a for a in operands if a in self.guesses]
        for a in guessed:
            split, dims = self.guesses[a]
            if any(b not in self.guesses and all(b.aval.shape[d] == shape[d] for d in dims) for b in operands):
                self.unsettled.discard(split)
        if guessed and all(a in self.guesses or a.aval.shape != shape for a in operands):
            self.guesses.update((v, self.guesses[guessed[0]]) for v in eqn.outvars)

    # -- per-shard capacity ---------------------------------------------------------------

    def _count(self, eqn, invals) -> None:
        """Running totals: a cumulative op's results along a dimension that shrank, and
        what is computed from one by anything but a comparison."""
        name = eqn.primitive.name
        if name in CUMULATIVE_PRIMITIVES and not is_literal(eqn.invars[0]):
            axis = eqn.params.get("axis", 0)
            total, shard = eqn.invars[0].aval.shape[axis], np.shape(invals[0])[axis]
            if shard and total != shard:
                self.counts.update((v, total // shard) for v in eqn.outvars)
            return
        counted = [self.counts[a] for a in eqn.invars if not is_literal(a) and a in self.counts]
        if counted and name not in _ORDERINGS | _EQUALITIES and sub_of(eqn) is None:
            self.counts.update((v, max(counted)) for v in eqn.outvars)

    def _per_shard_capacity(self, eqn, invals: list) -> None:
        """A capacity literal a running total is ordered against becomes a shard's
        (`literals`); the iota a one-hot over such positions compares them with is made at a
        shard's number of classes."""
        name = eqn.primitive.name
        counted = [self.counts[a] for a in eqn.invars if not is_literal(a) and a in self.counts]
        if not counted:
            return
        shards = counted[0]
        if name in _ORDERINGS:
            for k, a in enumerate(eqn.invars):
                if is_literal(a) and np.ndim(a.val) == 0 and float(a.val) >= 1 and float(a.val).is_integer():
                    whole = int(a.val)
                    per_shard = max(1, whole // shards)
                    self.capacities[shards] = (whole, per_shard)
                    self.literals[(id(eqn), k)] = np.asarray(per_shard, dtype=np.asarray(a.val).dtype)
                    invals[k] = self.literals[(id(eqn), k)]
        elif name in _EQUALITIES and shards in self.capacities:
            whole, per_shard = self.capacities[shards]
            for a, x in zip(eqn.invars, invals):
                dim = None if is_literal(a) else self.graph.iota_dimension(a)
                if dim is None:
                    continue
                classes = a.aval.shape[dim]
                if classes < whole:
                    continue
                wanted = tuple(classes - whole + per_shard if d == dim else n for d, n in enumerate(np.shape(x)))
                if wanted != np.shape(x):
                    raise ResizeAndRetry(eqn, {a: wanted})
