"""Ctrl-C: exit 130 with one line, at any point of a run (XLA compiling in its own threads
included), and nothing left behind: no partial report or JSON, no output folder the run
made, no temporary folder.

Each case starts the CLI as a user does, waits for a progress line, lets the run go on a
little and sends SIGINT. Before this was fixed the process printed `shardlint: interrupted`
and then crashed in teardown (exit 139, SIGSEGV) whenever the interrupt came mid-compile:
XLA's compile threads were still running when the interpreter finalized.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support.processes import user_env

HEAVY = f"{Path(__file__).parents[1] / 'support' / 'compile_heavy.py'}:make_step"
MESH = ("--mesh", "data=2,context=4")


def interrupted(argv: list[str], after: str, delay: float, tmp_path: Path, nth: int = 1,
                timeout: float = 300) -> tuple[int, str, list[str]]:
    """Runs `shardlint ARGV`, sends SIGINT `delay` seconds after the `nth` progress line
    holding `after`; returns (exit code, stderr, what is left in its TMPDIR, a folder of
    its own)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "shardlint.cli", *argv], cwd=tmp_path,
                            env=user_env(TMPDIR=str(tmp)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    sent = threading.Event()

    def read():
        seen = 0
        for line in proc.stderr:
            lines.append(line)
            if after in line and not sent.is_set():
                seen += 1
                if seen == nth:
                    time.sleep(delay)
                    proc.send_signal(signal.SIGINT)
                    sent.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    finally:
        proc.kill()
    reader.join(timeout=10)
    err = "".join(lines)
    assert sent.is_set(), f"no progress line with {after!r} came:\n{err}"
    return code, err, sorted(p.name for p in tmp.iterdir())


def _assert_clean_interrupt(code: int, err: str, left: list[str]) -> None:
    assert code == 130, f"exit {code}:\n{err[-3000:]}"
    assert err.rstrip().splitlines()[-1] == "shardlint: interrupted"
    assert "Traceback" not in err
    assert not left, f"left in TMPDIR: {left}"


def test_ctrl_c_mid_compile_exits_130_and_writes_nothing(tmp_path):
    out, data = tmp_path / "out" / "report.html", tmp_path / "out" / "data.json"
    out.parent.mkdir()
    code, err, left = interrupted(["report", HEAVY, *MESH, "--set", "layers=12", "--out", str(out),
                             "--json", str(data)], "compiling for", 1.0, tmp_path)
    _assert_clean_interrupt(code, err, left)
    assert not list(out.parent.iterdir())


def test_ctrl_c_on_the_demo_leaves_no_folder(tmp_path):
    code, err, left = interrupted(["demo", "--out", "demo-out"], "compiling for", 0.5, tmp_path)
    _assert_clean_interrupt(code, err, left)
    assert not (tmp_path / "demo-out").exists()


# (progress line, which one, seconds after it): tracing, the first compile early and late,
# reading XLA's texts, the rewrite, its verification, the second compile, the second read.
POINTS = [("tracing", 1, 0.2), ("compiling for", 1, 0.2), ("compiling for", 1, 1.5),
          ("compiling for", 1, 3.0), ("reading XLA", 1, 0.1), ("rewrote", 1, 0.0),
          ("verifying", 1, 1.0), ("analyzing the rewritten", 1, 0.0), ("compiling for", 2, 1.0),
          ("reading XLA", 2, 0.2)]


@pytest.mark.slow
@pytest.mark.parametrize("after, nth, delay", POINTS, ids=[f"{a}-{n}-{d}" for a, n, d in POINTS])
def test_ctrl_c_at_each_point_of_a_report(tmp_path, after, nth, delay):
    out = tmp_path / "out"
    out.mkdir()
    code, err, left = interrupted(["report", HEAVY, *MESH, "--set", "layers=12", "--out",
                             str(out / "report.html"), "--json", str(out / "data.json")],
                            after, delay, tmp_path, nth=nth)
    _assert_clean_interrupt(code, err, left)
    assert not list(out.iterdir())
