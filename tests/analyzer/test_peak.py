"""The memory peak, buffer by buffer, from XLA's buffer assignment and live ranges.

On steps the installed JAX compiles (a plain step, a scan of remat'd layers, a pre-jitted
donated step, on two meshes): the temp buffers account for at least 95% of temp, each byte
once; the same from a job's XLA:CPU dump; a step whose gathered activation is its largest
buffer names that gather and its cause. The parsers are tested on the text XLA wrote.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardlint
from shardlint import AnalysisError
from shardlint.analyzer.parse._buffers import parse_buffer_assignment, value_name
from shardlint.analyzer.parse._live_range import parse_live_range
from shardlint.analyzer.memory._peak import _paint, peak_lines

from support.dumps import FULL_FLAGS, live_analysis, write_dumps

STEPS = {"plain": "cause_steps.make_scatter_dispatch_step",
         "scan+remat": "cause_steps.make_scanned_layers_step",
         "pre-jitted": "cause_steps.make_prejitted_step"}
MESHES = {"2x4": {"data": 2, "context": 4}, "4x2": {"data": 4, "context": 2}}


@pytest.fixture(scope="module", params=[(s, m) for s in STEPS for m in MESHES], ids=lambda p: f"{p[0]}-{p[1]}")
def analysis(request):
    step, mesh = request.param
    return live_analysis(STEPS[step], MESHES[mesh])


def test_the_temp_buffers_account_for_the_temp(analysis):
    memory = analysis.memory
    temps = [b for b in memory.peak_buffers if b.role == "temp" and b.value]   # not the padding
    assert temps and memory.temp_bytes > 0
    assert 0.95 * memory.temp_bytes <= memory.temp_accounted() <= memory.temp_bytes
    # Largest first; each buffer named by its instruction, op and (for the user's ops) line.
    assert [b.bytes for b in memory.peak_buffers] == sorted((b.bytes for b in memory.peak_buffers), reverse=True)
    assert all(b.op and b.shape and 0 < b.bytes <= b.size for b in temps)
    assert sum(b.bytes for b in temps if b.alive) <= memory.temp_bytes
    assert any(b.source is not None and b.source.file.endswith("steps.py") for b in temps)


def test_buffers_alive_at_the_peak_are_the_live_range_peak(analysis):
    """The buffers alive at XLA's peak are all listed, the arguments among them too."""
    alive = [b for b in analysis.memory.peak_buffers if b.alive]
    assert any(b.role == "argument" and b.op == "parameter" for b in alive)
    assert any(b.role == "temp" for b in alive)


def test_lines_group_the_buffers_of_one_op():
    analysis = live_analysis(STEPS["scan+remat"], MESHES["2x4"])
    lines = peak_lines(analysis.memory.peak_buffers)
    temps = [b for b in analysis.memory.peak_buffers if b.role == "temp"]
    assert sum(line.bytes for line in lines) == sum(b.bytes for b in temps)
    # every byte of the temp allocation once: the buffers' and the padding no buffer uses
    assert sum(b.bytes for b in temps) == analysis.memory.temp_bytes
    assert len({line.where for line in lines}) == len(lines)
    assert any(line.backward for line in lines) and any(not line.backward for line in lines)


def test_a_gathered_activation_that_is_the_largest_buffer_names_its_gather(mesh):
    """x is gathered over context at a flatten and then only summed: the gathered copy is
    the largest buffer at the peak, and it names the all-gather (lost)."""
    x = jax.ShapeDtypeStruct((4, 256, 512), jnp.float32, sharding=NamedSharding(mesh, P("data", "context", None)))

    def step(x_BSD):
        b, s, d = x_BSD.shape
        tokens_TD = x_BSD.reshape(b * s, d)
        return jnp.cumsum(tokens_TD, axis=0)[-1].sum()

    analysis = shardlint.analyze(step, x)
    top = analysis.memory.peak_buffers[0]
    gathered = [c for c in analysis.all_gathers() if c.cause == "lost"]
    assert gathered, analysis.collectives
    assert top.collective in {c.id for c in gathered} and top.cause == "lost", top


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    flags = FULL_FLAGS + " --xla_dump_buffer_assignment_analysis"
    jobs = {name: (step, MESHES["2x4"]) for name, step in STEPS.items()}
    return write_dumps(tmp_path_factory.mktemp("peak_dumps"), jobs, flags)


@pytest.mark.parametrize("name", list(STEPS))
def test_a_dump_gives_the_live_peak(dumped, name):
    """A job's XLA:CPU dump with the buffer-assignment analysis lists the live peak's
    buffers: the same bytes at the same lines and ops."""
    live = live_analysis(STEPS[name], MESHES["2x4"])
    dump = shardlint.analyze_dump(str(dumped[name]))
    assert dump.memory.temp_bytes == live.memory.temp_bytes
    key = lambda b: (b.bytes, b.role, b.op, str(b.source), b.alive)  # noqa: E731
    assert sorted(map(key, dump.memory.peak_buffers)) == sorted(map(key, live.memory.peak_buffers))
    assert dump.memory.temp_accounted() >= 0.95 * dump.memory.temp_bytes


def test_a_dump_without_the_live_ranges_says_so(dumped, tmp_path):
    """(XLA:CPU writes the live ranges into any dump; other backends with
    --xla_dump_buffer_assignment_analysis.)"""
    folder = tmp_path / "no_live_ranges"
    shutil.copytree(dumped["plain"], folder)
    for path in folder.glob("*live-range.txt"):
        path.unlink()
    dump = shardlint.analyze_dump(str(folder))
    assert dump.memory.temp_bytes > 0 and dump.memory.peak_buffers == ()
    assert any("--xla_dump_buffer_assignment_analysis" in note for note in dump.unread)


def test_painting_counts_each_byte_once():
    painted: list[tuple[int, int]] = []
    assert _paint(painted, 0, 100) == 100
    assert _paint(painted, 50, 150) == 50
    assert _paint(painted, 200, 300) == 100
    assert _paint(painted, 0, 400) == 150
    assert painted == [(0, 400)]


BUFFERS = """BufferAssignment:
allocation 0: size 8192, parameter 1, shape |f32[4,16,32]| at ShapeIndex {}:
 value: <543 param.2 @0> (size=8192,offset=0): f32[4,16,32]{2,1,0}
allocation 1: size 4096, preallocated-temp:
 value: <1105 wide.param.2{3} (phi) @0> (size=2048,offset=0): f32[4,128]{1,0}
 value: <578 all-reduce.5{} @0> (size=24,offset=2048): (f32[], f32[4,16]{1,0})
 value: <519 custom-call{0} @0> (size=2048,offset=2048): f32[256,2]{1,0}

Total bytes used: 12288
"""


def test_buffer_assignment_values_are_read_with_their_tuple_elements():
    allocations = parse_buffer_assignment(BUFFERS)
    assert [a.role for a in allocations] == ["argument", "temp"]
    assert [s.value for s in allocations[1].slots] == ["wide.param.2{3}", "all-reduce.5", "custom-call{0}"]
    assert allocations[1].slots[2].offset == 2048 and allocations[1].slots[2].size == 2048
    assert value_name("sort.17{}") == "sort.17" and value_name("sort.17{1}") == "sort.17{1}"
    with pytest.raises(AnalysisError, match="line 2"):
        parse_buffer_assignment("BufferAssignment:\nallocation x: size 1:\n")


def test_live_ranges_are_read_as_far_as_the_peak():
    text = ("HloLiveRange (max 9):\n  InstructionSequence:\n    0:param\n  BufferLiveRange:\n"
            "    param{}:0-9\n    fusion.2{1}:3-5\n  Live ranges at 4 (peak):\n"
            "    fusion.2{1}: 256 bytes (cumulative: 256 bytes)\n    param{}: 64 bytes (cumulative: 320 bytes)\n"
            "  Stack trace breakdown for peak usage: 320 bytes\n    junk\n")
    live = parse_live_range(text)
    assert live.peak_time == 4 and live.peak == {"fusion.2{1}": 256, "param": 64}
    assert live.ranges == {"param": (0, 9), "fusion.2{1}": (3, 5)}
    assert live.alive_at_peak("param") and not live.alive_at_peak("nothing")
    with pytest.raises(AnalysisError, match="peak"):
        parse_live_range("HloLiveRange (max 1):\n")


def test_the_json_document_keeps_the_peak(analysis):
    again = shardlint.Analysis.from_json(analysis.to_json())
    assert again.memory == analysis.memory


def test_the_text_names_the_lines_at_the_peak(analysis):
    from shardlint.reports import format_text

    text = format_text(analysis)
    assert "temp at the peak, by the line that made it" in text
    top = peak_lines(analysis.memory.peak_buffers)[0]
    assert str(top.source) in text
