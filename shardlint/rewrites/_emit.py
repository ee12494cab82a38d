"""Emit the rewritten step: the original equations, with each planned group of region
equations replaced by one `shard_map` over the token axes that replays the same equations
at per-shard shapes.

Inputs and outputs that carry tokens keep their sharding through the group boundary;
per-shard values that another group needs (group sizes, say) travel stacked along a
leading shard axis; values that leave the region for the rest of the program (weight
gradients) are sums over tokens and are `psum`med across the token axes.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from ._regions import Group, Plan
from ._replay import bind_eqn, read


def emit(plan: Plan, mesh):
    """A function of the step's flattened arguments returning its flattened outputs."""
    g_jaxpr = plan.global_jaxpr.jaxpr
    eqns = g_jaxpr.eqns
    at_last_eqn = {grp.eqns[-1]: grp for grp in plan.groups}
    in_group = {i for grp in plan.groups for i in grp.eqns}
    stacked_vars = {v for grp in plan.groups for v in grp.stacked}

    def run(*flat_args):
        env: dict = {}        # global values
        stacked: dict = {}    # per-shard values stacked along a leading shard axis
        env.update(zip(g_jaxpr.constvars, plan.global_jaxpr.consts))
        env.update(zip(g_jaxpr.invars, flat_args))
        pending = [i for i in range(len(eqns)) if i not in in_group or i in at_last_eqn]
        while pending:
            k = next((k for k, i in enumerate(pending)
                      if _ready(i, at_last_eqn, eqns, env, stacked, stacked_vars)), None)
            if k is None:
                raise AssertionError("rewrite schedule has a cycle")  # groups are convex
            i = pending.pop(k)
            if i in at_last_eqn:
                _emit_group(at_last_eqn[i], plan, mesh, env, stacked, stacked_vars)
            else:
                eqn = eqns[i]
                env.update(zip(eqn.outvars, bind_eqn(eqn, [read(env, a) for a in eqn.invars])))
        return [read(env, v) for v in g_jaxpr.outvars]

    return run


def _ready(i, at_last_eqn, eqns, env, stacked, stacked_vars) -> bool:
    if i in at_last_eqn:
        return all((v in stacked) if v in stacked_vars else (v in env) for v in at_last_eqn[i].inputs)
    return all(a in env for a in eqns[i].invars if not hasattr(a, "val"))


def _emit_group(grp: Group, plan: Plan, mesh, env, stacked, stacked_vars) -> None:
    token_axes = plan.axes.batch + plan.axes.seq
    stacked_spec = P(token_axes if len(token_axes) > 1 else token_axes[0])
    l_eqns = plan.local_jaxpr.jaxpr.eqns
    sharded_out = [v for v in grp.outputs if v in plan.specs]
    summed_out = [v for v in grp.outputs if v in grp.summed]
    stacked_out = [v for v in grp.outputs if v in grp.stacked]
    in_specs = tuple(stacked_spec if v in stacked_vars else plan.specs.get(v, P()) for v in grp.inputs)
    out_specs = tuple([plan.specs[v] for v in sharded_out] + [P()] * len(summed_out)
                      + [stacked_spec] * len(stacked_out))

    def body(*local_inputs):
        local: dict = {}
        for v, value in zip(grp.inputs, local_inputs):
            local[plan.local_of[v]] = value[0] if v in stacked_vars else value
        for i in grp.eqns:
            eqn = l_eqns[i]
            local.update(zip(eqn.outvars, bind_eqn(eqn, [read(local, a) for a in eqn.invars], manual=True)))
        return (tuple(local[plan.local_of[v]] for v in sharded_out)
                + tuple(jax.lax.psum(local[plan.local_of[v]], token_axes) for v in summed_out)
                + tuple(local[plan.local_of[v]][None] for v in stacked_out))

    # Manual over the token axes only: expert or tensor sharding of the weights stays
    # XLA's to propagate. Size-1 axes are manual too (JAX counts them as referenced).
    manual = set(token_axes) | {a for a, n in mesh.shape.items() if n == 1}
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                           axis_names=manual, check_vma=False)
    results = mapped(*[stacked[v] if v in stacked_vars else env[v] for v in grp.inputs])
    n1, n2 = len(sharded_out), len(sharded_out) + len(summed_out)
    env.update(zip(sharded_out, results[:n1]))
    env.update(zip(summed_out, results[n1:n2]))
    stacked.update(zip(stacked_out, results[n2:]))
