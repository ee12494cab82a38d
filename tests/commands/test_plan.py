"""`shardlint plan`: the grid and search words, the search for the longest value that fits,
the engine that runs points in processes of their own, and the command on the built-in
example (simulated CPU devices; a Ray cluster this test starts on loopback, `slow`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from shardlint._errors import UsageError
from shardlint.commands._engine import Engine, Failed
from shardlint.commands._plan import grid_points, grid_values, longest_fitting, next_probe, parse_grid, parse_longest
from support import plan_workers
from support.processes import user_env


def test_grid_words_are_read_as_set_values_are():
    grid = parse_grid(["context=1,2,4", "decoder_block=mixtral,llama2"])
    assert grid_values(grid) == {"context": (1, 2, 4), "decoder_block": ("mixtral", "llama2")}
    assert len(grid_points(grid)) == 6
    assert grid_points(grid)[1] == {"context": 1, "decoder_block": "llama2"}


def test_tied_grid_keys_move_together():
    """One sequence per FSDP shard: the batch per device falls as the context degree grows."""
    grid = parse_grid(["ici_context_parallelism:per_device_batch_size=1:1,4:0.25", "layers=1,2"])
    assert grid_values(grid) == {"ici_context_parallelism": (1, 4), "per_device_batch_size": (1, 0.25),
                                 "layers": (1, 2)}
    assert grid_points(grid) == [
        {"ici_context_parallelism": 1, "per_device_batch_size": 1, "layers": 1},
        {"ici_context_parallelism": 1, "per_device_batch_size": 1, "layers": 2},
        {"ici_context_parallelism": 4, "per_device_batch_size": 0.25, "layers": 1},
        {"ici_context_parallelism": 4, "per_device_batch_size": 0.25, "layers": 2}]


@pytest.mark.parametrize("words, says", [
    (["context"], "write KEY=v1,v2"), (["context=1,2", "context=4"], "given twice"),
    (["context=1,1"], "repeats a value"), (["1x=2"], "write KEY=v1,v2"),
    (["context:batch=1:2,4"], "give each point 2 values"), (["context:context=1:1"], "given twice"),
    (["context=1,2", "batch:context=1:1"], "given twice")])
def test_a_grid_word_that_cannot_be_read_says_how_to_write_it(words, says):
    with pytest.raises(UsageError, match=says):
        parse_grid(words)


def test_longest_words():
    assert parse_longest("max_target_length=4096..262144") == ("max_target_length", 4096, 262144, 1024)
    assert parse_longest("seq=64..1024") == ("seq", 64, 1024, 64)
    assert parse_longest("seq=64..1024:32") == ("seq", 64, 1024, 32)
    for bad in ("seq=64", "seq=128..64", "seq=0..64"):
        with pytest.raises(UsageError):
            parse_longest(bad)


def _search(limit, lo, hi, step, broken=None, need=None):
    """The search against a step that fits up to `limit` (and cannot be compiled at
    `broken`): the longest value found and the values compiled, in order. With `need` (a
    function of the value, in bytes) the search is told each compile's need against a
    limit of `need(limit)`."""
    fits: dict = {}
    needs: dict = {}
    while (value := next_probe(fits, lo, hi, step, needs if need else None,
                               need(limit) if need else None)) is not None:
        fits[value] = None if value == broken else value <= limit
        if need:
            needs[value] = need(value)
    return longest_fitting(fits), list(fits)


@pytest.mark.parametrize("limit", [4096, 5000, 36_999, 131_072, 200_000, 262_144, 10**6])
def test_the_search_finds_the_longest_multiple_of_the_step_that_fits(limit):
    found, tried = _search(limit, 4096, 262_144, 1024)
    assert found == min(limit, 262_144) // 1024 * 1024
    assert len(tried) <= 7 + 8, tried        # doubling up to 64x, then halving a gap of <= 128 steps


@pytest.mark.parametrize("limit", [4096, 5000, 36_999, 131_072, 200_000, 262_144, 10**6])
def test_with_the_needs_the_search_finds_the_same_value_in_four_or_five_compiles(limit):
    """Memory that grows linearly with the sequence (a fixed part, then bytes per token):
    the line through two compiles' needs says where the limit is."""
    found, tried = _search(limit, 4096, 262_144, 1024, need=lambda v: 3 * 2**30 + 40_000 * v)
    assert found == min(limit, 262_144) // 1024 * 1024
    assert len(tried) <= 5, tried
    assert _search(limit, 4096, 262_144, 1024)[0] == found     # as without them


@pytest.mark.parametrize("limit", [36_999, 131_072, 200_000])
@pytest.mark.parametrize("need", [lambda v: v * v, lambda v: 2**40 - (300_000 - v) ** 2, lambda v: v // 4096])
def test_where_the_need_is_not_a_line_the_search_still_finds_the_value_and_halves_when_it_stalls(limit, need):
    """Quadratic (attention without flash), concave, and a staircase (XLA's buffers in
    blocks): the line misses; halving the gap when it stalls keeps the search as short as
    without the needs, near enough."""
    found, tried = _search(limit, 4096, 262_144, 1024, need=need)
    assert found == limit // 1024 * 1024
    assert len(tried) <= 7 + 8 + 2, tried


def test_the_search_says_none_where_the_first_value_does_not_fit_and_stops_at_an_error():
    assert _search(1000, 4096, 262_144, 1024) == (None, [4096])
    found, tried = _search(10**6, 4096, 262_144, 1024, broken=16384)
    assert (found, tried) == (8192, [4096, 8192, 16384])


def test_the_engine_runs_each_point_in_a_process_of_its_own_in_order():
    lines = []
    found = Engine(jobs=2, progress=lines.append).map(plan_workers.pid_and_spec, ["a", "b", "c"])
    assert [spec for _, spec, _ in found] == ["a", "b", "c"]
    pids = {pid for pid, _, _ in found}
    assert os.getpid() not in pids and len(pids) == 3
    assert {allowed for _, _, allowed in found} == {"1"}   # libtpu may load in each
    assert len(lines) == 3 and lines[-1].startswith("[3/3] ")


@pytest.mark.parametrize("jobs", [0, 2])
def test_each_point_is_heard_as_it_ends(jobs):
    """`on_done(index, result)` for every point, as it ends (the plan's cache keeps each then,
    so a stop in a round keeps what finished), failed ones too."""
    heard = {}
    found = Engine(jobs=jobs).map(plan_workers.raises if jobs else plan_workers.pid_and_spec, ["a", "b"],
                                  on_done=heard.__setitem__)
    assert heard == dict(enumerate(found)) and len(heard) == 2


def test_a_point_that_raises_or_whose_process_dies_fails_alone():
    engine = Engine(jobs=2)
    raised, = engine.map(plan_workers.raises, ["p"])
    assert raised == Failed("ValueError: no point at p")
    died, fine = engine.map(plan_workers.dies, ["x"]) + engine.map(plan_workers.pid_and_spec, ["y"])
    assert isinstance(died, Failed) and "ended with code 9" in died.why
    assert fine[1] == "y"


def _plan(tmp_path, *words, check=True):
    done = subprocess.run([sys.executable, "-m", "shardlint", "plan", "shardlint.examples.decoder:make_step",
                           "--mesh", "data=2,context=4", "--set", "layers=1", *words],
                          cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=900)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


# Limits of the one-layer example decoder at seq 64 (8 simulated CPU devices, JAX 0.10.2):
# before the fix 3.93 / 3.74 MiB at context 2 / 4, after 1.46 / 0.84 MiB; twice the sequence
# needs about twice the memory before, and fits 5 MiB after.
LIMIT = ["--hbm-gib", "0.0049"]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("plan")
    done = _plan(tmp_path, "--grid", "context=2,4", "--longest", "seq=64..128:64", *LIMIT,
                 "--jobs", "2", "--json", "plan.json", "--out", "plan.html")
    return done, json.loads((tmp_path / "plan.json").read_text()), (tmp_path / "plan.html").read_text()


def test_the_plan_finds_the_longest_sequence_before_and_after_the_fix(searched):
    done, doc, _ = searched
    assert doc["schema"] == "shardlint.plan/1"
    assert doc["grid"] == {"context": [2, 4]} and doc["longest"] == {"key": "seq", "lo": 64, "hi": 128, "step": 64}
    rows = {row["grid"]["context"]: row["longest"] for row in doc["rows"]}
    for context, row in rows.items():
        assert (row["before"], row["after"]) == (64, 128), context
        at_128 = next(t for t in row["tried"] if t["values"]["seq"] == 128)
        assert not at_128["before"]["fits"] and at_128["after"]["fits"]
        assert at_128["after"]["need_bytes"] < at_128["before"]["need_bytes"]
        assert at_128["regions"] >= 1
    assert doc["best"]["row"] in (0, 1) and "fits after the fix" in doc["best"]["rule"]
    # each point's process says how much memory its compiles took: JAX's own start takes
    # more than 128 MiB, and no process holds more than the machine has
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for row in rows.values():
        assert all(2**27 < t["host_peak_bytes"] < memory for t in row["tried"]), row["tried"]
    table = done.stdout.splitlines()
    assert table[0].split()[:3] == ["context", "longest", "seq"]
    assert sum(line.startswith("* ") for line in table) == 1
    assert "[1/2]" in done.stderr and "left" in done.stderr


def test_a_written_plan_reads_back_as_the_same_records(searched, tmp_path):
    from shardlint.reports import format_plan, read_plan_json, write_plan_json

    done, doc, _ = searched
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    plan = read_plan_json(str(path))
    assert json.loads(json.dumps(plan.to_json())) == doc
    assert format_plan(plan) + "\n" == done.stdout
    write_plan_json(plan, str(tmp_path / "again.json"))
    assert json.loads((tmp_path / "again.json").read_text()) == doc


def test_a_repeated_point_is_read_from_the_cache_not_compiled_again(tmp_path):
    """`--cache DIR`: a second plan whose grid shares a point with the first reads that
    point back (the same row) and compiles only the new one, which it keeps beside it."""
    words = ["--hbm-gib", "1", "--cache", "points"]
    first = _plan(tmp_path, "--grid", "context=4", *words, "--json", "first.json")
    assert "[1/1]" in first.stderr and len(list((tmp_path / "points").iterdir())) == 1
    again = _plan(tmp_path, "--grid", "context=2,4", *words, "--json", "again.json")
    assert again.stderr.count("compiled before, read from") == 1 and "[1/1] context=2" in again.stderr
    assert len(list((tmp_path / "points").iterdir())) == 2
    rows = [json.loads((tmp_path / name).read_text())["rows"] for name in ("first.json", "again.json")]
    assert rows[1][1] == rows[0][0]


def test_the_plan_page_has_the_table_and_the_chart(searched):
    _, doc, page = searched
    assert page.count('<tr class="') == len(doc["rows"]) and 'data-best="1"' in page
    assert '<svg class="chart"' in page and "longest seq against context" in page


@pytest.mark.parametrize("words, says", [
    ([], "give at least one --grid"), (["--grid", "context=2"], "--topology NAME"),
    (["--grid", "layers=1,2", "--hbm-gib", "1"], "--grid layers=... and --set layers=...")])
def test_a_plan_the_command_line_cannot_run_is_one_line(tmp_path, words, says):
    done = _plan(tmp_path, *words, check=False)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_ray_cluster_gives_the_same_table_as_local_processes(tmp_path):
    pytest.importorskip("ray", reason="pip install 'shardlint[ray]'")
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = user_env(RAY_USAGE_STATS_ENABLED="0")
    subprocess.run([ray, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    "--node-ip-address=127.0.0.1"], env=env, check=True, capture_output=True, timeout=300)
    try:
        words = ["--grid", "context=2,4", "--hbm-gib", "0.05"]
        _plan(tmp_path, *words, "--ray", f"127.0.0.1:{port}", "--json", "ray.json")
        _plan(tmp_path, *words, "--jobs", "2", "--json", "local.json")
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=300)
    on_ray, local = (json.loads((tmp_path / f).read_text()) for f in ("ray.json", "local.json"))
    assert on_ray == local and len(local["rows"]) == 2


SLOW_TARGET = '''import os
import time


def make_step(mesh):
    with open("pids", "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    time.sleep(600)
'''


def _ended(pid: int) -> bool:
    """Gone, or a zombie waiting for its new parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_ctrl_c_ends_the_plan_and_the_processes_of_its_points(tmp_path):
    import signal
    import time

    (tmp_path / "slow.py").write_text(SLOW_TARGET)
    plan = subprocess.Popen([sys.executable, "-m", "shardlint", "plan", "slow.py:make_step", "--mesh", "data=2",
                             "--grid", "data=1,2", "--hbm-gib", "1", "--jobs", "2", "--json", "plan.json"],
                            cwd=tmp_path, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids_file, deadline = tmp_path / "pids", time.monotonic() + 240
    while not (pids_file.exists() and len(pids_file.read_text().split()) == 2) and time.monotonic() < deadline:
        assert plan.poll() is None, plan.communicate()[1][-2000:]
        time.sleep(0.2)
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2
    plan.send_signal(signal.SIGINT)    # to the command alone, not its process group
    _, err = plan.communicate(timeout=60)
    assert plan.returncode == 130 and "shardlint: interrupted" in err
    assert not (tmp_path / "plan.json").exists()
    deadline = time.monotonic() + 30
    while not all(_ended(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_ended(pid) for pid in pids), pids
