"""Emit the rewritten step: the original equations, with each planned group of region
equations replaced by one `shard_map` over the token axes that binds the same equations
again at one shard's shapes (`shard.ShardBinder`), and each body that holds a region bound
again with its rewritten jaxpr (same primitive, same parameters: a scan keeps its length, a
jit its shardings and donation, a checkpoint its policy). Outside the groups every equation
is the user's, bound as it was traced at global shapes.

Inputs and outputs that carry tokens keep their sharding through the group boundary;
per-shard values that another group needs (group sizes, say) travel stacked along a
leading shard axis; values that leave the region for the rest of the program (weight
gradients) are sums over tokens and are `psum`med across the token axes, at the line of
the equation that made them; token-sized constants are rebuilt inside the shard.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from ... import _jax
from ..plan import Group, Level, Plan
from ...jaxpr import bind_eqn, bind_with, is_literal, read


def emit(plan: Plan, mesh):
    """A function of the step's flattened arguments returning its flattened outputs."""
    return _Emitter(plan, mesh).level_fn(plan.top)


class _Emitter:
    def __init__(self, plan: Plan, mesh):
        self.plan, self.mesh = plan, mesh
        self.token_axes = plan.axes.all
        self.shards = math.prod(mesh.shape[a] for a in self.token_axes)
        axes = self.token_axes
        self.stacked_spec = P(axes if len(axes) > 1 else axes[0])

    def level_fn(self, level: Level):
        jaxpr = level.jaxpr
        eqns = jaxpr.eqns
        at_last = {grp.eqns[-1]: grp for grp in level.groups}
        in_group = {i for grp in level.groups for i in grp.eqns}

        def run(*invals):
            env: dict = dict(zip(jaxpr.constvars, level.consts))   # global values
            stacked: dict = {}   # per-shard values stacked along a leading shard axis
            for v, x in zip(jaxpr.invars, invals):
                (stacked if v in level.stacked_in else env)[v] = x
            pending = [i for i in range(len(eqns)) if i not in in_group or i in at_last]
            while pending:
                k = next((k for k, i in enumerate(pending)
                          if self._ready(i, at_last, eqns, env, stacked)), None)
                if k is None:
                    raise AssertionError("rewrite schedule has a cycle")  # groups are convex
                i = pending.pop(k)
                if i in at_last:
                    self._group(at_last[i], level, env, stacked)
                elif i in level.subs:
                    self._sub(eqns[i], level.subs[i], env, stacked)
                else:
                    eqn = eqns[i]
                    env.update(zip(eqn.outvars, bind_eqn(eqn, [read(env, a) for a in eqn.invars])))
            return [stacked[v] if k in level.stacked_out else read(env, v)
                    for k, v in enumerate(jaxpr.outvars)]

        return run

    @staticmethod
    def _ready(i, at_last, eqns, env, stacked) -> bool:
        atoms = at_last[i].inputs if i in at_last else eqns[i].invars
        return all(a in env or a in stacked for a in atoms if not hasattr(a, "val"))

    def _sub(self, eqn, inner: Level, env, stacked) -> None:
        # A body's operand may be a literal (a constant JAX folded in: unhashable).
        invals = [stacked[a] if not is_literal(a) and a in stacked else read(env, a) for a in eqn.invars]
        avals = [self._aval(v, v in inner.stacked_in) for v in inner.jaxpr.invars]
        new_inner = jax.make_jaxpr(self.level_fn(inner))(*avals)
        outs = bind_with(eqn, new_inner, invals)
        for k, (v, x) in enumerate(zip(eqn.outvars, outs)):
            (stacked if k in inner.stacked_out else env)[v] = x

    def _aval(self, var, stacked: bool):
        """A body input's abstract value: its global one, or, arriving stacked, one shard's
        value per shard (a shard's shape: a per-shard capacity's slots have no global form)."""
        shape = ((self.shards,) + tuple(self.plan.traces.local.shapes.get(var, var.aval.shape))
                 if stacked else var.aval.shape)
        return _jax.struct_of(var.aval, shape)

    def _group(self, grp: Group, level: Level, env, stacked) -> None:
        plan, token_axes = self.plan, self.token_axes
        eqns = level.jaxpr.eqns
        producer = {v: eqns[i] for i in grp.eqns for v in eqns[i].outvars}
        passed = [v for v in grp.inputs if v not in level.built]
        # A value sized by one shard's capacity carries tokens too, but has no global form:
        # it travels stacked (`Group.stacked`), never sharded.
        sharded_out = [v for v in grp.outputs if v in plan.specs and v not in grp.stacked]
        summed_out = [v for v in grp.outputs if v in grp.summed]
        stacked_out = [v for v in grp.outputs if v in grp.stacked]
        in_specs = tuple(self.stacked_spec if v in stacked else plan.specs.get(v, P()) for v in passed)
        out_specs = tuple([plan.specs[v] for v in sharded_out] + [P()] * len(summed_out)
                          + [self.stacked_spec] * len(stacked_out))
        arrives_stacked = [v in stacked for v in passed]

        def body(*local_inputs):
            local: dict = {}     # the shard's values, by the step's Vars
            memo: dict = {}
            for v, value, is_stacked in zip(passed, local_inputs, arrives_stacked):
                local[v] = value[0] if is_stacked else value
            for v in grp.inputs:
                if v in level.built:
                    local[v] = level.built[v](memo)
            for i in grp.eqns:
                eqn = eqns[i]
                invals = [plan.binder.operand(eqn, k, a, None if is_literal(a) else local[a])
                          for k, a in enumerate(eqn.invars)]
                local.update(zip(eqn.outvars, plan.binder.bind(eqn, invals)))
            return (tuple(local[v] for v in sharded_out)
                    + tuple(_summed(local[v], token_axes, producer[v]) for v in summed_out)
                    + tuple(local[v][None] for v in stacked_out))

        # Manual over the token axes only: expert or tensor sharding of the weights stays
        # XLA's to propagate. Size-1 axes are manual too (JAX counts them as referenced).
        manual = set(token_axes) | {a for a, n in self.mesh.shape.items() if n == 1}
        mapped = _jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                                axis_names=manual, checked=False)
        # What JAX makes for the call itself (its transpose's ops in the backward) points at
        # the user's line where the region starts, not at this module.
        with _jax.as_traced(eqns[grp.eqns[0]], its_mesh=False):
            results = mapped(*[stacked[v] if v in stacked else env[v] for v in passed])
        n1, n2 = len(sharded_out), len(sharded_out) + len(summed_out)
        env.update(zip(sharded_out, results[:n1]))
        env.update(zip(summed_out, results[n1:n2]))
        stacked.update(zip(stacked_out, results[n2:]))


def _summed(value, token_axes, eqn):
    """A shard's part of a sum over tokens, summed across the shards; the psum points at
    the line of the equation that made it (the user's, not this module's)."""
    with _jax.as_traced(eqn, its_mesh=False):
        return jax.lax.psum(value, token_axes)
