"""The user's report at the size users train: MaxText's own MoE preset on a v5p pod, as written
and rewritten, against the context degree.

MaxText 0.2.5's `model_name=mixtral-8x7b` preset, unmodified (scanned layers, MaxText's
default remat, bf16, its flash attention on TPU), on MaxText's dense MoE path with a
capacity (`sparse_matmul=false capacity_factor=1.25`), `max_target_length=32768`,
`per_device_batch_size=1`, `ici_context_parallelism` N with FSDP over the other chips
(`ici_fsdp_parallelism=-1`): every chip holds 32768 tokens at every N, so the right temp
and FLOPs per chip are flat. Compiled ahead of time by the TPU compiler for `v5p:4x4x4`
(64 chips; libtpu, no TPU attached). For each N this prints, per chip: temp and FLOPs as
written (or the compiler's refusal: needed > available), the contracted-tokens findings,
then `shardlint.rewrite(..., capacity="per-shard")` (each shard routes its own tokens with
its own capacity): the regions rewritten, temp and FLOPs, each as a ratio to the first N
(the smallest; 1 by default) as written, and what one point took (wall time, this process's peak memory). Each point runs
in a process of its own, so its wall time and peak memory are its own. TPU devices only
compile: the rewrite's numbers are checked on CPU (tests/rewrites/test_per_shard_capacity.py
on the same path in miniature, tests/integrations/test_maxtext_capacity.py on MaxText's layer).

    pip install 'shardlint[maxtext,tpu]'          # Python 3.12+
    python benchmarks/maxtext_real_size.py                       # mixtral-8x7b, N = 1, 4, 8
    python benchmarks/maxtext_real_size.py --model qwen3-30b-a3b --context 1,4
    python benchmarks/maxtext_real_size.py --layers 1            # one decoder layer: ~2 min a point

Context 8 on a 4x4x4 torus splits a physical axis: MaxText wants
`allow_split_physical_axes=true` for it, which is set for N >= 8 only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

GIB = 2 ** 30
CONFIG = dict(sparse_matmul=False, capacity_factor=1.25, max_target_length=32768, per_device_batch_size=1,
              ici_fsdp_parallelism=-1, attention="flash")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mixtral-8x7b", help="a MaxText model_name")
    parser.add_argument("--topology", default="v5p:4x4x4")
    parser.add_argument("--context", default="1,4,8", help="context degrees, comma-separated")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the preset's own)")
    parser.add_argument("--seq", type=int, default=CONFIG["max_target_length"])
    parser.add_argument("--point", type=int, help=argparse.SUPPRESS)   # one point, in this process
    args = parser.parse_args(argv)
    try:
        import maxtext  # noqa: F401
    except ImportError:
        print("skip: MaxText is not installed (pip install 'shardlint[maxtext,tpu]', Python 3.12+)")
        return 0
    if args.point is not None:
        print(json.dumps(_point(args, args.point)))
        return 0
    layers = f"{args.layers} layer(s)" if args.layers else "the preset's layers"
    print(f"MaxText {args.model} ({layers}), dense capacity path (capacity_factor=1.25), seq {args.seq}, "
          f"per_device_batch_size=1, {args.topology}, context N x fsdp (the rest); per chip, "
          f"ratios to the first N as written")
    print(f"{'N':>2}  {'temp as written':>16} {'FLOPs':>9} {'contracted':>10}  "
          f"{'regions':>7} {'temp rewritten':>15} {'x N=1':>6} {'FLOPs':>9} {'x N=1':>6}  "
          f"{'wall s':>6} {'peak GiB':>8}")
    rows = []
    for n in sorted(int(v) for v in args.context.split(",")):
        env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        command = [sys.executable, __file__, "--point", str(n), "--model", args.model,
                   "--topology", args.topology, "--layers", str(args.layers), "--seq", str(args.seq)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            print(f"{n:>2}  failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        row = json.loads(lines[-1])
        rows.append(row)
        print(_line(row, rows[0]), flush=True)
        print(f"    {json.dumps(row)}", flush=True)   # the point's figures, for the docs
    return 0


def _line(row: dict, first: dict) -> str:
    before, after = row["before"], row["after"]
    ref_temp, ref_flops = first["before"]["temp"], first["before"]["flops"]
    if before["refused"]:
        written = f"{'no fit':>7} {before['needed'] / GIB:>5.2f}>{before['available'] / GIB:.2f}"
    else:
        written = f"{before['temp'] / GIB:>10.2f} GiB {before['flops']:>9.3g}"
    if after is None:
        fixed = f"{row['regions']:>7} {'-':>15} {'':>6} {'-':>9} {'':>6}"
    else:
        fixed = (f"{row['regions']:>7} {after['temp'] / GIB:>11.2f} GiB {after['temp'] / ref_temp:>6.2f} "
                 f"{after['flops']:>9.3g} {after['flops'] / ref_flops:>6.2f}")
    return (f"{row['context']:>2}  {written:>26} {before['contracted']:>10}  {fixed}  "
            f"{row['seconds']:>6.0f} {row['peak_rss'] / GIB:>8.2f}")


def _point(args, context: int) -> dict:
    from shardlint.analyzer.compile._compile import mesh_of
    from shardlint.analyzer.compile._topology import topology_devices
    from shardlint.commands._sweep import analyze_pair
    from shardlint.integrations.maxtext import make_step

    start = time.perf_counter()
    config = dict(CONFIG, model_name=args.model, max_target_length=args.seq, ici_context_parallelism=context)
    if args.layers:
        config.update(override_model_config=True, base_num_decoder_layers=args.layers)
    if context >= 8:
        config["allow_split_physical_axes"] = True
    fn, step_args = make_step(devices=topology_devices(args.topology), **config)
    said = []

    def progress(message: str) -> None:
        said.append(message)
        print(message, file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pair = analyze_pair(fn, step_args, mesh_of(step_args), verify=False, capacity="per-shard",
                            progress=progress)
    rewrote = [m.split()[1] for m in said if m.startswith("rewrote ")]   # "rewrote 4 routed region(s) ..."
    regions = int(rewrote[-1]) if rewrote else 0
    return {"context": context, "before": _sizes(pair.before), "after": _sizes(pair.after) if pair.after else None,
            "regions": regions, "note": pair.note(), "seconds": time.perf_counter() - start,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _sizes(analysis) -> dict:
    refused = analysis.does_not_fit
    return {"temp": analysis.memory.temp_bytes, "flops": analysis.memory.flops,
            "contracted": sum(f.kind == "contracted-tokens" for f in analysis.findings),
            "refused": refused is not None,
            "needed": refused.needed_bytes if refused else None,
            "available": refused.available_bytes if refused else None}


if __name__ == "__main__":
    sys.exit(main())
