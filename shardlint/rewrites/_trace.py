"""Trace the step three times and pair the traces: what shrinks per shard is a token.

The step is traced at its global shapes, at one shard's shapes (the data arguments'
batch and sequence dimensions divided by their mesh degrees), and with only the sequence
divided. The traces have the same equations (the user's code runs the same way at any
size, or is made to: below), inside jit, scan and checkpoint bodies too, and their values
are paired where the equations use them (`pair_vars`); a value whose dimension shrinks
carries tokens along it, and by how much says which mesh axes shard it. Only the arguments
that carry tokens shrink (`token_leaves`: sharded over the batch and sequence axes as the
lost value was, whatever their place in the signature); parameters and optimizer state
keep their global shapes however they are sharded, so FSDP weights stay what they are.

A step whose Python does not trace at one shard's shapes (a mask of the configured
sequence length meets a shard's scores), or traces into other equations there (a Python
branch on an array's size), is traced there from its global jaxpr instead (`_retrace`);
the values whose shard's content or shape that trace cannot tell are `unsure`: a shard
never rebuilds them (`Builders`) and no region may read or make them.

A pre-jitted step (`jax.jit` with shardings and donation, or the jit inside `nnx.jit`) is
traced through the function it wraps, so that its in-shardings are not checked against
one shard's shapes; its own `jit` equation is kept to bind the rewritten body with the
same shardings and donation.
"""

from __future__ import annotations

import dataclasses
import traceback as tb
from typing import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _jax
from .._errors import RewriteError, first_line
from .._token_axes import TokenAxes, as_axes, degree
from .._wrapped import unwrap
from ..internal import display_path, is_library_file, parameter_argnums
from ._jitted import jit_equation
from ._replay import inner_jaxpr
from ._retrace import retrace
from ._shard_shapes import Unfit
from ._subjaxprs import sub_of


@dataclasses.dataclass
class Traces:
    global_jaxpr: object          # ClosedJaxpr of the flattened step at global shapes
    local_jaxpr: object           # ... at one shard's shapes
    seq_jaxpr: object             # ... with only the sequence divided
    out_tree: object              # the step's output pytree
    jit_eqn: object | None        # a pre-jitted step's own jit equation
    # why the step was traced at one shard's shapes from its global jaxpr; None if it was not
    why_retraced: str | None = None
    # Global Vars whose per-shard value the retraced jaxpr cannot tell (`_retrace`): built
    # from the configuration (a shard's shape only), or split by a guess nothing settled.
    unsure: frozenset = frozenset()


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


def trace_step(step: Callable, args: tuple, tokens: Tokens, mesh) -> Traces:
    flat, tree = jax.tree_util.tree_flatten(args)
    body = unwrap(step)
    out_tree: list = []

    def flat_fn(fn):
        def run(*leaves):
            out = fn(*jax.tree_util.tree_unflatten(tree, leaves))
            leaves_out, treedef = jax.tree_util.tree_flatten(out)
            out_tree[:] = [treedef]
            return leaves_out
        return run

    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
    global_jaxpr = jax.make_jaxpr(flat_fn(body))(*abstract)
    jit_eqn = jit_equation(step, args)
    axes = tokens.axes
    data = token_leaves(args, tokens, mesh, global_jaxpr.out_avals)
    nb = degree(mesh, axes.batch)
    ns = degree(mesh, axes.seq)
    specs = [_spec_of(x) for x in flat]
    local = [_shrunk(x, s, axes, nb, ns) if d else a for x, s, d, a in zip(flat, specs, data, abstract)]
    by_seq = [_shrunk(x, s, axes, 1, ns) if d else a for x, s, d, a in zip(flat, specs, data, abstract)]
    local_jaxpr, retraced = _per_shard(flat_fn(body), local, global_jaxpr)
    seq_jaxpr, seq_retraced = _per_shard(flat_fn(body), by_seq, global_jaxpr)
    both = [r for r in (retraced, seq_retraced) if r is not None]
    unsure = frozenset().union(*(r.stand_ins | r.guessed for r in both))
    return Traces(global_jaxpr, local_jaxpr, seq_jaxpr, out_tree[0], jit_eqn,
                  both[0].why if both else None, unsure)


def pair_vars(global_jaxpr, other_jaxpr) -> dict:
    """Global Var -> the Var at the same place in the other trace, inner jaxprs included.

    Both traces run the same equations, but their operand lists need not line up: at other
    sizes JAX may hoist or share a different set of constants (a table cached per size is
    one constant where two sizes coincide), so a scan or shard_map gets other operands
    (MaxText's Qwen3-Next layers give their scan 93 operands at the global shapes and 98 at
    one shard's). So only the step's own inputs pair one for one; every other input pairs
    where it is first used, a call's operands through its body's inputs and its results
    through the values its body returns.
    """
    pairs = dict(zip(global_jaxpr.invars, other_jaxpr.invars))
    _pair_body(global_jaxpr, other_jaxpr, pairs)
    return pairs


def _pair_body(g, o, pairs: dict) -> None:
    for g_eqn, o_eqn in zip(g.eqns, o.eqns):
        g_inner, o_inner = _inner_of(g_eqn), _inner_of(o_eqn)
        if g_inner is None or o_inner is None or not _same_primitives(g_inner, o_inner):
            if len(g_eqn.invars) == len(o_eqn.invars):
                _pair_uses(g_eqn.invars, o_eqn.invars, pairs)
            _pair_results(g_eqn, o_eqn, pairs)
            continue
        _pair_body(g_inner, o_inner, pairs)
        _pair_uses(g_eqn.invars, [_through(a, v, o_inner.invars, o_eqn.invars, pairs)
                                  for a, v in zip(g_eqn.invars, g_inner.invars)], pairs)
        for g_out, inner in zip(g_eqn.outvars, g_inner.outvars):
            o_out = _through(g_out, inner, o_inner.outvars, o_eqn.outvars, pairs)
            if o_out is not None:
                _pair(g_out, o_out, pairs)


def _inner_of(eqn):
    """The open jaxpr of a call that takes its operands and gives its results one for one
    (jit, scan, checkpoint, custom-derivative calls, a user's own shard_map), else None."""
    inner = inner_jaxpr(eqn)
    return None if inner is None else getattr(inner, "jaxpr", inner)


def _same_primitives(g, o) -> bool:
    return [e.primitive.name for e in g.eqns] == [e.primitive.name for e in o.eqns]


def _through(outer, inner, o_inner_atoms, o_outer_atoms, pairs):
    """The other trace's operand (or result) of a call whose body input (or output) is
    paired with `inner`: where the other body names that partner, at a place where the
    call's value is alike with `outer` (a scan may return one value as a carry and stacked)."""
    partner = None if _jax.is_literal(inner) else pairs.get(inner)
    if partner is None or _jax.is_literal(outer):
        return None
    return next((o for i, o in zip(o_inner_atoms, o_outer_atoms)
                 if i is partner and not _jax.is_literal(o) and _alike(outer, o)), None)


def _pair_uses(g_atoms, o_atoms, pairs: dict) -> None:
    for a, b in zip(g_atoms, o_atoms):
        if b is not None and not _jax.is_literal(a) and not _jax.is_literal(b) and a not in pairs:
            _pair(a, b, pairs)


def _pair_results(g_eqn, o_eqn, pairs: dict) -> None:
    """An equation's results one for one, unless they do not line up: a call whose body
    is not read (`while`, `cond`) may return other values at other sizes. Those stay
    unpaired, so nothing counts them as carrying tokens, and a region that reads one
    fails to trace and is refused."""
    if len(g_eqn.outvars) != len(o_eqn.outvars) or not all(map(_alike, g_eqn.outvars, o_eqn.outvars)):
        return
    pairs.update(zip(g_eqn.outvars, o_eqn.outvars))


def _alike(a, b) -> bool:
    """Whether two Vars can be the same value at two sizes: same dtype and rank."""
    ga, oa = a.aval, b.aval
    return (getattr(ga, "dtype", None) == getattr(oa, "dtype", None)
            and len(getattr(ga, "shape", ())) == len(getattr(oa, "shape", ())))


def _pair(a, b, pairs: dict) -> None:
    """Pairs two Vars, refusing what cannot be the same value at another size."""
    if not _alike(a, b):
        raise RewriteError(f"the step's traces at its own and at one shard's shapes do not line "
                           f"up ({a.aval.str_short()} against {b.aval.str_short()}): it cannot be "
                           "rewritten per shard. Please report it with this message")
    pairs[a] = b


def _first_difference(g, o):
    """The first equation of `g` whose primitive `o` does not have at the same place
    (bodies included), `g`'s last one if `o` has more or fewer, None if none."""
    if _same_primitives(g, o):
        for e, f in zip(g.eqns, o.eqns):
            g_sub, o_sub = sub_of(e), sub_of(f)
            if g_sub is not None and o_sub is not None:
                where = _first_difference(g_sub.jaxpr, o_sub.jaxpr)
                if where is not None:
                    return where
        return None
    return next((e for e, f in zip(g.eqns, o.eqns) if e.primitive.name != f.primitive.name),
                g.eqns[-1] if g.eqns else None)


def _at(eqn) -> str:
    frame = _jax.user_frame(eqn) if eqn is not None else None
    return f" at {display_path(frame[0])}:{frame[1]}" if frame else ""


def _python_trace(fn, avals):
    return jax.make_jaxpr(fn)(*avals)


def _per_shard(fn, avals, global_jaxpr):
    """The step traced at one shard's shapes through its Python where that traces into the
    same equations (and None), else its global jaxpr traced again there (and the
    `Retraced`, with why)."""
    try:
        local = _python_trace(fn, avals)
    except RewriteError:
        raise
    except Exception as error:  # the user's code, traced at shapes it was not written for
        frame = user_frame_of(error.__traceback__)
        why = f"the step does not trace at one shard's shapes ({type(error).__name__}{frame})"
        return _retraced(global_jaxpr, avals, why, (
            f"the step does not trace at one shard's shapes{frame}: {type(error).__name__}: "
            f"{first_line(error)}"), "build masks and positions from the input's shape (x.shape[1]) "
            "rather than a configured length")
    where = _first_difference(global_jaxpr.jaxpr, local.jaxpr)
    if where is None:
        return local, None
    why = f"the step traces into other equations at one shard's shapes{_at(where)}"
    return _retraced(global_jaxpr, avals, why, (
        "the step traces differently at one shard's shapes (shape-dependent Python control "
        f"flow{_at(where)}?)"), "make the branch depend on the configuration, not on the array sizes")


def _retraced(global_jaxpr, avals, why: str, refusal: str, way_out: str):
    try:
        retraced = retrace(global_jaxpr, avals)
    except Exception as e:  # Unfit, or JAX refusing an equation in a way `_retrace` does not know
        unfit = e if isinstance(e, Unfit) else f"{type(e).__name__}: {first_line(e)}"
        raise RewriteError(
            f"{refusal}; nor does its jaxpr ({unfit}). The routed layer runs per shard, so the "
            f"step is traced with the batch and sequence divided by their mesh degrees; {way_out}, "
            "or pass batch_axes=/seq_axes= naming fewer axes") from None
    return retraced.jaxpr, dataclasses.replace(retraced, why=why)


def user_frame_of(traceback) -> str:
    """` at file:line (function)` of the innermost user frame of a traceback, or ""."""
    frames = [f for f in tb.extract_tb(traceback) if not is_library_file(f.filename)
              and "/shardlint/rewrites/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {display_path(f.filename)}:{f.lineno} ({f.name})"


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
