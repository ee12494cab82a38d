"""`analyze_dump`: what a real job's XLA dump says, against the live analysis of the step.

Each dump is written in the test session by a process that runs the step with
`XLA_FLAGS=--xla_dump_to=... --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=...` set, as a
user's job would (tests/support/dump_job.py), on the installed JAX; no HLO is checked in.
The live analysis of the same step in this process is the reference: the dump must give
the same collectives, causes, requested reshardings, memory and findings.

One difference is by design and asserted as such: XLA:CPU receives `ragged_dot` already
lowered to a masked dense dot, so only the traced program (live) knows it was a grouped
matmul; a CPU dump's findings cannot say "feeds a grouped matmul" (its message and way
out then read as for any flatten). On TPU, where `ragged-dot` reaches XLA, the findings
are identical in full (`test_tpu_dump_gives_the_live_findings_in_full`, marked tpu).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import jax
import pytest

from shardlint import AnalysisError, HloParseError, analyze, analyze_dump
from shardlint.analyzer.compile._dump import read_dump

from support import partitioners
from support.dump_job import build
from support.dumps import FULL_FLAGS, live_analysis, write_dumps

# (step, mesh) pairs of the jobs, each dumped in its own process.
CASES = {
    "moe 2x4": ("steps.make_step", {"data": 2, "context": 4}),
    "moe 4x2": ("steps.make_step", {"data": 4, "context": 2}),
    "requested kv gather": ("steps.make_attention_step", {"data": 2, "context": 4}),
    "pre-jitted, donated": ("cause_steps.make_prejitted_step", {"data": 2, "context": 4}),
    "fsdp weights": ("cause_steps.make_fsdp_step", {"data": 2, "context": 4}),
    "scanned layers": ("cause_steps.make_scanned_layers_step", {"data": 2, "context": 4}),
}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    return write_dumps(tmp_path_factory.mktemp("dumps"), CASES)


@pytest.fixture(scope="module")
def pairs(dumps):
    """{case: (live Analysis, dump Analysis)}."""
    return {label: (live_analysis(*CASES[label]), analyze_dump(str(dumps[label])))
            for label in CASES}


def in_step(stack):
    """The frames inside the step's own code: the outer frames are the two callers (the
    job's `jitted(*arrays)` and this test's `analyze(...)`), which differ by design."""
    return tuple(s for s in stack if Path(s.file).name in ("steps.py", "cause_steps.py"))


def comparable(record, cpu_grouped_matmul: bool = False):
    record = dataclasses.replace(record, stack=in_step(record.stack))
    if cpu_grouped_matmul:  # see the module docstring
        record = dataclasses.replace(record, feeds_grouped_matmul=None, message="", way_out="")
    return record


@pytest.mark.tpu
def test_tpu_dump_gives_the_live_findings_in_full(tmp_path):
    """libtpu AOT (the real TPU compiler): `ragged-dot` reaches XLA, so nothing is lost in
    the dump; memory: the same arguments and outputs, and the temp of the buffer
    assignment, which leaves out runtime buffers `memory_analysis()` counts."""
    from shardlint.analyzer.compile._topology import LibtpuError, check_libtpu, topology_mesh

    try:
        check_libtpu()
    except LibtpuError as e:
        pytest.skip(f"needs a matching libtpu: {e}")
    axes, topology = {"data": 2, "context": 2}, "v5p:2x2x1"
    folder = write_dumps(tmp_path, {"tpu": ("steps.make_step", axes)}, topology=topology)["tpu"]
    step, args = build("steps.make_step", axes, topology)
    assert topology_mesh(axes, topology).devices.shape == (2, 2)
    live, dumped = analyze(step, *args), analyze_dump(str(folder))
    assert dumped.platform == live.platform == "tpu" and dumped.mesh == live.mesh
    assert [comparable(f) for f in dumped.findings] == [comparable(f) for f in live.findings]
    assert any(f.feeds_grouped_matmul for f in dumped.findings)
    assert [comparable(c) for c in dumped.collectives] == [comparable(c) for c in live.collectives]
    assert [comparable(r) for r in dumped.requested] == [comparable(r) for r in live.requested]
    same = ("argument_bytes", "output_bytes", "alias_bytes")
    assert [getattr(dumped.memory, k) for k in same] == [getattr(live.memory, k) for k in same]
    assert 0 < dumped.memory.temp_bytes < live.memory.temp_bytes
    assert any("TPU runtime buffers" in note for note in dumped.unread)


@pytest.mark.parametrize("case", list(CASES))
def test_dump_gives_the_live_collectives_causes_and_memory(pairs, case):
    live, dumped = pairs[case]
    assert dumped.mesh == live.mesh
    assert [comparable(c) for c in dumped.collectives] == [comparable(c) for c in live.collectives]
    assert [comparable(r) for r in dumped.requested] == [comparable(r) for r in live.requested]
    # XLA:CPU's memory_analysis() is the buffer assignment's sums, to the byte (the buffers
    # at the peak carry the job's stacks: tests/analyzer/test_peak.py compares them).
    assert dataclasses.replace(dumped.memory, flops=live.memory.flops, peak_buffers=()) == \
        dataclasses.replace(live.memory, peak_buffers=())
    assert dumped.platform == "cpu" and dumped.partitioner == live.partitioner
    assert dumped.dump and dumped.unread == ()


@pytest.mark.parametrize("case", list(CASES))
def test_dump_gives_the_live_findings(pairs, case):
    live, dumped = pairs[case]
    assert [comparable(f, True) for f in dumped.findings] == [comparable(f, True) for f in live.findings]
    # Only the jaxpr knew which dots were grouped matmuls; the dump never invents one.
    assert not any(d.feeds_grouped_matmul and not f.feeds_grouped_matmul
                   for d, f in zip(dumped.findings, live.findings))


def test_the_cases_cover_what_the_dump_must_carry(pairs):
    """Each case checks something only the dump's extra files tell: what was asked
    (module.mlir), donation (aliases); and that weights are told from activations."""
    assert pairs["requested kv gather"][1].requested
    assert pairs["fsdp weights"][1].by_cause("weights")
    assert pairs["pre-jitted, donated"][1].memory.alias_bytes > 0
    assert any(c.trips == 4 for c in pairs["scanned layers"][1].collectives)
    assert pairs["moe 2x4"][1].findings and pairs["moe 4x2"][1].findings


# The routed layers of signature_steps, each in the signature that looks most like a
# parameter list (`step(x, *weights)`) and FSDP also with its parameters last. A routed
# layer and FSDP in both signatures run by default; the other routed layers with -m slow
# (twelve dumps, a full one each, cost CI's time limit a minute and a half per environment).
SIGNATURE_CASES = {f"{layer} {sig}": (f"signature_steps.{layer}.{sig}", {"data": 2, "context": 4})
                   for layer, sig in [("scatter_keep_sharded", "x_then_weights"),
                                      ("fsdp_weights", "x_then_weights"),
                                      ("fsdp_weights", "batch_then_params"),
                                      ("capacity_cumsum", "x_then_weights"),
                                      ("flatten_ragged_dot", "x_then_weights"),
                                      ("scan_remat", "x_then_weights")]}
_SLOW_SIGNATURE_CASES = list(SIGNATURE_CASES)[3:]


def _minimal_and_full(root, cases: dict) -> dict:
    return {kind: write_dumps(root / kind, cases, flags) for kind, flags in (("minimal", ""), ("full", FULL_FLAGS))}


@pytest.fixture(scope="module")
def minimal_and_full_dumps(tmp_path_factory):
    cases = {k: v for k, v in SIGNATURE_CASES.items() if k not in _SLOW_SIGNATURE_CASES}
    return _minimal_and_full(tmp_path_factory.mktemp("signature_dumps"), cases)


@pytest.fixture(scope="module")
def slow_minimal_and_full_dumps(tmp_path_factory):
    cases = {k: SIGNATURE_CASES[k] for k in _SLOW_SIGNATURE_CASES}
    return _minimal_and_full(tmp_path_factory.mktemp("slow_signature_dumps"), cases)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW_SIGNATURE_CASES else c
                                  for c in SIGNATURE_CASES])
def test_a_minimal_dump_tells_weights_from_activations_as_a_full_one(case, request):
    """A dump written with `--xla_dump_to` alone (no propagation pass, the HLO as protos
    and text by default) gives every collective the cause the full dump and the live
    analysis give: which arguments are weights is read from the partitioned program."""
    dumps = request.getfixturevalue("slow_minimal_and_full_dumps" if case in _SLOW_SIGNATURE_CASES
                                    else "minimal_and_full_dumps")
    minimal = analyze_dump(str(dumps["minimal"][case]))
    full = analyze_dump(str(dumps["full"][case]))
    live = live_analysis(*SIGNATURE_CASES[case])
    verdicts = [[(c.kind, c.axes, c.shape, c.cause) for c in a.collectives] for a in (minimal, full, live)]
    assert verdicts[0] == verdicts[1] == verdicts[2]
    assert any("no propagation drops" in note for note in minimal.unread)
    assert minimal.by_cause("lost"), "the gathered activations read as lost"


def test_the_step_is_picked_among_the_jobs_helper_modules(dumps):
    """The job's folder also holds device_put / random modules; the step is the largest."""
    files = os.listdir(dumps["moe 2x4"])
    assert len({f.split(".")[0] for f in files if f.startswith("module_")}) > 2
    assert analyze_dump(str(dumps["moe 2x4"])).findings
    assert analyze_dump(str(dumps["moe 2x4"]), module="jit_step").findings


@pytest.fixture(scope="module")
def partial_dumps(tmp_path_factory):
    """`--xla_dump_to` alone (no propagation passes), and the same job under GSPMD."""
    root = tmp_path_factory.mktemp("partial")
    out = write_dumps(root / "plain", {"moe 2x4": CASES["moe 2x4"]}, flags="")
    out.update(write_dumps(root / "gspmd", {"gspmd": CASES["moe 2x4"]},
                           env_extra={"JAX_USE_SHARDY_PARTITIONER": "false"}))
    return {"plain": out["moe 2x4"], "gspmd": out["gspmd"]}


def test_dump_without_propagation_passes_gives_collectives_and_says_what_is_missing(
        partial_dumps, pairs):
    """Without the propagated module a collective is placed where XLA attached it
    (`xla_source`); the live analysis may name the op that needed it instead."""
    live, _ = pairs["moe 2x4"]
    plain = analyze_dump(str(partial_dumps["plain"]))
    assert [(c.kind, c.axes, c.bytes, c.shape, c.xla_source) for c in plain.collectives] == \
        [(c.kind, c.axes, c.bytes, c.shape, c.xla_source) for c in live.collectives]
    assert plain.by_cause("lost"), "the gathers of activations still read as lost"
    assert any("--xla_dump_hlo_pass_re" in note for note in plain.unread)


def test_gspmd_dump_needs_the_mesh_and_then_gives_the_live_gspmd_analysis(partial_dumps):
    partitioners.skip_without_gspmd()
    folder = str(partial_dumps["gspmd"])
    with pytest.raises(AnalysisError, match="names no mesh axes.*--mesh"):
        analyze_dump(folder)
    with pytest.raises(AnalysisError, match="has 4 devices; the module was partitioned for 8"):
        analyze_dump(folder, mesh={"data": 2, "context": 2})
    dumped = analyze_dump(folder, mesh={"data": 2, "context": 4})
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        live = live_analysis(*CASES["moe 2x4"])
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    assert dumped.partitioner == live.partitioner == "gspmd"
    assert [comparable(c) for c in dumped.collectives] == [comparable(c) for c in live.collectives]
    assert [comparable(f, True) for f in dumped.findings] == [comparable(f, True) for f in live.findings]
    assert dumped.findings


# ------------------------------------------------------------------ bad folders


def step_files(folder: Path) -> list[Path]:
    """The files of the folder's step module, and its folder (module.mlir)."""
    chosen = read_dump(str(folder)).stem
    return [p for p in folder.iterdir() if p.name.startswith(chosen + ".") or p.name == chosen]


def test_bad_folders_are_one_clear_error(dumps, tmp_path, run_cli):
    source = dumps["moe 2x4"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a dump")
    protos = tmp_path / "protos"
    protos.mkdir()
    (protos / "module_0001.jit_step.before_optimizations.pb").write_bytes(b"\0")
    twice = tmp_path / "twice"
    shutil.copytree(source, twice)
    for p in step_files(twice):  # the same step compiled again, as module 0099
        copy = shutil.copytree if p.is_dir() else shutil.copy
        copy(p, twice / ("module_0099." + p.name.split(".", 1)[1]))
    foreign = tmp_path / "foreign"
    shutil.copytree(source, foreign)
    partitioned = next(p for p in step_files(foreign) if p.name.endswith("cpu_after_optimizations.txt"))
    partitioned.write_text("HloProgram v9 jit_step\n" + partitioned.read_text())
    truncated = tmp_path / "truncated"
    shutil.copytree(source, truncated)
    cut = next(p for p in step_files(truncated) if p.name.endswith("cpu_after_optimizations.txt"))
    lines = cut.read_text().splitlines(keepends=True)
    cut.write_text("".join(lines[: len(lines) // 2]))
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    model = tmp_path / "model.py"   # a file given where the dump folder goes
    model.write_text("")
    expected = {
        tmp_path / "missing": "the XLA dump folder .*missing does not exist",
        model: "model.py is a file; give the folder XLA dumped into .*--xla_dump_to=DIR",
        nothing: "the XLA dump folder .*nothing is empty; write one with XLA_FLAGS=.*--xla_dump_to=DIR",
        empty: "holds no HLO module after optimizations .*notes.txt.*--xla_dump_to=DIR",
        protos: "no text: add --xla_dump_hlo_as_text",
        twice: "holds jit_step compiled 2 times: module_\\d+.jit_step.*module_0099.jit_step.*--module module_",
        foreign: "cpu_after_optimizations.txt: HLO line 1: expected `HloModule NAME`",
        truncated: f"{cut.name}: HLO line {len(lines) // 2}: expected `}}` closing computation",
    }
    for folder, message in expected.items():
        with pytest.raises(AnalysisError, match=message) as raised:
            analyze_dump(str(folder))
        assert "0 files" not in str(raised.value) and "e.g. none" not in str(raised.value)
    assert analyze_dump(str(twice), module="module_0099").findings
    with pytest.raises(AnalysisError, match="names 2 modules.*give the number"):
        analyze_dump(str(twice), module="jit_step")
    with pytest.raises(AnalysisError, match="no such module.*it has module_"):
        analyze_dump(str(twice), module="jit_eval_step")
    with pytest.raises(HloParseError):
        analyze_dump(str(truncated))
    for folder in (twice, truncated):
        result = run_cli("analyze", "--xla-dump", str(folder))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert lines[-1].startswith("shardlint: error: ") and all(
            line.startswith("shardlint: reading") for line in lines[:-1]), result.stderr


def test_cli_reads_a_dump_for_analyze_report_and_check(dumps, tmp_path, run_cli):
    folder = str(dumps["moe 2x4"])
    result = run_cli("analyze", "--xla-dump", folder, "--json", str(tmp_path / "a.json"))
    assert result.returncode == 1, result.stderr  # findings
    assert f"read from the XLA dump {folder}" in result.stdout
    assert "steps.py:53  reshape drops context" in result.stdout
    report = run_cli("report", "--xla-dump", folder, "--out", str(tmp_path / "r.html"))
    assert report.returncode == 1, report.stderr
    assert "read from the XLA dump" in (tmp_path / "r.html").read_text()
    baseline = str(tmp_path / "b.json")
    assert run_cli("check", "--xla-dump", folder, "--baseline", baseline, "--update").returncode == 0
    again = run_cli("check", "--xla-dump", folder, "--baseline", baseline)
    assert again.returncode == 0, again.stdout + again.stderr
    for argv, message in ((("analyze", "--xla-dump", folder, "--rewrite"), "--rewrite needs the step's Python"),
                          (("analyze", "shardlint.examples.steps:make_step", "--xla-dump", folder), "not both"),
                          (("analyze",), "give a target"),
                          (("analyze", "--xla-dump", folder, "--mesh", "data=4,context=2"), "disagrees")):
        bad = run_cli(*argv)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
