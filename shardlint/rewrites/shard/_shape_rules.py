"""Shapes at one shard's size, for the equations bound again there (`trace/_shard_shapes.py`): what a
shape parameter becomes (a broadcast's, a reshape's, a slice's), and which operands to
make again, at which shapes, where an op meets operands of other sizes.

Each rule reads the global equation and the shard-sized operands it met; none traces.
"""

from __future__ import annotations

import math

import numpy as np
from jax.sharding import AbstractMesh

from ..._token_axes import as_axes
from ...jaxpr import is_literal, sub_of

# Results shaped like their first operand whatever the others' sizes.
FOLLOWS_FIRST = ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
                 "scatter-max", "scatter_min", "scatter_max", "dynamic_update_slice")
# Ops whose operands may look like an elementwise op's (of size 1 where the result is not).
_NOT_ELEMENTWISE = ("concatenate", "pad", "dynamic_update_slice", "dynamic_slice")


class Unfit(Exception):
    """The global jaxpr does not bind again at one shard's shapes."""


def operands_to_resize(eqn, invals, known_first=lambda atom: True) -> dict:
    """The operands to rebuild, and at which shapes, for `eqn` to bind on `invals`: {}
    where that is not known. `known_first`: whether an operand's shape is known rather
    than guessed; the known ones decide first."""
    name = eqn.primitive.name
    if elementwise(eqn):
        return _elementwise_resize(eqn, invals, known_first)
    if name == "concatenate":
        return _concatenated_resize(eqn, invals, eqn.params["dimension"])
    if name == "dot_general":
        return _contracted_resize(eqn, invals)
    if name.startswith("scatter"):
        return _scattered_resize(eqn, invals)
    return {}


def elementwise(eqn) -> bool:
    """Results all of one shape, and operands of that shape, or scalars, or of size 1
    where they broadcast (a sort's several results too); at least one operand of the
    results' rank, from which they take their shape (not a random draw from its key)."""
    if not eqn.outvars or sub_of(eqn) is not None or eqn.primitive.name in _NOT_ELEMENTWISE:
        return False
    shape = eqn.outvars[0].aval.shape
    operands = [a.aval.shape for a in eqn.invars if not is_literal(a)]
    return (all(v.aval.shape == shape for v in eqn.outvars)
            and any(fitted(a, shape, shape) is not None for a in operands)
            and all(not a or fitted(a, shape, shape) is not None for a in operands))


def fitted(operand, result, target) -> tuple | None:
    """An elementwise operand's shape for a result at `target`: the target where the
    operand has the result's size, 1 where it broadcasts; None for a scalar."""
    if not operand or len(operand) != len(result):
        return None
    if any(n not in (g, 1) for n, g in zip(operand, result)):
        return None
    return tuple(t if n == g else 1 for n, g, t in zip(operand, result, target))


def _elementwise_resize(eqn, invals, known_first) -> dict:
    """The operands of an elementwise op to rebuild. Each dimension takes its size from
    the operand of a known shape that shrank along the most dimensions and does not
    broadcast there (the others still have a global size, or a guessed split)."""
    result = eqn.outvars[0].aval.shape
    operands = [(a.aval.shape, np.shape(x), known_first(a)) for a, x in zip(eqn.invars, invals)
                if not is_literal(a) and fitted(a.aval.shape, result, result)]
    operands.sort(key=lambda o: (not o[2], -sum(n != g for n, g in zip(o[1], o[0]))))
    target = tuple(next((s[d] for g, s, _ in operands if g[d] == result[d]), result[d])
                   for d in range(len(result)))
    resized = {}
    for a, x in zip(eqn.invars, invals):
        wanted = None if is_literal(a) else fitted(a.aval.shape, result, target)
        if wanted is not None and np.shape(x) != wanted:
            resized[a] = wanted
    return resized


def _concatenated_resize(eqn, invals, axis: int) -> dict:
    """The operands of a concatenation to rebuild: along every other dimension, at the
    size of the operand that shrank along the most dimensions."""
    shapes = {a: np.shape(x) for a, x in zip(eqn.invars, invals) if not is_literal(a)}
    target = max(shapes.values(), key=lambda s: sum(n != g for n, g in zip(s, eqn.outvars[0].aval.shape)))
    wanted = {a: target[:axis] + (s[axis],) + target[axis + 1:] for a, s in shapes.items()}
    return {a: w for a, w in wanted.items() if w != shapes[a]}


def _contracted_resize(eqn, invals) -> dict:
    """The operand of a dot_general to rebuild where its contracting or batch dimensions
    do not match the other's: at the size of the one that shrank along more of them."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
    pairs = list(zip((*lhs_c, *lhs_b), (*rhs_c, *rhs_b)))
    sides = [(a, np.shape(x), [p[k] for p in pairs]) for k, (a, x) in enumerate(zip(eqn.invars, invals[:2]))]
    shrunk = [sum(shape[d] != a.aval.shape[d] for d in dims) for a, shape, dims in sides]
    if shrunk[0] == shrunk[1]:
        return {}
    (_, known, known_dims), (other, shape, dims) = sides if shrunk[0] > shrunk[1] else sides[::-1]
    wanted = list(shape)
    for k, d in zip(known_dims, dims):
        wanted[d] = known[k]
    return {other: tuple(wanted)} if tuple(wanted) != shape else {}


def _scattered_resize(eqn, invals) -> dict:
    """A scatter's operand and updates to rebuild where they do not match its indices'
    shard size: the updates' scatter dimensions are the indices' (all but the last, JAX's
    index vector), the operand's batching dimensions the indices' batching ones."""
    operand, indices, updates = (np.shape(x) for x in invals[:3])
    numbers = eqn.params["dimension_numbers"]
    window = set(numbers.update_window_dims)
    batch = iter(indices[:-1])
    wanted = {2: tuple(n if d in window else next(batch, n) for d, n in enumerate(updates)),
              0: list(operand)}
    for od, idx in zip(getattr(numbers, "operand_batching_dims", ()),
                       getattr(numbers, "scatter_indices_batching_dims", ())):
        wanted[0][od] = indices[idx]
    wanted[0] = tuple(wanted[0])
    return {eqn.invars[k]: shape for k, shape in wanted.items()
            if shape != np.shape(invals[k]) and not is_literal(eqn.invars[k])}


def broadcast_shape(eqn, operand_shape) -> tuple:
    """A broadcast's result at the operand's size along the dimensions it maps."""
    shape = list(eqn.params["shape"])
    global_operand = eqn.invars[0].aval.shape if not is_literal(eqn.invars[0]) else ()
    for n, g, d in zip(operand_shape, global_operand, eqn.params["broadcast_dimensions"]):
        if g == shape[d]:
            shape[d] = n
    return tuple(shape)


def slice_limits(eqn, operand_shape) -> tuple:
    """A slice's limits at one shard's size: a dimension sliced to its end ends at the
    shard's end (MaxText's `mask[..., 1:]` over capacity slots); the others keep theirs."""
    whole = eqn.invars[0].aval.shape
    return tuple(n if limit == g else limit
                 for limit, g, n in zip(eqn.params["limit_indices"], whole, operand_shape))


def slice_sizes(eqn, operand_shape) -> tuple:
    """A dynamic slice's sizes at one shard's size: a whole dimension stays whole."""
    whole = eqn.invars[0].aval.shape
    return tuple(n if size == g else size for size, g, n in zip(eqn.params["slice_sizes"], whole, operand_shape))


def reshaped(global_in, local_in, global_out, folds: dict | None = None) -> tuple[tuple, tuple]:
    """A reshape's result at one shard's size, and which of its dimensions are a guess.
    The dimensions split into the smallest segments of equal size on both sides; a
    segment's result dimensions shrink by what its operand dimensions shrank. Where a
    shrunk segment splits into several dimensions that are not 1, they unfold as an earlier
    reshape folded dimensions of the same global sizes (`folds`: tokens back into batch and
    sequence, as they were flattened); else the outermost shrinks first, which is a guess
    that the shape pass (`trace/_shard_shapes.py`) mends where the result meets a value of another shape."""
    out = list(global_out)
    guessed: tuple = ()
    for i0, i, j0, j in _segments(global_in, global_out):
        size_in, local = math.prod(global_in[i0:i]), math.prod(local_in[i0:i])
        if local == size_in:
            continue
        if size_in % local:
            raise Unfit(f"a reshape of {tuple(global_in)} to {tuple(global_out)} does not divide "
                        f"at one shard's size {tuple(local_in)}")
        unfolded = (folds or {}).get(tuple(global_out[j0:j]))
        if unfolded is not None and math.prod(unfolded) == local:
            out[j0:j] = unfolded
            continue
        if folds_several(out[j0:j]):
            guessed += tuple(range(j0, j))
        factor = size_in // local
        for d in range(j0, j):
            take = math.gcd(factor, out[d])
            out[d] //= take
            factor //= take
    return tuple(out), guessed


def folds_several(sizes) -> bool:
    """A run of a reshape's dimensions holds more than one longer than 1: it folds (or
    unfolds) dimensions, where one that only adds or drops dimensions of size 1 does not."""
    return sum(n > 1 for n in sizes) > 1


def folded(global_in, local_in, global_out) -> dict:
    """The runs of dimensions a reshape folds into one, by their global sizes, with their
    sizes on one shard: how the same sizes unfold again (`reshaped`'s `folds`)."""
    return {tuple(global_in[i0:i]): tuple(local_in[i0:i])
            for i0, i, j0, j in _segments(global_in, global_out)
            if i - i0 > 1 and j - j0 == 1 and tuple(local_in[i0:i]) != tuple(global_in[i0:i])}


def _segments(global_in, global_out):
    """(i0, i, j0, j) per segment: `global_in[i0:i]` and `global_out[j0:j]`, the smallest
    runs of dimensions of equal size."""
    i = j = 0
    while i < len(global_in) or j < len(global_out):
        i0, j0, size_in, size_out = i, j, 1, 1
        if i < len(global_in):
            size_in, i = global_in[i], i + 1
        if j < len(global_out):
            size_out, j = global_out[j], j + 1
        while size_in != size_out:
            if size_in < size_out and i < len(global_in):
                size_in, i = size_in * global_in[i], i + 1
            elif size_out < size_in and j < len(global_out):
                size_out, j = size_out * global_out[j], j + 1
            else:
                raise Unfit(f"a reshape of {tuple(global_in)} to {tuple(global_out)} has no segments")
        yield i0, i, j0, j


def declared_shapes(eqn, divided: dict[str, int], mesh) -> list[tuple]:
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
    devices is `data` and `context` folded). {} where they hold other devices, or where
    its mesh names no devices (an AbstractMesh, as JAX's transpose of a shard_map binds):
    its axes are then the step's axes of the same names."""
    if mesh is None or isinstance(own, AbstractMesh) or list(own.devices.flat) != list(mesh.devices.flat):
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
