"""A step's equations bound again at one shard's shapes: the binder a routed region's
per-shard program is emitted with (`ShardBinder`), and the pass that finds every value's
shape on one shard with it (`shard_shapes`).

The step's Python is traced once, at its global shapes, as `jax.jit` traces it; none of it
runs again at one shard's shapes. A routed region's per-shard program is its own equations
bound again on shard-sized operands: operands give most results their shapes (a broadcast
follows its operand, a reshape keeps its segments, a slice to the end of a dimension ends at
the shard's end), and a value made from nothing (an iota, a broadcast scalar, a constant) is
made at the size it is met with. Everything outside the regions stays the user's global
equations.

Which values carry tokens, and along which dimensions, the same binder finds by running once
over the whole jaxpr on shard-sized inputs, for shapes only (nothing outside a region is
emitted from it). Where an op meets operands at other sizes (elementwise, a concatenation, a
contraction, a scatter's indices), the one that shrank along fewer dimensions is made again at
the size it meets, back to where it was made, and the pass starts again. Code outside the
regions need not run per shard, and where it cannot, the pass does not stop there: a user's
own shard_map (a kernel wrapper that checks the global batch against the mesh) gives its
results the shapes its out_specs give them on one shard, and an op that does not bind at one
shard's shapes (a token-mixing matrix of the configured length, a kernel of fixed blocks)
gives results of the shapes they are next met with.

What the pass cannot tell, it says (`ShardShapes`), and the planner refuses a region that
makes it, or reads it where the shard's block of the real value is not what it needs, naming
the region's op:
- stand-ins: a constant sliced to a shard's size, and the results of an op that does not
  bind per shard, have a shard's shape but not its content (a sliced mask is the first
  shard's), and so has what is computed from them and constants alone;
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
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax
from .._errors import first_line
from .._token_axes import as_axes
from ._refusals import CUMULATIVE
from ._replay import ANNOTATIONS, SHARDING_PARAMS, read
from ._shard_shapes import (FOLLOWS_FIRST, Unfit, broadcast_shape, elementwise, fitted, folded, mend,
                            reshaped, slice_limits, slice_sizes)
from ._subjaxprs import sub_of

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


class ShardBinder:
    """Binds the step's global equations on shard-sized operands.

    Shape parameters come from the operands (and `sizes`, for values made from nothing),
    capacity literals from `literals`. Sharding parameters are dropped and sharding
    annotations pass their operand through: the step was traced on the global mesh, and
    inside the region's `shard_map` the token axes are manual. Calls are entered (their
    recorded types are the global ones); a scan is bound again with its body bound so."""

    def __init__(self, sizes: dict, literals: dict, folds: dict):
        self.sizes, self.literals, self.folds = sizes, literals, folds
        self.bodies: dict = {}    # (body, operand types) -> the body traced again

    def run(self, jaxpr, consts, invals) -> list:
        env = {v: self.constant(v, c) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, invals))
        for eqn in jaxpr.eqns:
            operands = [self.operand(eqn, k, a, None if _jax.is_literal(a) else env[a])
                        for k, a in enumerate(eqn.invars)]
            env.update(zip(eqn.outvars, self.bind(eqn, operands)))
        return [read(env, v) for v in jaxpr.outvars]

    def operand(self, eqn, k: int, atom, value):
        """`eqn`'s operand at position `k`: `value`, or a literal (a capacity at a shard's)."""
        return self.literals.get((id(eqn), k), atom.val) if _jax.is_literal(atom) else value

    def constant(self, var, value):
        shape = self.sizes.get(var)
        return value if shape is None else np.asarray(value)[tuple(slice(0, n) for n in shape)]

    def bind(self, eqn, invals: list) -> list:
        name = eqn.primitive.name
        with _jax.as_traced(eqn, its_mesh=False):
            if name in ANNOTATIONS:
                return list(invals)
            sub = sub_of(eqn)
            if sub is not None:
                return self.call(eqn, sub, invals)
            params = self.params(eqn, invals)
            out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        return list(out) if eqn.primitive.multiple_results else [out]

    def params(self, eqn, invals) -> dict:
        params = {k: (None if k in SHARDING_PARAMS else v) for k, v in eqn.params.items()}
        name = eqn.primitive.name
        resized = self.sizes.get(eqn.outvars[0]) if len(eqn.outvars) == 1 else None
        shape_in = np.shape(invals[0]) if invals else ()
        if name == "broadcast_in_dim":
            params["shape"] = resized or broadcast_shape(eqn, shape_in)
        elif name == "iota" and resized:
            params["shape"] = resized
        elif name == "reshape" and params.get("dimensions") is None:
            params["new_sizes"] = resized or self.reshape_sizes(eqn, shape_in)
        elif name == "slice":
            params["limit_indices"] = slice_limits(eqn, shape_in)
        elif name == "dynamic_slice":
            params["slice_sizes"] = slice_sizes(eqn, shape_in)
        return params

    def reshape_sizes(self, eqn, shape_in) -> tuple:
        return reshaped(eqn.invars[0].aval.shape, shape_in, eqn.params["new_sizes"], self.folds)[0]

    def call(self, eqn, sub, invals) -> list:
        """A call entered on the shard-sized operands; a scan bound again with its body so."""
        if not sub.stacks:
            return self.run(sub.jaxpr, sub.consts, invals)
        avals = [jax.ShapeDtypeStruct(np.shape(x)[1:] if k >= sub.sliced_from else np.shape(x),
                                      inner.aval.dtype, weak_type=getattr(inner.aval, "weak_type", False))
                 for k, (x, inner) in enumerate(zip(invals, sub.jaxpr.invars))]
        key = (id(sub.jaxpr), tuple((a.shape, a.dtype, a.weak_type) for a in avals))
        if key not in self.bodies:   # a body JAX shares between calls stays shared
            self.bodies[key] = jax.make_jaxpr(lambda *xs: self.run(sub.jaxpr, sub.consts, xs))(*avals)
        params = dict(eqn.params, **{sub.key: self.bodies[key]})
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        return list(out)


def shard_shapes(closed, avals, divided: dict[str, int], *, capacity: bool = False, mesh=None) -> ShardShapes:
    """The shape every value of `closed` (a ClosedJaxpr at global shapes, bodies included) has
    when its inputs have `avals`: those of one shard. `divided`: the mesh axes the inputs are
    divided over, with their sizes (for a user's shard_map: its results are divided so
    too). `capacity`: per-shard capacity (see the module docstring). `mesh`: the step's, for
    the shard_maps the step makes over a mesh of its own."""
    graph = _Graph(closed.jaxpr, closed.consts)
    literals: dict = {}
    for _ in range(_ATTEMPTS):
        shape_pass = _ShapePass(graph, literals, {}, divided, capacity, mesh)
        try:
            jax.eval_shape(lambda *xs: shape_pass.run(closed.jaxpr, closed.consts, xs), *avals)
        except _Meets as meets:
            graph.rebuild(meets, shape_pass.shapes)
            continue
        stand_ins = _from_configuration(closed.jaxpr, graph.stand_ins) | graph.placeholders
        return ShardShapes(shape_pass.shapes, dict(graph.sizes), dict(literals), shape_pass.folds,
                           stand_ins, frozenset(shape_pass.unsettled), dict(graph.opaque))
    raise Unfit(f"its values did not settle at one shard's shapes in {_ATTEMPTS} passes")


class _Meets(Exception):
    """An op met operands at other sizes: make them again at these shapes."""

    def __init__(self, eqn, resized: dict):
        super().__init__()
        self.eqn, self.resized = eqn, resized


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
        if id(eqn) in self.graph.opaque or eqn.primitive.name == "shard_map":
            outs = self._placeholders(eqn)
        else:
            try:
                outs = super().bind(eqn, invals)
            except _Meets:
                raise
            except Exception as error:   # JAX refusing these shapes, in whatever words
                resized = mend(eqn, invals, known_first=lambda a: a not in self.guesses)
                if resized:
                    raise _Meets(eqn, resized) from None
                self.graph.unbound(eqn, f"{type(error).__name__}: {first_line(error)}")
                outs = self._placeholders(eqn)
        outs = [self._made_as_met(v, x) for v, x in zip(eqn.outvars, outs)]
        self.shapes.update((v, np.shape(x)) for v, x in zip(eqn.outvars, outs))
        self._count(eqn, invals)
        if elementwise(eqn):
            self._settle(eqn)
        return outs

    def call(self, eqn, sub, invals) -> list:
        for a, inner in zip(eqn.invars, sub.jaxpr.invars):
            if not _jax.is_literal(a) and a in self.counts:
                self.counts[inner] = self.counts[a]
        outs = super().call(eqn, sub, invals)
        for v, inner in zip(eqn.outvars, sub.jaxpr.outvars):
            if not _jax.is_literal(inner) and inner in self.counts:
                self.counts[v] = self.counts[inner]
        return outs

    def reshape_sizes(self, eqn, shape_in) -> tuple:
        shape = eqn.invars[0].aval.shape
        sizes, guessed = reshaped(shape, shape_in, eqn.params["new_sizes"], self.folds)
        for run, local in folded(shape, shape_in, eqn.params["new_sizes"]).items():
            self.folds.setdefault(run, local)
        if guessed:
            self.guesses[eqn.outvars[0]] = (eqn.outvars[0], guessed)
            self.unsettled.add(eqn.outvars[0])
        return sizes

    def _placeholders(self, eqn) -> list:
        """Results of the shapes they are made at, or that a user's shard_map gives them on
        one shard, or else their global ones: shapes, not contents."""
        shapes = (_declared_shapes(eqn, self.divided, self.mesh) if eqn.primitive.name == "shard_map"
                  else [self.sizes.get(v, v.aval.shape) for v in eqn.outvars])
        return [jnp.zeros(s, v.aval.dtype) for v, s in zip(eqn.outvars, shapes)]

    def _made_as_met(self, var, value):
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
        operands = [a for a in eqn.invars if not _jax.is_literal(a) and fitted(a.aval.shape, shape, shape)]
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
        if name in CUMULATIVE and not _jax.is_literal(eqn.invars[0]):
            axis = eqn.params.get("axis", 0)
            total, shard = eqn.invars[0].aval.shape[axis], np.shape(invals[0])[axis]
            if shard and total != shard:
                self.counts.update((v, total // shard) for v in eqn.outvars)
            return
        counted = [self.counts[a] for a in eqn.invars if not _jax.is_literal(a) and a in self.counts]
        if counted and name not in _ORDERINGS | _EQUALITIES and sub_of(eqn) is None:
            self.counts.update((v, max(counted)) for v in eqn.outvars)

    def _per_shard_capacity(self, eqn, invals: list) -> None:
        """A capacity literal a running total is ordered against becomes a shard's
        (`literals`); the iota a one-hot over such positions compares them with is made at a
        shard's number of classes."""
        name = eqn.primitive.name
        counted = [self.counts[a] for a in eqn.invars if not _jax.is_literal(a) and a in self.counts]
        if not counted:
            return
        shards = counted[0]
        if name in _ORDERINGS:
            for k, a in enumerate(eqn.invars):
                if _jax.is_literal(a) and np.ndim(a.val) == 0 and float(a.val) >= 1 and float(a.val).is_integer():
                    whole = int(a.val)
                    per_shard = max(1, whole // shards)
                    self.capacities[shards] = (whole, per_shard)
                    self.literals[(id(eqn), k)] = np.asarray(per_shard, dtype=np.asarray(a.val).dtype)
                    invals[k] = self.literals[(id(eqn), k)]
        elif name in _EQUALITIES and shards in self.capacities:
            whole, per_shard = self.capacities[shards]
            for a, x in zip(eqn.invars, invals):
                iota = self.graph.producer.get(a)
                if iota is None or iota.primitive.name != "iota":
                    continue
                dim = iota.params["dimension"]
                classes = a.aval.shape[dim]
                if classes < whole:
                    continue
                wanted = tuple(classes - whole + per_shard if d == dim else n for d, n in enumerate(np.shape(x)))
                if wanted != np.shape(x):
                    raise _Meets(eqn, {a: wanted})


def _made_at_any_size(value) -> bool:
    """Whether a constant's leading block is what making it at that size gives: the same
    value everywhere, or positions 0, 1, 2, ... along one dimension (an arange computed
    once), which a shard takes as its own positions."""
    value = np.asarray(value)
    if value.size <= 1 or bool(np.all(value == value.flat[0])):
        return True
    return any(np.array_equal(value, np.broadcast_to(
        np.arange(n).reshape([n if k == d else 1 for k in range(value.ndim)]), value.shape))
        for d, n in enumerate(value.shape))


def _declared_shapes(eqn, divided: dict[str, int], mesh) -> list[tuple]:
    """A user's shard_map's results on one shard: each dimension its out_specs split over
    divided axes is split so (each device's block is the same; the body is not entered).
    Its mesh may be the library's own, with other axis names or several of the step's axes
    folded into one: an axis laid over the same devices as some of the step's is those."""
    step_axes = _same_devices(eqn.params["mesh"], mesh)
    shapes = []
    for v, spec in zip(eqn.outvars, eqn.params["out_specs"]):
        shape = list(v.aval.shape)
        for d, entry in enumerate(tuple(spec)[:len(shape)]):
            names = [b for a in as_axes(entry) for b in step_axes.get(a, (a,))]
            factor = math.prod(divided.get(b, 1) for b in names)
            if factor > 1 and shape[d] % factor == 0:
                shape[d] //= factor
        shapes.append(tuple(shape))
    return shapes


def _same_devices(own, mesh) -> dict[str, tuple[str, ...]]:
    """Each axis of a shard_map's own mesh as the step's mesh axes it is laid over: where
    both hold the same devices in the same order, an axis of one is a run of consecutive
    axes of the other (`dp`, `sp` are `data`, `context`; an `expert` axis over all eight
    devices is `data` and `context` folded). {} where they hold other devices."""
    if mesh is None or list(own.devices.flat) != list(mesh.devices.flat):
        return {}
    step = [(name, size) for name, size in mesh.shape.items() if size > 1]
    found, k = {}, 0
    for name, size in own.shape.items():
        run, product = [], 1
        while product < size and k < len(step):
            run.append(step[k][0])
            product *= step[k][1]
            k += 1
        if product != size:
            return {}
        found[name] = tuple(run)
    return found


def _from_configuration(jaxpr, stand_ins: set) -> frozenset:
    """`stand_ins` and the values computed from them and from constants alone (no input
    of the step), in the bodies too (a body's input is what the call's operand is)."""
    found = set(stand_ins)
    fixed = set(jaxpr.constvars)   # computed from constants alone

    def walk(jaxpr) -> None:
        fixed.update(jaxpr.constvars)
        for eqn in jaxpr.eqns:
            ins = [a for a in eqn.invars if not _jax.is_literal(a)]
            sub = sub_of(eqn)
            if sub is not None:
                for a, inner in zip(eqn.invars, sub.jaxpr.invars):
                    if _jax.is_literal(a) or a in fixed:
                        fixed.add(inner)
                    elif a in found:
                        found.add(inner)
                walk(sub.jaxpr)
                for out, inner in zip(eqn.outvars, sub.jaxpr.outvars):
                    if inner in found:
                        found.add(out)
                    elif _jax.is_literal(inner) or inner in fixed:
                        fixed.add(out)
            elif all(a in found or a in fixed for a in ins):
                (found if any(a in found for a in ins) else fixed).update(eqn.outvars)

    walk(jaxpr)
    return frozenset(found)


class _Graph:
    """Where each value of a jaxpr and its bodies was made: the equation, a constant, or
    the operand of the call whose body takes it; and what the passes so far decided."""

    def __init__(self, jaxpr, consts):
        self.sizes: dict = {}     # Var -> the shape its per-shard value is made at
        # constants sliced to a shard's size: the first shard's content, not each one's
        self.stand_ins: set = set()
        # results made at the size they are met with, not from their operands: a shape, no
        # content (the region reads the real value where it reads one)
        self.placeholders: set = set()
        self.opaque: dict = {}    # id(eqn) -> why it does not bind at one shard's shapes
        self.producer: dict = {}
        self.constants: dict = {}  # constvar -> its value
        self.outer: dict = {}     # body input -> (the call's operand, whether one slice of it)
        self._index(jaxpr, consts)

    def _index(self, jaxpr, consts) -> None:
        self.constants.update(zip(jaxpr.constvars, consts))
        for eqn in jaxpr.eqns:
            self.producer.update((v, eqn) for v in eqn.outvars)
            sub = sub_of(eqn)
            if sub is None:
                continue
            for k, (a, inner) in enumerate(zip(eqn.invars, sub.jaxpr.invars)):
                if not _jax.is_literal(a):
                    self.outer[inner] = (a, sub.stacks and k >= sub.sliced_from)
            self._index(sub.jaxpr, sub.consts)

    def unbound(self, eqn, why: str) -> None:
        """`eqn` does not bind at one shard's shapes: its results are placeholders from now on."""
        self.opaque[id(eqn)] = why
        self.placeholders.update(eqn.outvars)

    def rebuild(self, meets: _Meets, shapes: dict) -> None:
        """Makes each value the op met at its shape in the next pass (`shapes`: this
        pass's), rebuilding what it is made from. Where that cannot be (a value that would
        have two sizes, or is still not what it meets), the op that met them gives
        placeholders from then on."""
        sizes, stand_ins, placeholders = dict(self.sizes), set(self.stand_ins), set(self.placeholders)
        done: set = set()
        try:
            for var, shape in meets.resized.items():
                self._rebuild(var, shape, shapes, done)
        except Unfit as e:
            self.sizes, self.stand_ins, self.placeholders = sizes, stand_ins, placeholders
            self.unbound(meets.eqn, str(e))

    def _rebuild(self, var, shape: tuple, shapes: dict, done: set) -> None:
        if var in done:
            if self.sizes[var] != shape:
                raise Unfit(f"{var.aval.str_short()} meets values of two sizes at one shard's shapes")
            return
        if self.sizes.get(var) == shape:   # made so before, and still not what it meets
            raise Unfit(f"{var.aval.str_short()} does not settle at one shard's shapes")
        if var not in self.producer and var not in self.outer and var not in self.constants:
            raise Unfit(f"an input of the step ({var.aval.str_short()}) keeps its size per shard")
        done.add(var)
        self.sizes[var] = shape
        if var in self.constants:
            if not _made_at_any_size(self.constants[var]):
                self.stand_ins.add(var)
            return
        try:
            sources = self._sources(var, shape, shapes)
        except Unfit:   # what it is made from cannot give that size: a placeholder of it
            self.placeholders.add(var)
            return
        for source, wanted in sources:
            if shapes.get(source) != wanted:
                self._rebuild(source, wanted, shapes, done)
        if any(source in self.stand_ins for source, _ in sources):
            self.stand_ins.add(var)

    def _sources(self, var, shape: tuple, shapes: dict) -> list:
        """(value, the shape it must have) for each value `var` is made from, for `var`
        to have `shape`; an iota or a broadcast scalar is made at any size."""
        eqn = self.producer.get(var)
        if eqn is None:   # a body's input: the call's operand
            operand, sliced = self.outer[var]
            return [(operand, (shapes[operand][0], *shape) if sliced else shape)]
        if id(eqn) in self.opaque:
            raise Unfit(f"{var.aval.str_short()} is made by {eqn.primitive.name}, which does not bind per shard")
        name = eqn.primitive.name
        operands = [a for a in eqn.invars if not _jax.is_literal(a)]
        sub = sub_of(eqn)
        if sub is not None:   # the body's result at the same place
            k = eqn.outvars.index(var)
            inner = sub.jaxpr.outvars[k]
            stacked = sub.stacks and k >= sub.sliced_from - _jax.scan_counts(eqn.params)[0]
            if _jax.is_literal(inner):
                raise Unfit(f"{var.aval.str_short()} made by {name} meets a value of another size")
            return [(inner, shape[1:] if stacked else shape)]
        if name == "iota":
            return []
        if name == "reshape":
            operand = eqn.invars[0]
            if math.prod(shape) == math.prod(shapes[operand]):
                return []
            return [(operand, reshaped(var.aval.shape, shape, operand.aval.shape)[0])]
        if name == "broadcast_in_dim":
            out = var.aval.shape
            return [(a, tuple(shape[d] if n == out[d] else n
                              for n, d in zip(a.aval.shape, eqn.params["broadcast_dimensions"])))
                    for a in operands[:1] if a.aval.shape]
        if name.startswith(("reduce_", "arg")) and "axes" in eqn.params:   # reduced dims kept
            rest = iter(shape)
            operand = eqn.invars[0]
            return [(operand, tuple(n if d in eqn.params["axes"] else next(rest)
                                    for d, n in enumerate(shapes[operand])))]
        if name == "concatenate":
            axis = eqn.params["dimension"]
            return [(a, shape[:axis] + (shapes[a][axis],) + shape[axis + 1:]) for a in operands]
        if elementwise(eqn) or name in FOLLOWS_FIRST:
            wanted_of = [(a, fitted(a.aval.shape, var.aval.shape, shape))
                         for a in (operands[:1] if name in FOLLOWS_FIRST else operands)]
            return [(a, wanted) for a, wanted in wanted_of if wanted is not None]
        raise Unfit(f"{var.aval.str_short()} made by {name} meets a value of another size")
