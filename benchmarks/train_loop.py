"""A training loop of the original step and of the rewritten one, per rewrite route.

Each route's step runs --steps times as a training loop runs it (the parameters each step
returns, or its gradients applied by SGD, fed to the next; `nnx.jit` updating its model and
optimizer in place), the original and the rewritten step in one process. Printed per route:
the median step time of each (the first call, which compiles, left out), their ratio, and
the XLA compiles JAX reported during the calls after the first (a rewritten step must
dispatch as a cached `jax.jit`: 0).

Routes: `swap` (the built-in decoder, RoutedMoE swapped for ShardedRoutedMoE), `jaxpr` (a
plain function: lax.scan over remat'd routed-MoE layers), `pre-jitted` (a `jax.jit` step
with shardings and donation), `nnx` (`nnx.jit` with `nnx.Optimizer`; needs flax and optax).
The last three are the test suite's steps (tests/support/cause_steps.py).

By default the mesh is data=2 x context=4 of 8 simulated CPU devices and each step is
rewritten where the analysis finds the sequence sharding lost. With --accelerator the mesh
is every local chip along `context` (one chip: 1x1), and the token axes are named (data, context) so
the regions run per shard even where nothing is lost: the ratio is then what the rewritten
structure and its dispatch cost.

    python benchmarks/train_loop.py [--steps 20] [--routes swap,jaxpr,pre-jitted,nnx] [--accelerator]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]  # run from a checkout; the tests' steps

if "--accelerator" not in sys.argv:  # set before JAX starts a backend
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")

import shardlint  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from shardlint._wrapped import as_jitted  # noqa: E402
from shardlint.examples import decoder  # noqa: E402
from shardlint.rewrites._verify import random_like  # noqa: E402

from support import cause_steps  # noqa: E402

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"   # jax._src.dispatch
_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _compiles.append(event) if event == _COMPILE_EVENT else None)

_sgd = jax.jit(lambda params, grads: jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))


def _mesh():
    if jax.default_backend() == "cpu":
        return jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    n = jax.device_count()
    return jax.make_mesh((1, n), ("data", "context"), axis_types=(AxisType.Auto,) * 2)


def _loop(step, params, batch, kind: str, steps: int) -> tuple[list[float], int]:
    """Step times (s) and the compiles after the first call."""
    times, compiles = [], 0
    for i in range(steps):
        before = len(_compiles)
        start = time.perf_counter()
        out = jax.block_until_ready(step(params, *batch) if kind != "nnx" else step(*params, *batch))
        times.append(time.perf_counter() - start)
        compiles += (len(_compiles) - before) if i else 0
        if kind == "grads":
            params = _sgd(params, out[1])
        elif kind == "params":
            params = out[0]
    return times, compiles


def _route(name: str, mesh):
    """(original step, args, how its loop feeds back: grads / params / nnx)."""
    if name == "swap":
        return (*decoder.make_step(mesh), "grads")
    if name == "jaxpr":
        return (*cause_steps.make_scanned_layers_step(mesh), "grads")
    if name == "pre-jitted":
        return (*cause_steps.make_prejitted_step(mesh), "params")
    if name == "nnx":
        step, (model, optimizer, x) = cause_steps.make_nnx_step(mesh, concrete=True)
        return step, (model, optimizer, x), "nnx"
    raise SystemExit(f"unknown route {name!r}: choose from swap, jaxpr, pre-jitted, nnx")


def _inputs(args, kind: str):
    """Fresh inputs of `args`' shapes: (params, batch) as the loop takes them."""
    if kind == "nnx":
        from flax import nnx

        model, optimizer, x = args
        return (nnx.clone(model), nnx.clone(optimizer)), random_like((x,))
    params, *batch = random_like(args)
    return params, batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--routes", default="swap,jaxpr,pre-jitted,nnx")
    parser.add_argument("--accelerator", action="store_true",
                        help="run on the default backend's chips (else 8 simulated CPU devices)")
    opts = parser.parse_args()
    mesh = _mesh()
    axes = {} if jax.default_backend() == "cpu" else {"batch_axes": ("data",), "seq_axes": ("context",)}
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} x{jax.device_count()}, mesh "
          f"{dict(mesh.shape)}; {opts.steps} steps per loop, median of the last {opts.steps - 1}")
    print(f"{'route':<12} {'original ms':>12} {'rewritten ms':>13} {'ratio':>6} "
          f"{'compiles after 1st (orig / rewritten)':>38}")
    worst = 0.0
    for name in opts.routes.split(","):
        if name == "nnx":
            try:
                import flax  # noqa: F401
                import optax  # noqa: F401
            except ImportError:
                print(f"{name:<12} skipped: flax and optax are not installed")
                continue
        step, args, kind = _route(name, mesh)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", shardlint.NothingToRewrite)
            fixed = shardlint.rewrite(step, mesh, args=args, **axes)
        original = step if kind == "nnx" else as_jitted(step)
        (t_orig, c_orig), (t_new, c_new) = (_loop(s, *_inputs(args, kind), kind, opts.steps)
                                            for s in (original, fixed))
        m_orig, m_new = statistics.median(t_orig[1:]), statistics.median(t_new[1:])
        worst = max(worst, m_new / m_orig)
        changed = "" if fixed.changed else "  (nothing rewritten)"
        print(f"{name:<12} {m_orig * 1e3:12.2f} {m_new * 1e3:13.2f} {m_new / m_orig:6.2f} "
              f"{c_orig:>19} / {c_new}{changed}")
    print(f"goal rewritten / original <= 1.1: {'PASS' if worst <= 1.1 else 'FAIL'} (worst {worst:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
