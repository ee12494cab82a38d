"""Find the routed-expert regions of a traced step and plan them as per-shard computations.

The step is traced three times: at its global shapes, at one shard's shapes (batch and
sequence divided by their mesh degrees), and with only the sequence divided. The traces
have the same equations (the user's code runs the same way at any size); a dimension
that shrinks is a token dimension, and by how much says which mesh axes shard it. The
per-shard trace supplies every shape parameter (iota sizes, zeros, reshapes) of the
region's equations at local size, so nothing has to guess which sizes are token counts.

A region starts at a reshape that merges a sequence-sharded dimension into tokens, grows
forward through everything that carries those tokens (and the per-shard values derived
from them that feed back into tokens, like group sizes), and ends where tokens are
reshaped back to `(batch, seq, ...)` or reduced away. Region equations are split into
groups that can each run as one `shard_map` (the forward and the backward of a layer
are separate groups: the loss lies between them).
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from .._errors import RewriteError
from ..analyzer._detect import reshape_groups
from ..analyzer._patterns import is_grouped_matmul_eqn

# Producers whose non-token result is a sum over tokens: psum across shards restores it.
_TOKEN_REDUCTIONS = {"reduce_sum", "dot_general", "ragged_dot_general", "scatter-add", "scatter_add"}
# Linear in a single region operand (the other operands are the same on every shard).
_LINEAR_UNARY = {"neg", "convert_element_type", "reshape", "transpose", "broadcast_in_dim",
                 "squeeze", "expand_dims", "copy", "copy_p", "reduce_sum", "mul", "dot_general"}
_LINEAR_SUMS = {"add", "add_any", "sub"}


@dataclasses.dataclass(frozen=True)
class TokenAxes:
    batch: tuple[str, ...]
    seq: tuple[str, ...]


@dataclasses.dataclass
class Group:
    eqns: list[int]                       # indices into the jaxpr's equations, in order
    inputs: list = dataclasses.field(default_factory=list)        # global Vars read
    outputs: list = dataclasses.field(default_factory=list)       # global Vars written for others
    summed: set = dataclasses.field(default_factory=set)          # outputs psum'd for the outside
    stacked: set = dataclasses.field(default_factory=set)         # per-shard values for other groups


@dataclasses.dataclass
class Plan:
    global_jaxpr: object                  # ClosedJaxpr at global shapes
    local_jaxpr: object                   # ClosedJaxpr at one shard's shapes
    axes: TokenAxes
    groups: list[Group]
    specs: dict                           # Var -> PartitionSpec for token-carrying values
    local_of: dict                        # global Var -> local Var


def plan_regions(global_jaxpr, local_jaxpr, seq_jaxpr, axes: TokenAxes) -> Plan:
    g_eqns, l_eqns = global_jaxpr.jaxpr.eqns, local_jaxpr.jaxpr.eqns
    if [e.primitive.name for e in g_eqns] != [e.primitive.name for e in l_eqns]:
        raise RewriteError("the step traces differently at per-shard shapes (shape-dependent "
                           "Python control flow?); it cannot be rewritten per shard")
    local_of = _pair_vars(global_jaxpr.jaxpr, local_jaxpr.jaxpr)
    seq_of = _pair_vars(global_jaxpr.jaxpr, seq_jaxpr.jaxpr)
    specs: dict = {}
    scaled: set = set()
    doubly_scaled: set = set()   # two dims grow with the token count (e.g. a capacity)
    for var, lvar in local_of.items():
        spec = _spec(var, lvar, seq_of.get(var), axes)
        if spec is None:
            continue
        names = [a for entry in spec for a in entry_axes(entry)]
        if len(names) != len(set(names)):
            doubly_scaled.add(var)
            spec = P(*([None] * len(spec)))
        specs[var] = spec
        scaled.add(var)

    seeds = {i for i, e in enumerate(g_eqns) if _merges_seq(e, specs, axes)}
    exits = {i for i, e in enumerate(g_eqns) if _splits_tokens(e, specs, axes)}
    if not seeds:
        return Plan(global_jaxpr, local_jaxpr, axes, [], specs, local_of)

    consumers = _consumers(g_eqns)
    producer: dict = {}
    for i, e in enumerate(g_eqns):
        for v in e.outvars:
            producer[v] = i
    # Grow to a fixpoint: an equation joins when it reads tokens from the region, or reads
    # a per-shard value (group sizes, offsets) and feeds back into the region.
    region: set[int] = set(seeds)
    changed = True
    while changed:
        changed = False
        reaches = _reaches(g_eqns, consumers, region)
        for i, e in enumerate(g_eqns):
            if i in region:
                continue
            for v in _vars(e.invars):
                p = producer.get(v)
                if p is None or p not in region:
                    continue
                carries_tokens = v in scaled and p not in exits
                if carries_tokens or (v not in scaled and i in reaches):
                    region.add(i)
                    changed = True
                    break
    _pull_in_constants(g_eqns, region, scaled, producer)
    region = _routed_only(g_eqns, region, producer)
    if not region:
        return Plan(global_jaxpr, local_jaxpr, axes, [], specs, local_of)
    _refuse_token_coupling(g_eqns, region, specs)
    for i in sorted(region):
        for v in g_eqns[i].outvars:
            if v in doubly_scaled:
                raise RewriteError(
                    f"{v.aval.str_short()}{_user_line(g_eqns[i])} has a second dimension that grows "
                    "with the number of tokens (a capacity computed from all tokens?): per shard "
                    "it would be smaller and drop different tokens, so this region is left "
                    "alone. Compute capacity per group of tokens, or use a dropless routed MoE")
    groups = _convex_groups(g_eqns, region, producer)
    outvars = set(_vars(global_jaxpr.jaxpr.outvars))
    group_of = {i: gi for gi, grp in enumerate(groups) for i in grp.eqns}
    for gi, grp in enumerate(groups):
        mine = set(grp.eqns)
        produced = {v for i in grp.eqns for v in g_eqns[i].outvars}
        seen_in: set = set()
        for i in grp.eqns:
            for v in _vars(g_eqns[i].invars):
                if v not in produced and v not in seen_in:
                    seen_in.add(v)
                    grp.inputs.append(v)
        for i in grp.eqns:
            for v in g_eqns[i].outvars:
                users = [c for c in consumers.get(v, ()) if c not in mine]
                if not users and v not in outvars:
                    continue
                grp.outputs.append(v)
                outside = v in outvars or any(c not in group_of for c in users)
                elsewhere = any(c in group_of for c in users)
                if v in scaled:
                    if outside and i not in exits:
                        raise RewriteError(
                            f"a token-flattened value ({v.aval.str_short()}) leaves the routed "
                            "region without being reshaped back to (batch, seq, ...); "
                            "computing it per shard would change its order")
                    continue
                if outside:
                    _require_linear(v, g_eqns, l_eqns, producer, mine, scaled)
                    grp.summed.add(v)
                if elsewhere:
                    grp.stacked.add(v)
    return Plan(global_jaxpr, local_jaxpr, axes, groups, specs, local_of)


def _pair_vars(global_jaxpr, other_jaxpr) -> dict:
    pairs = dict(zip(global_jaxpr.constvars, other_jaxpr.constvars))
    pairs.update(zip(global_jaxpr.invars, other_jaxpr.invars))
    for g, o in zip(global_jaxpr.eqns, other_jaxpr.eqns):
        pairs.update(zip(g.outvars, o.outvars))
    return pairs


def _spec(var, lvar, svar, axes: TokenAxes) -> P | None:
    g_shape = getattr(var.aval, "shape", ())
    l_shape = getattr(lvar.aval, "shape", ())
    if g_shape == l_shape:
        return None
    s_shape = getattr(svar.aval, "shape", g_shape) if svar is not None else g_shape
    entries = []
    for g, l, s in zip(g_shape, l_shape, s_shape):
        if g == l:
            entries.append(None)
            continue
        by_seq = g != s
        by_batch = s != l
        names = (axes.batch if by_batch else ()) + (axes.seq if by_seq else ())
        entries.append(names if len(names) > 1 else names[0] if names else None)
    return P(*entries)


def entry_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _merges_seq(eqn, specs, axes: TokenAxes) -> bool:
    """A reshape folding a sequence-sharded dim together with another into one dim."""
    if eqn.primitive.name != "reshape" or not eqn.invars or eqn.invars[0] not in specs:
        return False
    src = specs[eqn.invars[0]]
    shape_in, shape_out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    for ins, outs in reshape_groups(shape_in, shape_out):
        if len(ins) > 1 and len(outs) == 1 and any(
                set(axes.seq) & set(entry_axes(src[d])) for d in ins if d < len(src)):
            return True
    return False


def _splits_tokens(eqn, specs, axes: TokenAxes) -> bool:
    """A reshape unfolding tokens back into separate (batch, seq) dims."""
    if eqn.primitive.name != "reshape" or eqn.outvars[0] not in specs:
        return False
    out = specs[eqn.outvars[0]]
    shape_in, shape_out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    for ins, outs in reshape_groups(shape_in, shape_out):
        if len(ins) == 1 and len(outs) > 1 and any(
                set(axes.seq) & set(entry_axes(out[d])) for d in outs if d < len(out)):
            return True
    return False


def _vars(atoms):
    return [a for a in atoms if not hasattr(a, "val")]  # Literals carry .val


def _consumers(eqns) -> dict:
    users: dict = {}
    for i, e in enumerate(eqns):
        for v in _vars(e.invars):
            users.setdefault(v, []).append(i)
    return users


def _reaches(eqns, consumers, targets: set[int]) -> set[int]:
    """Equations with a dataflow path into `targets` (computed backwards)."""
    reaches: set[int] = set()
    for i in range(len(eqns) - 1, -1, -1):
        for v in eqns[i].outvars:
            if any(c in targets or c in reaches for c in consumers.get(v, ())):
                reaches.add(i)
                break
    return reaches


def _pull_in_constants(eqns, region, scaled, producer) -> None:
    """Token-sized values built from nothing (iota, zeros, `arange(T) // K`) join the
    region with everything they are built from, so they are rebuilt at local size."""
    memo: dict[int, bool] = {}

    def buildable(p: int) -> bool:
        if p not in memo:
            memo[p] = False  # cycles cannot occur in a jaxpr; this guards the recursion
            memo[p] = all(u not in scaled or producer.get(u) in region
                          or (producer.get(u) is not None and buildable(producer[u]))
                          for u in _vars(eqns[p].invars))
        return memo[p]

    def pull(p: int) -> None:
        if p in region:
            return
        region.add(p)
        for u in _vars(eqns[p].invars):
            if u in scaled and producer.get(u) is not None:
                pull(producer[u])

    for i in sorted(region):
        for v in _vars(eqns[i].invars):
            p = producer.get(v)
            if p is not None and p not in region and v in scaled and buildable(p):
                pull(p)


_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}


def _refuse_token_coupling(eqns, region, specs) -> None:
    """A running total over tokens (capacity positions) differs per shard: refuse."""
    for i in sorted(region):
        eqn = eqns[i]
        name = eqn.primitive.name
        operands = _vars(eqn.invars[:1])
        spec = specs.get(operands[0]) if operands else None
        if spec is None:
            continue
        if name in _CUMULATIVE:
            coupled = [eqn.params.get("axis", 0)]
        elif name == "reduce_window_sum" or name.startswith("reduce_window"):
            coupled = [d for d, w in enumerate(eqn.params.get("window_dimensions", ())) if w > 1]
        else:
            continue
        if any(d < len(spec) and spec[d] is not None for d in coupled):
            frame = _user_line(eqn)
            raise RewriteError(
                f"{name} over the token dimension{frame} couples all tokens (a capacity or "
                "position computed globally): per shard it would give different numbers, so "
                "this region is left alone. Compute capacity per group of tokens (per shard) "
                "or use a dropless routed MoE")


def _user_line(eqn) -> str:
    from jax._src import source_info_util

    frame = source_info_util.user_frame(eqn.source_info.traceback) if eqn.source_info.traceback else None
    return f" at {frame.file_name}:{frame.start_line}" if frame else ""


def _convex_groups(eqns, region, producer) -> list[Group]:
    """Split region equations so no group depends on itself through outside equations."""
    groups: list[Group] = []
    taint: dict = {}          # Var -> groups it depends on through an outside equation
    group_of_var: dict = {}
    current: Group | None = None
    for i, e in enumerate(eqns):
        ins = _vars(e.invars)
        through = set().union(*(taint.get(v, set()) for v in ins)) if ins else set()
        if i in region:
            if current is None or id(current) in through:
                current = Group([])
                groups.append(current)
            current.eqns.append(i)
            for v in e.outvars:
                taint[v] = through
                group_of_var[v] = id(current)
        else:
            for v in ins:
                if v in group_of_var:
                    through = through | {group_of_var[v]}
            for v in e.outvars:
                taint[v] = through
    return groups


def _require_linear(var, eqns, l_eqns, producer, mine, scaled) -> None:
    if _is_linear(var, eqns, l_eqns, producer, mine, scaled, depth=0):
        return
    p = producer.get(var)
    name = eqns[p].primitive.name if p is not None else "?"
    raise RewriteError(
        f"the routed region produces {var.aval.str_short()} (by {name}) that is used outside it "
        "and is not a plain sum over tokens, so a per-shard result cannot be combined exactly "
        "(e.g. a global capacity or a statistic that couples all tokens); compute it outside "
        "the layer or per group, then rewrite")


def _is_linear(var, eqns, l_eqns, producer, mine, scaled, depth) -> bool:
    p = producer.get(var)
    if p is None or p not in mine or depth > 16:
        return False
    eqn = eqns[p]
    if _literals(eqn) != _literals(l_eqns[p]):
        return False  # a constant from the token count (a mean's 1/T): per shard it is wrong
    name = eqn.primitive.name
    ins = _vars(eqn.invars)
    region_ins = [v for v in ins if producer.get(v) in mine]
    if name in _TOKEN_REDUCTIONS and any(v in scaled for v in region_ins):
        return True
    if name in _LINEAR_SUMS:
        return len(region_ins) == len(ins) and all(
            _is_linear(v, eqns, l_eqns, producer, mine, scaled, depth + 1) for v in region_ins)
    if name in _LINEAR_UNARY and len(region_ins) == 1:
        return _is_linear(region_ins[0], eqns, l_eqns, producer, mine, scaled, depth + 1)
    if name == "div" and region_ins == ins[:1]:
        return _is_linear(region_ins[0], eqns, l_eqns, producer, mine, scaled, depth + 1)
    return False


def _literals(eqn) -> list:
    return [repr(getattr(a, "val", None)) for a in eqn.invars if hasattr(a, "val")]


def _routed_only(eqns, region: set[int], producer) -> set[int]:
    """The connected parts of the region that hold a grouped matmul (a routed-expert
    region); other token flattens (a cross-entropy over flattened tokens) stay as they are."""
    parent = {i: i for i in region}

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in region:
        for v in _vars(eqns[i].invars):
            p = producer.get(v)
            if p in region:
                parent[find(i)] = find(p)
    routed = {find(i) for i in region if is_grouped_matmul_eqn(eqns[i])
              or _expert_batched(eqns[i], producer)}
    return {i for i in region if find(i) in routed}


def _expert_batched(eqn, producer) -> bool:
    """A dispatch einsum: dot_general batched over the leading (expert) dim of a rank-3
    weight that is an argument of the step."""
    if eqn.primitive.name != "dot_general":
        return False
    (_, _), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    for operand, batch in zip(eqn.invars, (lhs_batch, rhs_batch)):
        if (not hasattr(operand, "val") and producer.get(operand) is None
                and len(getattr(operand.aval, "shape", ())) == 3 and 0 in tuple(batch)):
            return True
    return False
