"""ShardedRoutedMoE's Pallas path inside its shard_map on a one-chip mesh, against the XLA
path, on a TPU: the chip's part of issue 43 (the multi-device part runs on 8 simulated CPU
devices, tests/moe/test_sharded_pallas.py).

    python tests/tpu/moe_pallas_one_chip.py            # on a TPU host; exit 1 on a FAIL

bf16, the layer's output and every gradient (router, wi_0, wi_1, wo, x) with the kernel
the layer picks on a TPU (`grouped_kernel("auto")`: the Pallas kernels) and with
`ragged_dot` (`"xla"`), held to the bf16 tolerance of `tests/moe/pallas_paths.py`, for:

  - tokens over no mesh axis (what benchmarks/tpu_moe.py times): nothing varies;
  - tokens over data x context, both of size 1: inside shard_map the rows, the weights and
    every kernel operand vary over both axes, as on a multi-chip mesh (the varying-axes
    casts, the custom VJPs' types, the kernels' declared output types);
  - the same with the expert weights over an expert axis of size 1 (its psum).

Per case: the Pallas kernels in the traced program (none on the XLA path) and, on a TPU,
shardlint's Mosaic kernels in the compiled one, a line per leaf (max |diff|, max |value|,
tolerance), and PASS or FAIL. Without a TPU it prints one skip line and exits 0.
`--interpret` runs it on any backend in Pallas interpret mode at small sizes
(tests/tpu/test_moe_pallas_one_chip.py does, on the CPU); `--topology v5e:1x1` compiles
the programs for that TPU with libtpu instead of running them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

_ROOT = Path(__file__).resolve().parents[2]
for _path in (_ROOT, _ROOT / "tests" / "moe"):   # run from a checkout, outside pytest too
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import pallas_paths  # noqa: E402
from shardlint import moe  # noqa: E402

DP_CP = ("data", "context")
CASES = {
    # name: (mesh axis names, ShardedRoutedMoE keywords)
    "tokens over no axis": (DP_CP, {"batch_axes": (), "seq_axes": ()}),
    "tokens over data x context": (DP_CP, {"batch_axes": "data", "seq_axes": "context"}),
    "experts over an expert axis": (DP_CP + ("expert",),
                                    {"batch_axes": "data", "seq_axes": "context",
                                     "expert_axis": "expert"}),
}
KERNELS = 10   # 2 grouped-matmul kernels and 1 gather forward; 5, 1 gather and 1 dot backward


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch: int = 2
    seq: int = 1024
    emb: int = 512     # D and F tile by 128: the compiled kernels' condition
    mlp: int = 256
    experts: int = 16
    top_k: int = 4


SMALL = Sizes(batch=2, seq=16, emb=16, mlp=32, experts=8, top_k=2)   # interpret mode


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layer: moe.ShardedRoutedMoE
    args: tuple[Any, Any, Any]   # params, x, cotangent r: arrays or ShapeDtypeStructs


def cases(sizes: Sizes, devices: list, shapes: dict[str, tuple[int, ...]] | None = None, *,
          abstract: bool = False, names: tuple[str, ...] | None = None,
          **layer_kw: Any) -> Iterator[Case]:
    """The cases `names` (all by default), each layer on a mesh of `shapes[name]` (every
    axis of size 1 by default) over the first `devices`, with `layer_kw` (else the
    layer's default weight layout), its params in the layer's layout and x, r over its
    token axes, bf16: arrays, or ShapeDtypeStructs when `abstract` (compile-only
    devices)."""
    cfg = moe.MoeConfig(num_experts=sizes.experts, top_k=sizes.top_k, emb_dim=sizes.emb,
                        mlp_dim=sizes.mlp, dtype=jnp.bfloat16)
    for name in names or CASES:
        axes, kw = CASES[name]
        dims = (shapes or {}).get(name, (1,) * len(axes))
        mesh = jax.make_mesh(dims, axes, axis_types=(AxisType.Auto,) * len(axes),
                             devices=devices[:math.prod(dims)])
        layer = moe.ShardedRoutedMoE(cfg, mesh, **kw, **layer_kw)
        x_sharding = NamedSharding(mesh, P(layer.batch_axes, layer.seq_axes))
        x_shape = (sizes.batch, sizes.seq, sizes.emb)
        if abstract:
            params = jax.tree.map(
                lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                jax.eval_shape(layer.init, jax.random.key(0)), layer.param_shardings())
            x = r = jax.ShapeDtypeStruct(x_shape, cfg.dtype, sharding=x_sharding)
        else:
            params = jax.device_put(layer.init(jax.random.key(0)), layer.param_shardings())
            x, r = (jax.device_put(jax.random.normal(k, x_shape, cfg.dtype), x_sharding)
                    for k in jax.random.split(jax.random.key(1)))
        yield Case(name, layer, (params, x, r))


def traced_kernels(case: Case, kernel: str) -> int:
    """The Pallas kernels in the case's traced VJP on `kernel`: pallas_calls, and the host
    callbacks that run one on each device's values in interpret mode."""
    jaxpr = jax.make_jaxpr(pallas_paths.traced_step(case.layer, kernel))(*case.args).jaxpr
    return sum(len(pallas_paths.equations(jaxpr, p)) for p in ("pallas_call", "pure_callback"))


def mosaic_kernels(case: Case, kernel: str, vmem_limit: int | None = None) -> int:
    """shardlint's Mosaic kernels (`tpu_custom_call`s named shardlint_*) in the case's VJP
    compiled for the TPU (`ragged_dot` compiles to Mosaic kernels of its own there), at
    the VMEM limit `vmem_limit` (None: the plan's)."""
    step = jax.jit(pallas_paths.traced_step(case.layer, kernel, vmem_limit=vmem_limit))
    text = step.lower(*case.args).compile().as_text()
    return sum('custom_call_target="tpu_custom_call"' in line and "shardlint_" in line
               for line in text.splitlines())


def compile_only(topology: str, shapes: dict[str, tuple[int, ...]] | None = None,
                 names: tuple[str, ...] | None = None, sizes: Sizes = Sizes(),
                 vmem_limit: int | None = None, **layer_kw: Any) -> list[str]:
    """The names of the cases that failed (none: all passed), compiled with libtpu for
    `topology` (no chip needed; the rest as for `cases`) at the VMEM limit `vmem_limit`
    (None: the plan's without a TPU, `_plan.VMEM_LIMIT`): the Pallas path forced
    ("pallas": "auto" chooses by the backend, here the CPU) holds the Mosaic kernels, the
    XLA path none."""
    from shardlint.analyzer.compile._topology import topology_devices

    fails = []
    for case in cases(sizes, topology_devices(topology), shapes, abstract=True,
                      names=names, **layer_kw):
        compiled = mosaic_kernels(case, "pallas", vmem_limit)
        ok = compiled == KERNELS and traced_kernels(case, "xla") == 0
        print(f"{'PASS' if ok else 'FAIL'}: {case.name} on {topology} "
              f"{dict(case.layer.mesh.shape)}: {compiled} of shardlint's Mosaic kernels "
              f"compiled on the Pallas path", flush=True)
        fails += [] if ok else [case.name]
    return fails


def check(case: Case, kernel: str, row_tile: int | None, on_tpu: bool) -> bool:
    """Prints the case's kernels and differences, then PASS or FAIL; True if it passed."""
    print(f"\n{case.name}: mesh {dict(case.layer.mesh.shape)}, tokens over "
          f"{case.layer.batch_axes or '-'} x {case.layer.seq_axes or '-'}", flush=True)
    problems = []
    found = traced_kernels(case, kernel), traced_kernels(case, "xla")
    print(f"  Pallas kernels traced: {found[0]} ({kernel}), {found[1]} (xla)")
    if found != (KERNELS, 0):
        problems.append(f"traced kernels {found}, not ({KERNELS}, 0)")
    if on_tpu:
        compiled = mosaic_kernels(case, kernel)
        print(f"  shardlint's Mosaic kernels compiled: {compiled} ({kernel})")
        if compiled != KERNELS:
            problems.append(f"{compiled} Mosaic kernels compiled, not {KERNELS}")
    want = pallas_paths.layer_vjp(case.layer, *case.args, "xla")
    got = pallas_paths.layer_vjp(case.layer, *case.args, kernel, row_tile)
    for path, diff, biggest, atol in pallas_paths.differences(got, want, jnp.bfloat16):
        print(f"  {path:<18} max |diff| {diff:.3e}  max |value| {biggest:.3e}  "
              f"({diff / biggest if biggest else 0.0:.2e} of it)  atol {atol:.3e}")
        if not diff <= atol:
            problems.append(f"{path} differs by {diff:.3e} > {atol:.3e}")
    verdict = "PASS" if not problems else "FAIL"
    print(f"{verdict}: {case.name}: Pallas path == XLA path within bf16 tolerance"
          + (f" ({'; '.join(problems)})" if problems else ""), flush=True)
    return not problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true",
                        help="Pallas interpret mode at small sizes, on any backend")
    parser.add_argument("--topology", help="compile for this TPU topology with libtpu, "
                                           "run nothing (e.g. v5e:1x1)")
    parser.add_argument("--case", action="append", choices=list(CASES),
                        help="only this case (repeatable; default: all)")
    args = parser.parse_args(argv)
    if args.topology:
        return 1 if compile_only(args.topology) else 0
    backend = jax.default_backend()
    if backend != "tpu" and not args.interpret:
        print(f"skip: no TPU (JAX backend is {backend!r}); this check runs "
              f"ShardedRoutedMoE's Pallas path on a TPU chip (--interpret: anywhere)")
        return 0
    kernel, sizes, row_tile = ("interpret", SMALL, 8) if args.interpret else ("auto", Sizes(), None)
    device = jax.devices()[0]
    print(f"{device.device_kind} ({backend}), JAX {jax.__version__}; bf16, {sizes}; "
          f"kernel {kernel!r} against 'xla'")
    passed = [check(case, kernel, row_tile, backend == "tpu")
              for case in cases(sizes, [device], names=args.case)]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
