"""Trace the step once, as `jax.jit` does, and find which of its values carry tokens.

The step's Python is traced at its global shapes only: code that checks its shapes against
the mesh (a kernel wrapper in its own shard_map, an assert on the global batch) sees the
shapes it was written for. Which values carry tokens, along which dimensions, and over which
mesh axes, is found by binding that jaxpr again with the inputs that carry tokens at one
shard's shapes (`shard_shapes`), twice: with the batch and sequence divided by their
mesh degrees, and with only the sequence divided. A value whose dimension shrinks carries
tokens along it, and by how much says which mesh axes shard it. Only the arguments that
carry tokens shrink (`token_leaves`: sharded over the batch and sequence axes as the lost
value was, whatever their place in the signature); parameters and optimizer state keep
their global shapes however they are sharded, so FSDP weights stay what they are.

A shard_map of the user's in which every device computes the same thing (it splits nothing)
is a call of its body and is inlined (`_inline`): a library that routes inside such
shard_maps is planned as if it had written none.

A pre-jitted step (`jax.jit` with shardings and donation, or the jit inside `nnx.jit`) is
traced through the function it wraps, so that its in-shardings are not checked against
one shard's shapes; its own `jit` equation is kept to bind the rewritten body with the
same shardings and donation.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, ContextManager

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..._errors import RewriteError, first_line
from ..._token_axes import TokenAxes, as_axes, degree
from ..._wrapped import unwrap
from ...analyzer import in_context_as_jit, parameter_argnums
from ._inline import inline_same_on_every_device
from ...jaxpr import jit_equation
from ._shard_shapes import ShardShapes, shard_shapes
from ..shard import Unfit


@dataclasses.dataclass
class Traces:
    global_jaxpr: object          # ClosedJaxpr of the flattened step at global shapes
    local: ShardShapes            # its values at one shard's shapes
    by_seq: ShardShapes           # ... with only the sequence divided
    out_tree: object              # the step's output pytree
    jit_eqn: object | None        # a pre-jitted step's own jit equation
    context: Callable[[], ContextManager] = contextlib.nullcontext   # the mesh context it was traced in

    @property
    def stand_ins(self) -> frozenset:
        """Global Vars whose per-shard content the passes cannot tell (`trace/_shard_shapes.py`)."""
        return self.local.stand_ins | self.by_seq.stand_ins

    @property
    def guessed(self) -> frozenset:
        """Global Vars whose per-shard shape is a guess the passes could not settle."""
        return self.local.guessed | self.by_seq.guessed

    @property
    def unbound(self) -> dict:
        """id(eqn) -> why that equation does not bind at one shard's shapes."""
        return {**self.by_seq.unbound, **self.local.unbound}


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Which of the step's arguments carry tokens, as the analysis found them lost: the mesh
    axes that shard their batch and sequence dimensions, and those dimensions' global sizes
    (None: any size, where the axes were given rather than found)."""

    axes: TokenAxes
    batch_size: int | None = None
    seq_size: int | None = None
    params_argnums: tuple[int, ...] | None = None   # the user's word on which are parameters
    roles: tuple[str, ...] = ()   # the analysis's word per argument leaf (`Analysis.argument_roles`)


def trace_step(step: Callable, args: tuple, tokens: Tokens, mesh, *, per_shard_capacity: bool = False) -> Traces:
    flat, tree = jax.tree_util.tree_flatten(args)
    body = unwrap(step)
    out_tree: list = []

    def flat_fn(*leaves):
        out = body(*jax.tree_util.tree_unflatten(tree, leaves))
        leaves_out, treedef = jax.tree_util.tree_flatten(out)
        out_tree[:] = [treedef]
        return leaves_out

    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
    # In the mesh context jax.jit needs for the step, as the analysis lowers it: a step that
    # reads the mesh in context (linen's logical constraints) traces to its constraints there.
    found = in_context_as_jit(lambda: jax.make_jaxpr(flat_fn)(*abstract), mesh, str)
    with found.enter():
        global_jaxpr = inline_same_on_every_device(found.made)
        jit_eqn = jit_equation(step, args)
    axes = tokens.axes
    data = token_leaves(args, tokens, mesh, global_jaxpr.out_avals)
    nb = degree(mesh, axes.batch)
    ns = degree(mesh, axes.seq)
    specs = [_spec_of(x) for x in flat]
    local = [_shrunk(x, s, axes, nb, ns) if d else a for x, s, d, a in zip(flat, specs, data, abstract)]
    by_seq = [_shrunk(x, s, axes, 1, ns) if d else a for x, s, d, a in zip(flat, specs, data, abstract)]
    sizes = dict(mesh.shape)
    return Traces(global_jaxpr,
                  _shapes(global_jaxpr, local, {a: sizes[a] for a in axes.all}, per_shard_capacity, mesh),
                  _shapes(global_jaxpr, by_seq, {a: sizes[a] for a in axes.seq}, per_shard_capacity, mesh),
                  out_tree[0], jit_eqn, found.enter)


def _shapes(global_jaxpr, avals, divided, per_shard_capacity, mesh) -> ShardShapes:
    try:
        return shard_shapes(global_jaxpr, avals, divided, capacity=per_shard_capacity, mesh=mesh)
    except Unfit as e:
        raise RewriteError(f"the step's values do not settle at one shard's shapes ({first_line(e)}); "
                           "pass batch_axes=/seq_axes= naming fewer axes, or report it with this "
                           "message") from e


def token_leaves(args: tuple, tokens: Tokens, mesh, out_avals) -> list[bool]:
    """Per flat leaf of `args`, whether it carries tokens (and shrinks per shard).

    Read from the values, not from the signature: a leaf carries tokens when it has a
    dimension sharded over the sequence axes, of the sequence's size, after one sharded over
    the batch axes, of the batch's size (any dimension where the batch is not sharded), as
    the lost value had them. Parameters sharded over the same axes (FSDP over data, MaxText's
    embed dimension over context) lack that pair and keep their global shapes. Only when no
    leaf has it does the position of the arguments decide (every positional argument but
    the last that the step returns with the same shapes is a parameter); `params_argnums`
    overrides both. Of the leaves so sharded, those the analysis found weights
    (`Tokens.roles`) are not, where others are."""
    leaves_per_arg = [jax.tree_util.tree_leaves(a) for a in args]
    if tokens.params_argnums is not None:
        params = set(tokens.params_argnums)
    else:
        found = [_carries_tokens(x, tokens, mesh) for leaves in leaves_per_arg for x in leaves]
        # A weight that happens to be sharded and sized like the tokens (an embed dimension
        # of the sequence's length over the context axis) is not one where the analysis
        # found it a weight.
        if len(tokens.roles) == len(found):
            inputs = [f and role != "weight" for f, role in zip(found, tokens.roles)]
            found = inputs if any(inputs) else found
        if any(found):
            return found
        params = set(parameter_argnums(leaves_per_arg, out_avals))
    return [i not in params for i, leaves in enumerate(leaves_per_arg) for _ in leaves]


def _carries_tokens(x, tokens: Tokens, mesh) -> bool:
    spec = tuple(_spec_of(x)) + (None,) * len(getattr(x, "shape", ()))
    shape = tuple(getattr(x, "shape", ()))
    entries = [_real_axes(as_axes(e), mesh) for e in spec[:len(shape)]]
    batch, seq = _real_axes(tokens.axes.batch, mesh), _real_axes(tokens.axes.seq, mesh)
    if not seq:   # only the batch sharded: a dimension of the batch's size over its axes
        return bool(batch) and any(entry == batch and tokens.batch_size in (None, size)
                                   for entry, size in zip(entries, shape))
    for j, (entry, size) in enumerate(zip(entries, shape)):
        if not seq or entry != seq or tokens.seq_size not in (None, size):
            continue
        if not batch or any(entries[i] == batch and tokens.batch_size in (None, shape[i]) for i in range(j)):
            return True
    return False


def _real_axes(names: tuple[str, ...], mesh) -> tuple[str, ...]:
    """The axes of `names` that shard anything (size > 1 in the mesh)."""
    return tuple(a for a in names if mesh.shape.get(a, 1) > 1)


def _spec_of(x):
    sharding = getattr(x, "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else P()


def _shrunk(x, spec, axes: TokenAxes, nb: int, ns: int):
    """`x` at one shard's size along the dims sharded over batch or sequence axes."""
    shape = list(x.shape)
    for d, entry in enumerate(spec or ()):
        names = as_axes(entry)
        factor = {axes.batch: nb, axes.seq: ns, axes.all: nb * ns}.get(names, 1) if names else 1
        if shape[d] % factor:
            raise RewriteError(f"argument dim {d} of size {shape[d]} does not divide over "
                               f"{names} ({factor} shards)")
        shape[d] //= factor
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
