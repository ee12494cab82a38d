"""What the rewrite refuses, and why: computations that per shard would give other numbers.

Each refusal names the op, the user's line and the way out. A running total over tokens
(a capacity position) or a second dimension that grows with the token count (a capacity)
couples all tokens; a value leaving a routed region is combined across shards only when
it is a plain sum over tokens.
"""

from __future__ import annotations

from ... import _jax
from ..._errors import RewriteError
from ..._ops import CUMULATIVE_PRIMITIVES
from ..._token_axes import as_axes
from ...jaxpr import is_literal, sub_of, variables

# Producers whose non-token result is a sum over tokens: psum across shards restores it.
_TOKEN_REDUCTIONS = {"reduce_sum", "dot_general", "ragged_dot_general", "scatter-add", "scatter_add"}
# Linear in a single region operand (the other operands are the same on every shard).
_LINEAR_UNARY = {"neg", "convert_element_type", "reshape", "transpose", "broadcast_in_dim",
                 "squeeze", "expand_dims", "copy", "copy_p", "reduce_sum", "mul", "dot_general"}
_LINEAR_SUMS = {"add", "add_any", "sub"}

CAPACITY_WAY_OUT = ("Compute capacity per group of tokens (per shard), use a dropless routed MoE, "
                    "or opt in with capacity='per-shard' (CLI --per-shard-capacity) to let each "
                    "shard drop by its own capacity")

def refuse_token_coupling(eqns, region, specs) -> None:
    """A running total over tokens (capacity positions) differs per shard: refuse."""
    for i in sorted(region):
        eqn = _coupling_eqn(eqns[i], specs)
        if eqn is not None:
            where = _jax.eqn_line(eqn) or _jax.eqn_line(eqns[i])  # a jitted helper's caller
            raise RewriteError(
                f"{eqn.primitive.name} over the token dimension{where} couples all tokens "
                "(a capacity or position computed globally): per shard it would give different "
                f"numbers, so this region is left alone. {CAPACITY_WAY_OUT}")


def couples_tokens(eqn, specs) -> bool:
    """A running total (cumsum, reduce-window) along a dimension that carries tokens;
    jitted helpers (jnp.cumsum is one) are looked into."""
    return _coupling_eqn(eqn, specs) is not None


def _coupling_eqn(eqn, specs):
    name = eqn.primitive.name
    sub = sub_of(eqn) if name in ("jit", "pjit") else None
    if sub is not None:
        return next((c for c in map(lambda e: _coupling_eqn(e, specs), sub.jaxpr.eqns) if c is not None), None)
    operands = variables(eqn.invars[:1])
    spec = specs.get(operands[0]) if operands else None
    if spec is None:
        return None
    if name in CUMULATIVE_PRIMITIVES:
        coupled = [eqn.params.get("axis", 0)]
    elif name.startswith("reduce_window"):
        coupled = [d for d, w in enumerate(eqn.params.get("window_dimensions", ())) if w > 1]
    else:
        return None
    return eqn if any(d < len(spec) and spec[d] is not None for d in coupled) else None


def refuse_unsure(eqns, region, stand_ins, guessed, specs, axes, unbound) -> None:
    """What the per-shard pass cannot tell (`_trace.Traces`) may not reach a region's
    shards: an op of the region that does not bind at one shard's shapes (`unbound`, id ->
    why), a split of the tokens whose shape is a guess, or a stand-in (a value whose
    per-shard content the pass does not know) in flattened token order, whose blocks are not
    a shard's tokens. A stand-in in `(batch, seq, ...)` form (a dropout mask drawn at global
    shapes) may be read: it arrives as the shard's block of the real value."""
    for i in sorted(region):
        eqn = eqns[i]
        if id(eqn) in unbound:
            refuse_unbound(eqn, unbound[id(eqn)])
        made = next((v for v in eqn.outvars if v in guessed), None)
        read = next((a for a in eqn.invars if not is_literal(a) and (
            a in guessed or (a in stand_ins and _flattened(specs.get(a), axes)))), None)
        var, verb = (made, "makes") if made is not None else (read, "reads")
        if var is not None:
            raise RewriteError(
                f"{eqn.primitive.name}{_jax.eqn_line(eqn)} in the routed region {verb} "
                f"{var.aval.str_short()}, whose part on each shard is not known: it is "
                "built from a configured length (a table, a mask), or by an op that does "
                "not run at one shard's shapes, or splits the tokens where nothing else "
                "decides how. Build masks and positions from the input's shape "
                "(x.shape[1]) inside the layer, or compute this value outside it")


def _flattened(spec, axes) -> bool:
    """Whether a dimension of `spec` holds batch and sequence axes together (tokens folded
    into one dimension)."""
    return spec is not None and any(set(as_axes(e)) & set(axes.batch) and set(as_axes(e)) & set(axes.seq)
                                    for e in spec)


def refuse_unbound(eqn, why: str) -> None:
    raise RewriteError(
        f"{eqn.primitive.name}{_jax.eqn_line(eqn)} in the routed region does not run at one shard's "
        f"shapes ({why}): its sizes come from the configuration, not from its input. Compute "
        "them from the input's shape (x.shape[1]) inside the layer, or move the op out of it")


def refuse_global_capacity(eqn, var) -> None:
    raise RewriteError(
        f"{var.aval.str_short()}{_jax.eqn_line(eqn)} has a second dimension that grows with the "
        "number of tokens (a capacity computed from all tokens?): per shard it would be smaller "
        f"and drop different tokens, so this region is left alone. {CAPACITY_WAY_OUT}")


def refuse_capacity_exit(eqn, var) -> None:
    raise RewriteError(
        f"{var.aval.str_short()}{_jax.eqn_line(eqn)} has a dimension sized by one shard's capacity "
        "(capacity='per-shard') and is used outside the routed region, where the step expects "
        "the capacity of all tokens. Contract the capacity dimension (the combine back to "
        "(batch, seq, ...)) inside the layer and return only that, or compute capacity per "
        "group of tokens in the model itself")


def refuse_position_exit(eqn, var) -> None:
    raise RewriteError(
        f"a running total over a shard's tokens ({var.aval.str_short()}{_jax.eqn_line(eqn)}: a "
        "token's position in its expert, with capacity='per-shard') leaves the routed region; "
        "outside it the step would compare it with the capacity of all tokens. Keep what reads "
        "the positions (the capacity masks, dispatch and combine) inside the layer and return "
        "only its output, or compute capacity per group of tokens in the model itself")


def refuse_shard_ordered_exit(eqn, var) -> None:
    raise RewriteError(
        f"a per-shard value ({var.aval.str_short()}{_jax.eqn_line(eqn)}: tokens in per-shard order, "
        "or positions within a shard) leaves the routed region; outside it, it would mean "
        "something else. Reshape tokens back to (batch, seq, ...) inside the layer; where a "
        "layer saves it for its backward, wrap the layer in jax.checkpoint so that the backward "
        "recomputes it")


def require_linear(var, eqns, producer, mine, scaled) -> None:
    if _is_linear(var, eqns, producer, mine, scaled, depth=0):
        return
    p = producer.get(var)
    name = eqns[p].primitive.name if p is not None else "?"
    where = _jax.eqn_line(eqns[p]) if p is not None else ""
    raise RewriteError(
        f"the routed region produces {var.aval.str_short()} (by {name}{where}) that is used "
        "outside it and is not a plain sum over tokens, so a per-shard result cannot be "
        "combined exactly (e.g. a global capacity or a statistic that couples all tokens); "
        "compute it outside the layer or per group, then rewrite")


def _is_linear(var, eqns, producer, mine, scaled, depth, arriving=frozenset()) -> bool:
    """Whether `var` is a sum over tokens, up to linear maps of it: a shard's part summed
    across shards gives it (a mean's 1/T keeps its global value per shard, so it is one).
    A jitted helper's result (haliax's `dot`) is asked of its body, where `arriving` are the
    inputs that come from the region."""
    p = producer.get(var)
    if p is None or p not in mine or depth > 16:
        return False
    eqn = eqns[p]
    name = eqn.primitive.name
    ins = variables(eqn.invars)
    region_ins = [v for v in ins if producer.get(v) in mine or v in arriving]
    if name in _TOKEN_REDUCTIONS and any(v in scaled for v in region_ins):
        return True
    if name in _LINEAR_SUMS:
        return len(region_ins) == len(ins) and all(
            _is_linear(v, eqns, producer, mine, scaled, depth + 1, arriving) for v in region_ins)
    if name in _LINEAR_UNARY and len(region_ins) == 1:
        return _is_linear(region_ins[0], eqns, producer, mine, scaled, depth + 1, arriving)
    if name == "div" and region_ins == ins[:1]:
        return _is_linear(region_ins[0], eqns, producer, mine, scaled, depth + 1, arriving)
    sub = sub_of(eqn) if name in ("jit", "pjit") else None
    if sub is not None:
        body = sub.jaxpr
        inner = body.outvars[eqn.outvars.index(var)]
        if is_literal(inner):
            return False
        inner_producer = {v: i for i, e in enumerate(body.eqns) for v in e.outvars}
        inner_arriving = {b for a, b in zip(eqn.invars, body.invars) if not is_literal(a) and a in region_ins}
        return _is_linear(inner, body.eqns, inner_producer, set(range(len(body.eqns))), scaled, depth + 1,
                          frozenset(inner_arriving))
    return False
