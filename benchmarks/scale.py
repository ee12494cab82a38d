"""Analysis cost at scale: the decoder example up to 48 layers on 4096 TPU chips.

A user runs shardlint on the mesh they train on, not on 8 devices, so what matters is how
the analysis grows with the program XLA partitions: the instructions of the partitioned
module (layers), and the replica groups and collective table (chips). Simulated CPU
devices stop at 1024 here (4096 fail to compile: "Multiprocess computations aren't
implemented on the CPU backend"), so every size compiles with the TPU compiler for a v5p
topology through libtpu AOT (`shardlint.analyzer.compile._topology`; no TPU attached, nothing
runs).

    python benchmarks/scale.py                  # every size, both paths; PASS/FAIL
    python benchmarks/scale.py --live 4096x48   # one size (CHIPSxLAYERS), live path only
    python benchmarks/scale.py --dump           # the dump path only

The step is `shardlint.examples.decoder` (routed MoE, context parallel; the reference
MoE flattens (batch, seq), so every layer has a context-flatten finding and the analysis
has real work), with batch = 2 rows per (data x fsdp) shard (with one row per device the
flatten keeps a tiled sharding and nothing is lost), seq 256, the other dims at the
config's small defaults, on meshes data x fsdp x context that map onto the torus axes:

    512 chips  v5p:8x8x8     data=8,  fsdp=8,  context=8    12 layers
    4096 chips v5p:16x16x16  data=16, fsdp=16, context=16   12 layers
    2048 chips v5p:8x16x16   data=8,  fsdp=16, context=16   24 layers
    4096 chips v5p:16x16x16  data=16, fsdp=16, context=16   48 layers

Each size runs in fresh subprocesses, so that each peak RSS (`resource.getrusage`) is its
own process's:

- live: `shardlint.analyze(step, *args)`. Its `progress=` messages are timestamped: the
  one just before XLA's compile and the one just after it ("reading XLA's propagated
  shardings and collectives") split the call into compile and parse + analyze (what
  shardlint does after the compile returns). The process's peak RSS is the compile's.
- dump: one process compiles the step with the flags `shardlint.analyze_dump` documents
  (`XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text
  --xla_dump_hlo_pass_re=shardy-xla|sharding-propagation`), a second one runs
  `shardlint.analyze_dump(DIR)`: its wall time and peak RSS are parse + analyze alone.

Per size: the partitioned module's instruction count (`parse_hlo`), the compile time, the
parse + analyze time, peak RSS, findings, and the layers with a context-flatten finding;
then the growth from the smallest to the largest module (time and RSS per instruction).
Targets at 4096 chips x 48 layers: parse + analyze <= 60 s and <= 4 GiB peak RSS (the dump
reader's figures where that path ran; the live figures otherwise), and the flatten found
in every layer at every size.

The children set ALLOW_MULTIPLE_LIBTPU_LOAD=1: libtpu otherwise takes a lock file per
process and refuses to load while any other libtpu process runs on the machine, and
compile-only devices share no chip.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Size:
    topology: str
    layers: int
    mesh: dict

    @property
    def chips(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def label(self) -> str:
        return f"{self.chips}x{self.layers}"

    @property
    def batch(self) -> int:
        return 2 * self.mesh["data"] * self.mesh["fsdp"]


SIZES = [
    Size("v5p:8x8x8", 12, {"data": 8, "fsdp": 8, "context": 8}),
    Size("v5p:16x16x16", 12, {"data": 16, "fsdp": 16, "context": 16}),
    Size("v5p:8x16x16", 24, {"data": 8, "fsdp": 16, "context": 16}),
    Size("v5p:16x16x16", 48, {"data": 16, "fsdp": 16, "context": 16}),
]
SEQ = 256
TARGET = "4096x48"
TARGET_S, TARGET_GIB = 60.0, 4.0
GIB = 2 ** 30
# What shardlint.analyze_dump's docstring asks a job to add to XLA_FLAGS (DIR: the folder).
DUMP_FLAGS = ("--xla_dump_to={dir} --xla_dump_hlo_as_text "
              "--xla_dump_hlo_pass_re=shardy-xla|sharding-propagation")


# ---------------------------------------------------------------- children


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _step(size: Size):
    sys.path.insert(0, str(ROOT))  # run from a checkout
    from shardlint.analyzer.compile._topology import topology_mesh
    from shardlint.examples import decoder

    mesh = topology_mesh(size.mesh, size.topology)
    cfg = decoder.DecoderConfig(layers=size.layers, batch=size.batch, seq=SEQ)
    step, args = decoder.make_step(mesh, cfg)
    return mesh, step, args


def _findings(analysis, layers: int) -> dict:
    flatten_layers = set()
    for f in analysis.findings:
        if f.op == "reshape" and "context" in f.axes:
            flatten_layers.update(int(i) for i in re.findall(r"\blayer_(\d+)\b", f.op_path))
    return {
        "findings": len(analysis.findings),
        "context_flattens": sum(1 for f in analysis.findings
                                if f.op == "reshape" and "context" in f.axes),
        "flatten_layers": len(flatten_layers & set(range(layers))),
        "collectives": len(analysis.collectives),
    }


def child_live(size: Size) -> dict:
    """`shardlint.analyze`, split at its progress messages into compile and the rest."""
    start = time.perf_counter()
    _, step, args = _step(size)
    import shardlint
    from shardlint.analyzer import _analyze

    # Keep the modules the analysis parses, to count their instructions afterwards.
    parsed, parse_hlo = [], _analyze.parse_hlo

    def keeping(text: str):
        parsed.append(parse_hlo(text))
        return parsed[-1]

    _analyze.parse_hlo = keeping
    stamps = {}

    def progress(message: str) -> None:
        key = ("compile" if message.startswith("compiling") else
               "explain" if message.startswith("reading XLA's propagated") else None)
        if key:
            stamps[key] = time.perf_counter()

    traced = time.perf_counter()
    analysis = shardlint.analyze(step, *args, progress=progress)
    done = time.perf_counter()
    rss = _peak_rss()
    if set(stamps) != {"compile", "explain"}:
        raise RuntimeError(f"shardlint.analyze's progress messages changed: saw {stamps}")
    return {
        "setup_s": traced - start, "trace_s": stamps["compile"] - traced,
        "compile_s": stamps["explain"] - stamps["compile"],
        "analyze_s": done - stamps["explain"], "peak_rss": rss,
        # The first module parsed is the partitioned one (every collective), then the
        # module after sharding propagation.
        "instructions": sum(1 for _ in parsed[0].instructions()),
        "propagated_instructions": (sum(1 for _ in parsed[1].instructions())
                                    if len(parsed) > 1 else None),
        **_findings(analysis, size.layers),
    }


def child_write(size: Size, folder: str) -> dict:
    """Compiles the step as a job would, XLA_FLAGS (set by the parent) dumping it."""
    start = time.perf_counter()
    mesh, step, args = _step(size)
    import jax

    from shardlint import _jax
    from shardlint.analyzer.compile import _dump

    documented = _dump.DUMP_FLAGS.replace("'", "")
    if documented != DUMP_FLAGS.format(dir="DIR"):
        raise RuntimeError(f"analyze_dump now documents {documented!r}; update DUMP_FLAGS")
    traced = time.perf_counter()
    with _jax.set_mesh(mesh):
        jax.jit(step).lower(*args).compile()
    done = time.perf_counter()
    sizes = [os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
             if os.path.isfile(os.path.join(folder, f))]
    return {"setup_s": traced - start, "compile_s": done - traced, "peak_rss": _peak_rss(),
            "dump_bytes": sum(sizes)}


def child_read(size: Size, folder: str) -> dict:
    """`shardlint.analyze_dump(folder)` alone: parse + analyze, its own time and RSS."""
    sys.path.insert(0, str(ROOT))
    import shardlint
    from shardlint.analyzer import parse_hlo
    from shardlint.analyzer.compile._dump import read_dump

    imported = _peak_rss()
    start = time.perf_counter()
    analysis = shardlint.analyze_dump(folder)
    done = time.perf_counter()
    rss = _peak_rss()
    instructions = sum(1 for _ in parse_hlo(read_dump(folder).partitioned).instructions())
    return {"analyze_s": done - start, "peak_rss": rss, "import_rss": imported,
            "instructions": instructions, **_findings(analysis, size.layers)}


# ---------------------------------------------------------------- parent


def _run(mode: str, size: Size, folder: str | None = None, env: dict | None = None) -> dict:
    argv = [sys.executable, __file__, "--child", mode, size.label] + ([folder] if folder else [])
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", **(env or {})}
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{size.label} {mode}: the child failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - start
    return row


def _mesh(size: Size) -> str:
    return ",".join(f"{k}={v}" for k, v in size.mesh.items())


def _growth(rows: list[dict], time_key: str, what: str, rss: bool = True) -> None:
    small = min(rows, key=lambda r: r["instructions"])
    big = max(rows, key=lambda r: r["instructions"])
    n = big["instructions"] / small["instructions"]
    t = big[time_key] / small[time_key]
    m = big["peak_rss"] / small["peak_rss"]
    print(f"growth {what}, {small['size']} -> {big['size']}: instructions x{n:.2f}; "
          f"time x{t:.2f} (per instruction x{t / n:.2f})"
          + (f"; peak RSS x{m:.2f} (per instruction x{m / n:.2f})" if rss else ""))


def main(argv: list[str]) -> int:
    modes = [m for m in ("live", "dump") if f"--{m}" in argv] or ["live", "dump"]
    wanted = [a for a in argv if not a.startswith("--")]
    unknown = [w for w in wanted if w not in {s.label for s in SIZES}]
    if unknown:
        print(f"unknown size {unknown}; sizes: {', '.join(s.label for s in SIZES)}")
        return 2
    if importlib.util.find_spec("libtpu") is None:
        print("every size compiles with the TPU compiler: pip install 'shardlint[tpu]'")
        return 2
    import jax  # only for the versions printed
    from importlib.metadata import version

    sizes = [s for s in SIZES if not wanted or s.label in wanted]
    print(f"decoder example, seq {SEQ}, batch 2 per data x fsdp shard; TPU compiler for v5p "
          f"(jax {jax.__version__}, libtpu {version('libtpu')}); fresh processes per size", flush=True)
    sys.path.insert(0, str(ROOT))  # the checkout this script is in
    import shardlint

    if "dump" in modes and not hasattr(shardlint, "analyze_dump"):
        print("shardlint.analyze_dump is not in this checkout: the dump path is skipped")
        modes = [m for m in modes if m != "dump"]
    live, dumped = [], []
    for size in sizes:
        head = f"{size.chips:>4} chips x {size.layers:>2} layers ({size.topology}, {_mesh(size)})"
        if "live" in modes:
            row = _run("live", size) | {"size": size.label}
            live.append(row)
            print(f"{head} live: {row['instructions']} instructions "
                  f"({row['propagated_instructions']} propagated); compile "
                  f"{row['compile_s']:.1f} s, parse + analyze {row['analyze_s']:.1f} s, "
                  f"peak RSS {row['peak_rss'] / GIB:.2f} GiB; {row['findings']} findings, "
                  f"context flatten in {row['flatten_layers']}/{size.layers} layers, "
                  f"{row['collectives']} collectives", flush=True)
        if "dump" in modes:
            folder = tempfile.mkdtemp(prefix="shardlint-scale-")
            try:
                wrote = _run("write", size, folder,
                             {"XLA_FLAGS": DUMP_FLAGS.format(dir=folder)})
                row = _run("read", size, folder) | {"size": size.label,
                                                    "compile_s": wrote["compile_s"]}
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            dumped.append(row)
            print(f"{head} dump: {row['instructions']} instructions; compile "
                  f"{wrote['compile_s']:.1f} s (peak RSS {wrote['peak_rss'] / GIB:.2f} GiB, "
                  f"dump {wrote['dump_bytes'] / 2 ** 20:.0f} MiB); analyze_dump "
                  f"{row['analyze_s']:.1f} s, peak RSS {row['peak_rss'] / GIB:.2f} GiB "
                  f"({row['import_rss'] / GIB:.2f} after imports); {row['findings']} "
                  f"findings, context flatten in {row['flatten_layers']}/{size.layers} layers, "
                  f"{row['collectives']} collectives", flush=True)
    if not live and not dumped:
        print("nothing ran")
        return 2
    if len(live) > 1:
        _growth(live, "analyze_s", "live parse + analyze (RSS: the compiling process)")
        _growth(live, "compile_s", "live compile", rss=False)
    if len(dumped) > 1:
        _growth(dumped, "analyze_s", "analyze_dump")
    ok = all(r["flatten_layers"] == s.layers for rows in (live, dumped)
             for r, s in zip(rows, sizes))
    print(f"{'PASS' if ok else 'FAIL'}: the MoE's context flatten found in every layer at "
          f"every size")
    judged = ([r for r in dumped if r["size"] == TARGET], "analyze_dump")
    if not judged[0]:
        judged = ([r for r in live if r["size"] == TARGET], "live (RSS: the compile's)")
    if not judged[0]:
        print(f"the target size {TARGET} did not run: no PASS/FAIL against its targets")
    else:
        row, path = judged[0][0], judged[1]
        fast = row["analyze_s"] <= TARGET_S
        small = row["peak_rss"] <= TARGET_GIB * GIB
        print(f"{'PASS' if fast else 'FAIL'}: {TARGET} parse + analyze {row['analyze_s']:.1f} s "
              f"(<= {TARGET_S:.0f} s), {path}")
        print(f"{'PASS' if small else 'FAIL'}: {TARGET} peak RSS "
              f"{row['peak_rss'] / GIB:.2f} GiB (<= {TARGET_GIB:.0f} GiB), {path}")
        ok = ok and fast and small
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--child":
        mode, label, *rest = sys.argv[2:]
        size = next(s for s in SIZES if s.label == label)
        result = {"live": child_live, "write": child_write, "read": child_read}[mode](size, *rest)
        print(json.dumps(result))
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
