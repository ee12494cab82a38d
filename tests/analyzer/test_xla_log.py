"""XLA's "Involuntary full rematerialization" messages: caught on C++ stderr, made findings."""

from __future__ import annotations

import shardlint
from shardlint.analyzer.compile._xla_log import captured_stderr, involuntary_rematerializations

from support.collective_steps import make_remat_step, marker_line


def test_a_reshape_xla_must_replicate_is_a_finding_and_stays_off_the_terminal(capfd, mesh):
    fn, args = make_remat_step(mesh)
    analysis = shardlint.analyze(fn, *args)
    [finding] = [f for f in analysis.findings if f.kind == "full-rematerialization"]
    assert finding.cause == "lost" and finding.op == "reshape"
    assert finding.source.file.endswith("collective_steps.py")
    assert finding.source.line == marker_line("remat reshape")
    assert finding.operand_shape.startswith("{devices=") and finding.result_shape.startswith("{devices=")
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


def test_other_cxx_stderr_lines_pass_through(capfd):
    import os

    with captured_stderr() as log:
        os.write(2, b"an unrelated XLA warning\n")
    assert "an unrelated XLA warning" in log.text
    assert "an unrelated XLA warning" in capfd.readouterr().err
    assert involuntary_rematerializations(log.text) == ()
