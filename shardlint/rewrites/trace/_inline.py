"""A user's shard_map in which every device computes the same thing, inlined into the step
before the rewrite plans it.

A library may run its routing in shard_maps of its own that split nothing: Levanter's Mixtral
maps its flattened `token` axis to no mesh axis, so its route, permute and unpermute
shard_maps take every token on every device. Every device then computes the whole result,
the same on each: the shard_map is a call of its body. Inlined, its top_k, argsort and
gathers are equations of the step like any other, and a routed region grows through them
as if the library had written no shard_map.

Differentiated, such a shard_map keeps the same property in other forms, and they are read
as what they compute when every device holds the same values:
- residuals the forward pass saves for the backward leave with out_specs over every mesh
  axis: the global value is one device's value repeated. Each is kept as that one value (a
  *copy*), which a later shard_map's in_spec that splits it the same way hands to each
  device whole, through a scan's stacked outputs and inputs and a call's boundary;
- the transpose of a replicated input sums its cotangent over the mesh (`psum`): over
  values that are the same on every device, that is the value times the devices summed over
  (and pmax, pmin, a broadcast from one device, the value itself).
A copy that reaches anything else is tiled back to its global value. A shard_map that splits
anything else, or whose body names a mesh axis any other way (an all_gather, a permutation,
its device's index), stays as it is: the planner does not enter it, and the shape pass
gives it the shapes its out_specs declare.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ... import _jax
from ..._token_axes import as_axes
from ..shard import ShardBinder
from ...jaxpr import bind_eqn, bind_with, carries, equations, is_literal, read, sub_of

# Collectives whose result, over a value that is the same on every device, is known.
_SUMS = {"psum", "psum_invariant"}
_UNCHANGED = {"pmax", "pmin", "pbroadcast", "pvary"}


def inline_same_on_every_device(closed):
    """`closed` (a ClosedJaxpr, traced in the mesh context in effect) with each shard_map in
    which every device computes the same thing replaced by its body, in the bodies of the
    calls and loops that hold one too; `closed` itself where there is none."""
    if not any(_may_inline(e) and _takes_whole_operands(e) for e in equations(closed.jaxpr)):
        return closed   # copies come only from such a one: none is inlined
    inliner = _Inliner()
    avals = [_jax.struct_of(v.aval) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *xs: inliner.run(closed.jaxpr, closed.consts, xs, {}, top=True)[0])(*avals)


def _may_inline(eqn) -> bool:
    """A shard_map whose body names no mesh axis but in the collectives `_SUMS`/`_UNCHANGED`."""
    if eqn.primitive.name != "shard_map":
        return False
    return all(e.primitive.name in _SUMS | _UNCHANGED or not _axes_named(e)
               for e in equations(eqn.params["jaxpr"]))


def _takes_whole_operands(eqn) -> bool:
    """A shard_map whose in_specs split no operand."""
    sizes = eqn.params["mesh"].shape
    return not any(_splits(spec, len(a.aval.shape), sizes) for a, spec in zip(eqn.invars, eqn.params["in_specs"]))


def _axes_named(eqn) -> tuple:
    """The mesh axes an equation names (a collective's, a device index's)."""
    names = []
    for key in ("axes", "axis_name"):
        value = eqn.params.get(key)
        names += [a for a in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(a, str)]
    return tuple(names)


def _splits(spec, rank: int, sizes) -> dict[int, int]:
    """dimension -> the number of blocks `spec` splits it into (axes of one device left out)."""
    found = {}
    for d, entry in enumerate(tuple(spec)[:rank]):
        n = math.prod(sizes.get(a, 1) for a in as_axes(entry))
        if n > 1:
            found[d] = n
    return found


class _Inliner:
    """Runs a jaxpr again with those shard_maps inlined. A value held as a copy has its
    global form's dimensions `copies[var]` (dimension -> repeats) one repeat long."""

    def run(self, jaxpr, consts, invals, copies_in: dict, *, top: bool = False) -> tuple[list, dict]:
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, invals))
        copies = {v: c for v, c in copies_in.items() if c}
        for eqn in jaxpr.eqns:
            outs, out_copies = self.bind(eqn, [read(env, a) for a in eqn.invars],
                                         [None if is_literal(a) else copies.get(a) for a in eqn.invars])
            env.update(zip(eqn.outvars, outs))
            copies.update((v, c) for v, c in zip(eqn.outvars, out_copies) if c)
        outs = [read(env, v) for v in jaxpr.outvars]
        held = [None if is_literal(v) else copies.get(v) for v in jaxpr.outvars]
        if top:
            return [_tiled(x, c) for x, c in zip(outs, held)], {}
        return outs, {k: c for k, c in enumerate(held) if c}

    def bind(self, eqn, invals: list, copies: list) -> tuple[list, list]:
        if _may_inline(eqn):
            inlined = self._inlined(eqn, invals, copies)
            if inlined is not None:
                return inlined
        sub = sub_of(eqn)
        if sub is not None and (any(copies) or any(_may_inline(e) for e in equations(sub.jaxpr))):
            return self._entered(eqn, sub, invals, copies)
        return bind_eqn(eqn, [_tiled(x, c) for x, c in zip(invals, copies)]), [None] * len(eqn.outvars)

    def _inlined(self, eqn, invals, copies):
        """The shard_map's body on each device's operands, where each is the whole operand or
        a copy split as it was repeated; None where an operand splits otherwise."""
        sizes = eqn.params["mesh"].shape
        body = eqn.params["jaxpr"]
        for a, c, spec in zip(eqn.invars, copies, eqn.params["in_specs"]):
            if _splits(spec, len(a.aval.shape), sizes) != (c or {}):
                return None
        outs = _SameOnEveryDevice(sizes).run(body, (), invals)
        return outs, [_splits(spec, len(v.aval.shape), sizes) or None
                      for v, spec in zip(body.outvars, eqn.params["out_specs"])]

    def _entered(self, eqn, sub, invals, copies):
        """A call or scan bound again with its body run so: copies pass its boundary as copies
        (one dimension further in for what a scan stacks), except what a scan carries."""
        invals, copies = list(invals), list(copies)
        first_carry, end_carry = carries(eqn)
        sliced = lambda k: sub.stacks and k >= sub.sliced_from   # noqa: E731
        inner_copies = {}
        for k, (c, inner) in enumerate(zip(copies, sub.jaxpr.invars)):
            if not c or first_carry <= k < end_carry or (sliced(k) and 0 in c):
                invals[k], copies[k] = _tiled(invals[k], c), None
            else:
                inner_copies[inner] = {d - 1: n for d, n in c.items()} if sliced(k) else c
        avals = [_jax.struct_of(inner.aval, np.shape(x)[1:] if sliced(k) else np.shape(x))
                 for k, (x, inner) in enumerate(zip(invals, sub.jaxpr.invars))]
        found: dict = {}

        def body(*xs):
            outs, out_copies = self.run(sub.jaxpr, sub.consts, xs, inner_copies)
            found.update(out_copies)
            carried = range(end_carry - first_carry)   # a carry leaves as it came: global
            return [_tiled(x, out_copies.get(k)) if k in carried else x for k, x in enumerate(outs)]

        outs = bind_with(eqn, jax.make_jaxpr(body)(*avals), invals)
        stacks = sub.stacks
        out_copies = [None if k < end_carry - first_carry or k not in found
                      else {d + 1: n for d, n in found[k].items()} if stacks else found[k]
                      for k in range(len(outs))]
        return outs, out_copies


class _SameOnEveryDevice(ShardBinder):
    """Binds a shard_map's body outside it, on values that are the same on every device: a
    sum over the mesh is the value times the devices summed over."""

    def __init__(self, sizes):
        super().__init__({}, {}, {})
        self.mesh_sizes = sizes

    def operand(self, eqn, k: int, atom, value):
        return _jax.unplaced(atom.val) if is_literal(atom) else value

    def bind(self, eqn, invals: list) -> list:
        name = eqn.primitive.name
        if name in _SUMS:
            n = math.prod(self.mesh_sizes.get(a, 1) for a in _axes_named(eqn))
            return [x * np.asarray(n, np.result_type(x)) for x in invals]
        if name in _UNCHANGED:
            return list(invals)
        return super().bind(eqn, invals)


def _tiled(x, copies):
    """A value held as a copy, at its global form: the copy repeated along each dimension."""
    if not copies:
        return x
    return jnp.tile(x, [copies.get(d, 1) for d in range(np.ndim(x))])


