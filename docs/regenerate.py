"""Regenerates every example output quoted in README.md, benchmarks/README.md and docs/*.md by running the tool.

A quoted output sits between two markers, and only there:

    <!-- generated: NAME -->
    ...what BLOCKS[NAME] writes...
    <!-- end -->

    python docs/regenerate.py            # rewrite the blocks (about 2 minutes: the demo)
    python docs/regenerate.py --check    # exit 1 and name the blocks that would change
    python docs/regenerate.py --only demo,schemas
    python docs/regenerate.py --only maxtext-real-size   # slow blocks run only when named

Outputs depend on the JAX version (the header of each names it): run it where the quoted
outputs were made, Python 3.11 with JAX 0.10.2 (`.venv`), and the MaxText blocks, which
need MaxText installed (Python 3.12, `pip install -e '.[maxtext]'`), there; a block
whose requirement is missing is skipped and named. Each command runs in a fresh
temporary folder, so paths print relative to the package (`shardlint/examples/steps.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"(<!-- generated: (\S+) -->\n)(.*?)(<!-- end -->)", re.S)
MESH = "data=2,context=4"


@dataclasses.dataclass(frozen=True)
class Block:
    write: Callable[[], str]     # the text between the markers
    needs: str = ""              # modules that must import ("maxtext,libtpu"), else skipped
    slow: bool = False           # run only when --only names it (real-size TPU compiles)

    def missing(self) -> list[str]:
        return [name for name in filter(None, self.needs.split(",")) if importlib.util.find_spec(name) is None]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


@functools.cache
def shardlint(*args: str, files: tuple[tuple[str, str], ...] = (), env: tuple = ()) -> tuple[str, str, str]:
    """Runs `shardlint ARGS` in a fresh folder holding `files`; (stdout, stderr, folder)."""
    folder = tempfile.mkdtemp(prefix="shardlint-docs-")
    for name, text in files:
        with open(os.path.join(folder, name), "w", encoding="utf-8") as fh:
            fh.write(text)
    run = subprocess.run([sys.executable, "-m", "shardlint.cli", *args], cwd=folder,
                         env={**_env(), **dict(env)}, capture_output=True, text=True)
    if run.returncode not in (0, 1):
        raise RuntimeError(f"shardlint {' '.join(args)} exited {run.returncode}:\n{run.stderr}")
    return run.stdout.replace(folder, "..."), run.stderr.replace(folder, "..."), folder


def fenced(text: str, lang: str = "") -> str:
    return f"```{lang}\n{text.rstrip()}\n```\n"


def _code_block_after(marker: str) -> str:
    """The code block right after `<!-- file: NAME -->` in README.md (model.py)."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    found = re.search(re.escape(marker) + r"\n```python\n(.*?)```", readme, re.S)
    if not found:
        raise RuntimeError(f"README.md has no code block after {marker}")
    return found.group(1)


def model_files() -> tuple[tuple[str, str], ...]:
    return (("model.py", _code_block_after("<!-- file: model.py -->")),)


def demo() -> str:
    out, _, _ = shardlint("demo")
    return fenced(out)


def analyze_steps() -> str:
    out, _, _ = shardlint("analyze", "shardlint.examples.steps:make_step", "--mesh", MESH)
    return fenced(out)


def model_findings() -> str:
    out, _, _ = shardlint("analyze", "model.py:make_step", "--mesh", MESH, files=model_files())
    lines = out.splitlines()
    keep = [lines[0], ""] + [x for x in lines if re.match(r"\d+ finding|  \[\d+\]", x)]
    return fenced("\n".join(keep))


def by_scope() -> str:
    out, _, _ = shardlint("analyze", "shardlint.examples.decoder:make_step", "--mesh", MESH, "--by-scope")
    lines = out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("collectives by scope"))
    return fenced("\n".join(lines[start:start + 11] + ["      ..."]))


def peak_buffers() -> str:
    out, _, _ = shardlint("analyze", "shardlint.examples.steps:make_step", "--mesh", MESH)
    lines = out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("memory per device"))
    return fenced("\n".join(lines[start:start + 5] + ["     ..."]))


def model_sweep() -> str:
    """The README's model swept over the context degree, before and after the rewrite."""
    out, _, _ = shardlint("analyze", "model.py:make_step", "--mesh", MESH, "--sweep", "context=1,2,4,8",
                          "--rewrite", files=model_files())
    return fenced(out)


def report_summary() -> str:
    out, _, _ = shardlint("report", "model.py:make_step", "--mesh", MESH, files=model_files())
    return fenced(out)


def baseline() -> str:
    _, _, folder = shardlint("check", "model.py:make_step", "--mesh", MESH, "--update", files=model_files())
    with open(os.path.join(folder, "shardlint.baseline.json"), encoding="utf-8") as fh:
        return fenced(fh.read(), "json")


def _find(pattern: str, text: str) -> str:
    """The repository file matching `pattern` that holds `text` (helpers may move)."""
    for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
        with open(path, encoding="utf-8") as fh:
            if text in fh.read():
                return path
    raise RuntimeError(f"no {pattern} holds {text!r}")


def xla_dump() -> str:
    job = _find("tests/**/dump_job.py", "def build")
    dump = tempfile.mkdtemp(prefix="shardlint-dump-")
    flags = (f"--xla_force_host_platform_device_count=8 --xla_dump_to={dump} --xla_dump_hlo_as_text "
             f"--xla_dump_hlo_pass_re=shardy-xla|sharding-propagation")
    subprocess.run([sys.executable, job, "steps.make_step", MESH], cwd=ROOT, check=True,
                   env={**_env(), "XLA_FLAGS": flags}, capture_output=True)
    out, err, _ = shardlint("analyze", "--xla-dump", dump)
    lines = out.replace(dump, "/tmp/xla_dump").splitlines()
    end = next(i for i, x in enumerate(lines) if x.strip() and i > 2 and not re.match(r"\s*(\d+ finding|\[\d+\]| {5})", x))
    memory = next(x for x in lines if x.startswith("memory per device"))
    findings = [x.split("  -> ")[0].rstrip() for x in lines[:end] if not x.startswith("      ")]
    text = (f"$ XLA_FLAGS=\"{flags.replace(dump, '/tmp/xla_dump')}\" \\\n"
            f"    python {os.path.relpath(job, ROOT)} steps.make_step {MESH}\n"
            f"$ shardlint analyze --xla-dump /tmp/xla_dump\n"
            + err.replace(dump, "/tmp/xla_dump") + "\n".join(findings).rstrip() + "\n  ...\n" + memory)
    return fenced(text)


def api() -> str:
    """Runs the README's Python API example as a user would, and quotes what it prints."""
    folder = tempfile.mkdtemp(prefix="shardlint-docs-")
    with open(os.path.join(folder, "api.py"), "w", encoding="utf-8") as fh:
        fh.write(_code_block_after("<!-- file: api.py -->"))
    run = subprocess.run([sys.executable, "api.py"], cwd=folder, env=_env(), capture_output=True,
                         text=True, check=True)
    return fenced(run.stdout)


def schemas() -> str:
    spec = importlib.util.spec_from_file_location("schema_page", os.path.join(ROOT, "docs", "schema_page.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.schema_page()


MAXTEXT_MOE = ("analyze", "tests.support.maxtext_moe:make_moe_step", "--devices", "8", "--set", "sparse=false")
MAXTEXT = ("shardlint.integrations.maxtext:make_step", "--devices", "8",
           "--set", "decoder_block=mixtral", "--set", "base_num_decoder_layers=2", "--set", "base_emb_dim=64",
           "--set", "base_mlp_dim=128", "--set", "base_moe_mlp_dim=128", "--set", "num_experts=8",
           "--set", "num_experts_per_tok=2", "--set", "base_num_query_heads=4", "--set", "base_num_kv_heads=4",
           "--set", "head_dim=16", "--set", "vocab_size=256", "--set", "max_target_length=128",
           "--set", "per_device_batch_size=1", "--set", "dtype=float32", "--set", "weight_dtype=float32",
           "--set", "capacity_factor=-1", "--set", "sparse_matmul=false", "--set", "ici_data_parallelism=2",
           "--set", "ici_context_parallelism=4", "--set", "scan_layers=false")


def maxtext_moe() -> str:
    out, _, _ = shardlint(*MAXTEXT_MOE)
    return fenced(out)


def _finding_headers(out: str) -> str:
    lines = out.splitlines()
    return fenced("\n".join([lines[0]] + [x for x in lines if re.match(r"\d+ finding|  \[\d+\]", x)]))


def maxtext_findings() -> str:
    return _finding_headers(shardlint("analyze", *MAXTEXT)[0])


def maxtext_rewritten() -> str:
    return _finding_headers(shardlint("analyze", *MAXTEXT, "--rewrite")[0])


def _maxtext_loop() -> str:
    """The issue's loop: a 2-layer mixtral at data=2 x context=4 on 8 simulated CPU devices,
    the dense dropless path, 3 steps of synthetic data (benchmarks/maxtext_train.py's)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import maxtext_train

    return maxtext_train.LOOP


def _loop(module: str) -> subprocess.CompletedProcess:
    """MaxText's trainer (or shardlint's runner) on the issue's loop, in a fresh folder."""
    folder = tempfile.mkdtemp(prefix="shardlint-docs-")
    base = os.path.join(importlib.util.find_spec("maxtext").submodule_search_locations[0], "configs", "base.yml")
    env = dict(_env(), XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.run([sys.executable, "-m", module, base, "run_name=docs", f"base_output_directory={folder}",
                           *_maxtext_loop().split()], cwd=folder, env=env, capture_output=True, text=True, check=True)


def maxtext_train() -> str:
    """The runner's summary line, then the loss each loop logs at each step."""
    loss = re.compile(r"completed step: (\d+), .*?\bloss: ([\d.]+),")
    theirs = loss.findall(_loop("maxtext.trainers.pre_train.train").stderr)
    ran = _loop("shardlint.integrations.maxtext.train")
    rows = [f"{'step':<6}{'MaxText':<10}shardlint"] + [
        f"{step:<6}{a:<10}{b}" for (step, a), (_, b) in zip(theirs, loss.findall(ran.stderr), strict=True)]
    return fenced("\n".join([*(x for x in ran.stdout.splitlines() if x.startswith("shardlint: ")), "", *rows]))


def rewrite_reach() -> str:
    """The table of steps the rewrite reaches (`benchmarks/rewrite_reach.py`)."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "rewrite_reach.py")],
                         env=_env(), capture_output=True, text=True, check=True)
    return run.stdout


def maxtext_real_size(*options: str) -> str:
    """`benchmarks/maxtext_real_size.py OPTIONS`'s table (6 to 17 minutes of TPU compiles
    here), its figures per point left out, and how long the whole run took."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "maxtext_real_size.py"), *options],
                         env=_env(), capture_output=True, text=True, check=True)
    table = [line for line in run.stdout.splitlines() if not line.startswith("    {")]
    minutes = (time.perf_counter() - start) / 60
    return fenced("\n".join([*table, f"({minutes:.0f} minutes for the run, one point after another)"]))


def maxtext_presets() -> str:
    """`benchmarks/maxtext_presets.py`'s table: every MoE preset on every MoE path (about an
    hour of CPU compiles here, one row after another), and how long the whole run took."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "maxtext_presets.py")],
                         env=_env(), stdout=subprocess.PIPE, text=True, check=True)
    minutes = (time.perf_counter() - start) / 60
    return f"{run.stdout.rstrip()}\n\n({minutes:.0f} minutes for the run, one row after another)\n"


PLAN_EXAMPLE = ("plan", "shardlint.examples.decoder:make_step", "--mesh", MESH, "--set", "layers=1",
                "--grid", "context=1,2,4", "--longest", "seq=64..1024:64", "--hbm-gib", "0.008", "--jobs", "2")


def plan_example() -> str:
    """`shardlint plan` on the example decoder: the longest sequence that fits 8 MiB per
    device, before and after the fix, as the context degree grows (about 3 minutes)."""
    out, _, _ = shardlint(*PLAN_EXAMPLE)
    return fenced(f"$ shardlint {' '.join(PLAN_EXAMPLE)}\n{out}")


PLAN_MIXTRAL = ("plan", "shardlint.integrations.maxtext:make_step", "--topology", "v5p:4x4x4",
                "--set", "model_name=mixtral-8x7b", "--set", "sparse_matmul=false", "--set", "capacity_factor=1.25",
                "--set", "max_target_length=32768", "--set", "per_device_batch_size=1",
                "--set", "ici_fsdp_parallelism=-1", "--set", "attention=flash",
                "--grid", "ici_context_parallelism=1,4", "--per-shard-capacity")


def plan_mixtral() -> str:
    """`shardlint plan` on MaxText's own mixtral-8x7b preset at v5p:4x4x4 (TPU AOT compiles, one
    point after another: about 9 minutes here), with how long it took."""
    start = time.perf_counter()
    out, _, _ = shardlint(*PLAN_MIXTRAL)
    minutes = (time.perf_counter() - start) / 60
    return fenced(f"$ shardlint {' '.join(PLAN_MIXTRAL)}\n{out.rstrip()}\n"
                  f"({minutes:.0f} minutes for the run, --jobs 1)")


def plan_recorded(model: str) -> str:
    """What `benchmarks/maxtext_plan.py --model MODEL` measured: its command, the plan's
    table where its search ended (its record, benchmarks/results/plan-<model>.json), each
    context degree's fits on both sides among every point it compiled (kept from its --cache
    in benchmarks/results/plan-<model>/), how long it ran, and its rounds' points (its
    progress lines, benchmarks/results/plan-<model>.log) spread over N Ray workers."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import maxtext_plan
    from shardlint.reports import format_plan, plan_of

    results = os.path.join(ROOT, "benchmarks", "results", f"plan-{model}")
    with open(results + ".log", encoding="utf-8") as fh:
        log = fh.read().splitlines()
    table = ""
    if os.path.exists(results + ".json"):   # the search ended: its own table
        with open(results + ".json", encoding="utf-8") as fh:
            plan = plan_of(json.load(fh)["plan"], results + ".json")
        table = format_plan(plan) + "\n\nevery point compiled, both sides:\n"
    rounds = [r for r in maxtext_plan.point_seconds("\n".join(log)) if r]   # not a round stopped at its start
    ray = ", ".join(f"{n} workers about {maxtext_plan.projected(rounds, n) / 60:.0f} min" for n in (4, 8, 16))
    return fenced(f"{log[0]}\n{table}{maxtext_plan.brackets(results)}\n{log[-1]}\n"
                  f"{sum(map(len, rounds))} points in {len(rounds)} rounds; on Ray, each round's points "
                  f"spread over N workers at the times measured here: {ray}")


def plan_at_length(model: str, length: int) -> str:
    """`shardlint plan` of MaxText's preset MODEL over benchmarks/maxtext_plan.py's grid at one
    max_target_length, run by hand (`maxtext_plan.command(..., length=...)`, one point after
    another): its table from the --json it wrote, and what its points took from its progress
    lines, both kept in benchmarks/results/plan-<model>-<length>.json and .log."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import maxtext_plan
    from shardlint.reports import format_plan, read_plan_json

    results = os.path.join(ROOT, "benchmarks", "results", f"plan-{model}-{length}")
    plan = read_plan_json(results + ".json")
    with open(results + ".log", encoding="utf-8") as fh:
        seconds = maxtext_plan.point_times(fh.read())
    peaks = [row.point.host_peak_bytes for row in plan.rows if row.point and row.point.host_peak_bytes]
    shown = maxtext_plan.command(model, plan.topology, None, 1, length=length)
    return fenced(f"$ {' '.join(shown)}\n{format_plan(plan)}\n{len(seconds)} points, {min(seconds)} to "
                  f"{max(seconds)} s each, {sum(seconds) / 60:.0f} min one after another; peak memory of a "
                  f"point's process {max(peaks) / 2**30:.1f} GiB")


BLOCKS: dict[str, Block] = {
    "demo": Block(demo),
    "model-findings": Block(model_findings),
    "analyze-steps": Block(analyze_steps),
    "by-scope": Block(by_scope),
    "peak-buffers": Block(peak_buffers),
    "model-sweep": Block(model_sweep),
    "report-summary": Block(report_summary),
    "baseline": Block(baseline),
    "xla-dump": Block(xla_dump),
    "api": Block(api),
    "schemas": Block(schemas),
    "rewrite-reach": Block(rewrite_reach),
    "plan-example": Block(plan_example),
    "plan-mixtral": Block(plan_mixtral, needs="maxtext,libtpu", slow=True),
    "plan-mixtral-longest": Block(functools.partial(plan_recorded, "mixtral-8x7b")),
    "plan-qwen3-next": Block(functools.partial(plan_at_length, "qwen3-next-80b-a3b", 32768)),
    "maxtext-presets": Block(maxtext_presets, needs="maxtext", slow=True),
    "maxtext-moe": Block(maxtext_moe, needs="maxtext"),
    "maxtext-findings": Block(maxtext_findings, needs="maxtext"),
    "maxtext-rewritten": Block(maxtext_rewritten, needs="maxtext"),
    "maxtext-train": Block(maxtext_train, needs="maxtext"),
    "maxtext-real-size": Block(maxtext_real_size, needs="maxtext,libtpu", slow=True),
    "maxtext-real-size-qwen3": Block(functools.partial(maxtext_real_size, "--model", "qwen3-30b-a3b"),
                                     needs="maxtext,libtpu", slow=True),
}


def pages() -> list[str]:
    return ([os.path.join(ROOT, "README.md"), os.path.join(ROOT, "benchmarks", "README.md")]
            + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block would change")
    parser.add_argument("--only", default="", help="comma-separated block names")
    args = parser.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    unknown = only - set(BLOCKS)
    if unknown:
        parser.error(f"unknown block(s) {', '.join(sorted(unknown))}; choose from {', '.join(BLOCKS)}")
    seen, stale, skipped = set(), [], []
    for page in pages():
        text = open(page, encoding="utf-8").read()

        def replace(match: re.Match) -> str:
            name = match.group(2)
            if name not in BLOCKS:
                raise SystemExit(f"{os.path.relpath(page, ROOT)}: unknown block {name!r}")
            seen.add(name)
            block = BLOCKS[name]
            if only and name not in only:
                return match.group(0)
            if block.missing() or (block.slow and name not in only):
                skipped.append(name)
                return match.group(0)
            print(f"regenerate: {name}", file=sys.stderr)
            new = block.write()
            if new != match.group(3):
                stale.append(f"{os.path.relpath(page, ROOT)}: {name}")
            return match.group(1) + new + match.group(4)

        new_text = MARKER.sub(replace, text)
        if new_text != text and not args.check:
            with open(page, "w", encoding="utf-8") as fh:
                fh.write(new_text)
    missing = set(BLOCKS) - seen
    if missing:
        print(f"regenerate: no page holds block(s) {', '.join(sorted(missing))}", file=sys.stderr)
        return 1
    for name in skipped:
        why = (f"needs {', '.join(BLOCKS[name].missing())}" if BLOCKS[name].missing()
               else f"slow: --only {name}")
        print(f"regenerate: skipped {name} ({why})", file=sys.stderr)
    for where in stale:
        print(f"{'stale' if args.check else 'rewrote'}: {where}", file=sys.stderr)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
