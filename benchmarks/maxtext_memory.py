"""Why raising MaxText's context degree saves no memory, and what the rewrite gives back.

MaxText's real training step (`shardlint.integrations.maxtext:make_step`), mixtral-style,
at `ici_context_parallelism` N with `ici_fsdp_parallelism=-1` filling the other devices:
each device holds as many tokens at every N, so the right temp is flat (the ideal). For
each MoE path (the dense capacity path, `capacity_factor=1.25`, rewritten with per-shard
capacity; the dense dropless path; the sparse path, which MaxText already flattens per
shard) this prints, per N: temp per device before and after `shardlint.rewrite`, the ideal,
the share of the last point's temp above its ideal that the lines shardlint names account
for, and the analysis time per point (make the step, analyze). Then each path's headline.

Two platforms: 8 simulated CPU devices (float32, seq 2048, emb 128, mlp 256, 8 experts,
top-2, dot-product attention: the sizes of issue 33), and with `--topology v5p:2x2x2` the
TPU compiler through libtpu, ahead of time, with MaxText's flash attention (its Pallas
splash kernel; `--attention dot_product` for the CPU rows' attention, whose scores then
hold most of the peak) (bf16, seq 8192, emb 1024, mlp 1024, 16 experts, top-2; with 64
experts top-8 the capacity path does not fit a v5p chip at context 8: 134 GB of
temporaries). TPU devices only compile: the rewrite is not verified by running it there.

    pip install 'shardlint[maxtext]'          # Python 3.12+; add [tpu] for --topology
    python benchmarks/maxtext_memory.py [--paths capacity,dropless,sparse] [--context 1,2,4,8]
    python benchmarks/maxtext_memory.py --topology v5p:2x2x2
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

if "--topology" not in sys.argv:   # before JAX starts its backend
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

MIXTRAL = dict(decoder_block="mixtral", base_num_decoder_layers=2, num_experts=8, num_experts_per_tok=2,
               base_num_query_heads=4, base_num_kv_heads=4, head_dim=32, vocab_size=256,
               per_device_batch_size=1, scan_layers=False,
               ici_fsdp_parallelism=-1)
CPU = dict(base_emb_dim=128, base_mlp_dim=256, base_moe_mlp_dim=256, max_target_length=2048,
           dtype="float32", weight_dtype="float32")
TPU = dict(base_emb_dim=1024, base_mlp_dim=1024, base_moe_mlp_dim=1024, max_target_length=8192,
           num_experts=16, num_experts_per_tok=2, base_num_query_heads=8, base_num_kv_heads=8,
           head_dim=128, dtype="bfloat16", weight_dtype="bfloat16")
PATHS = {"capacity": dict(sparse_matmul=False, capacity_factor=1.25),
         "dropless": dict(sparse_matmul=False, capacity_factor=-1),
         "sparse": dict(sparse_matmul=True, capacity_factor=-1)}
MIB = 2 ** 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", help="compile for this TPU topology with libtpu (e.g. v5p:2x2x2)")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--context", default="1,2,4,8", help="context degrees, comma-separated")
    parser.add_argument("--attention", default=None,
                        help="MaxText's attention (default: dot_product on CPU, flash, its Pallas "
                             "splash kernel, on a TPU topology)")
    args = parser.parse_args(argv)
    try:
        import maxtext  # noqa: F401
    except ImportError:
        print("skip: MaxText is not installed (pip install 'shardlint[maxtext]', Python 3.12+)")
        return 0

    import jax

    import shardlint
    from shardlint.analyzer.compile._compile import mesh_of
    from shardlint.analyzer.memory._scaling import memory_scaling
    from shardlint.integrations.maxtext import make_step

    devices = None
    sizes = CPU
    if args.topology:
        from shardlint.analyzer.compile._topology import topology_devices

        devices = topology_devices(args.topology)
        sizes = TPU   # one sequence per chip (make_step counts the topology's chips), as on CPU
    where = (f"{args.topology} ({len(devices)} chips, the TPU compiler)" if devices
             else f"{len(jax.devices())} simulated CPU devices")
    sizes = dict(sizes, attention=args.attention or ("flash" if devices else "dot_product"))
    values = tuple(int(v) for v in args.context.split(","))
    print(f"MaxText mixtral-style, {sizes['base_emb_dim']} emb, {MIXTRAL['base_num_decoder_layers']} layers, "
          f"{sizes.get('num_experts', MIXTRAL['num_experts'])} experts, seq {sizes['max_target_length']}, "
          f"{sizes['dtype']}, {sizes['attention']} attention; {where}; context N x fsdp filling the rest; "
          f"temp per device, MiB")
    for path in args.paths.split(","):
        befores, afters, seconds = [], [], []
        for n in values:
            start = time.perf_counter()
            fn, step_args = make_step(devices=devices, **{**MIXTRAL, **sizes, **PATHS[path]},
                                      ici_context_parallelism=n)
            before = shardlint.analyze(fn, *step_args)
            seconds.append(time.perf_counter() - start)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", shardlint.NothingToRewrite)
                fixed = shardlint.rewrite(fn, mesh_of(step_args), args=step_args, analysis=before,
                                          capacity="per-shard" if path == "capacity" else "global")
            befores.append(before)
            afters.append(shardlint.analyze(fixed, *step_args))
        scaled = memory_scaling("ici_context_parallelism", values, befores)
        fixed_scaled = memory_scaling("ici_context_parallelism", values, afters)
        print(f"\n{path} path")
        print(f"{'N':>3} {'temp':>9} {'ideal':>9} {'x ideal':>8} {'rewritten':>10} {'x ideal':>8} {'analysis s':>11}")
        for i, n in enumerate(values):
            print(f"{n:>3} {scaled.temp[i] / MIB:9.1f} {scaled.ideal[i] / MIB:9.1f} "
                  f"{scaled.temp[i] / scaled.ideal[i]:8.2f} {fixed_scaled.temp[i] / MIB:10.1f} "
                  f"{fixed_scaled.temp[i] / fixed_scaled.ideal[i]:8.2f} {seconds[i]:11.1f}")
        print(f"    {scaled.headline()}")
        if scaled.listed:
            held = sum(line.excess for line in scaled.lines[:scaled.listed])
            print(f"    the {scaled.listed} named line(s) hold {held / MIB:.1f} MiB above their ideal: "
                  f"{scaled.above_ideal_explained:.0%} of the {scaled.excess / MIB:.1f} MiB above the step's "
                  f"ideal (lines under their ideal offset {scaled.offset / MIB:.1f} MiB)")
        print(f"    rewritten: {fixed_scaled.headline()}; last / first point "
              f"{fixed_scaled.temp[-1] / fixed_scaled.temp[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
