"""A training job that writes an XLA dump, run in its own process as a user's job runs.

    XLA_FLAGS="--xla_dump_to=DIR ..." python tests/support/dump_job.py STEP AXES [TOPOLOGY]

STEP is `steps.make_<name>` (shardlint/examples/steps.py), `cause_steps.make_<name>`
(tests/support/cause_steps.py) or `signature_steps.<layer>.<signature>`, AXES a mesh such
as data=2,context=4. On CPU the job puts random arrays on the mesh and runs the step
(jitted as the user wrote it, or by `jax.jit`), so the dump holds what a real job compiles,
its small helper modules (device_put, random) included. With a TPU topology (libtpu AOT)
it compiles the step, as nothing can run there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax


def build(step_name: str, axes: dict[str, int], topology: str | None):
    from shardlint.examples import steps
    from support import build_mesh, cause_steps

    if topology:
        from shardlint.analyzer.compile._topology import topology_mesh

        mesh = topology_mesh(axes, topology)
    else:
        mesh = build_mesh(axes)
    module, function, *signature = step_name.split(".")
    if module == "signature_steps":   # signature_steps.LAYER.SIGNATURE
        from support import signature_steps

        return signature_steps.make(function, signature[0], mesh)
    return getattr({"steps": steps, "cause_steps": cause_steps}[module], function)(mesh)


def run(step_name: str, axes: dict[str, int], topology: str | None = None) -> None:
    step, args = build(step_name, axes, topology)
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    if topology:
        jitted.lower(*args).compile()
        return
    # Initialised with jax.random as training code does: small jit modules of its own.
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(args))))
    arrays = jax.tree.map(lambda a: jax.device_put(_random(next(keys), a), a.sharding), args)
    jax.block_until_ready(jitted(*arrays))


def _random(key, a):
    if jax.numpy.issubdtype(a.dtype, jax.numpy.floating):
        return jax.random.normal(key, a.shape, a.dtype)
    return jax.random.randint(key, a.shape, 0, 2).astype(a.dtype)   # ids, or a key's data


if __name__ == "__main__":
    checkout = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(checkout), str(checkout / "tests")]  # its shardlint, and `support`
    name, spec, *rest = sys.argv[1:]
    mesh_axes = {k: int(v) for k, v in (part.split("=") for part in spec.split(","))}
    run(name, mesh_axes, rest[0] if rest else None)
