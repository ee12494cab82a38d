"""An op XLA:CPU cannot compile: the expert-parallel layer's `ragged_all_to_all` (public
libraries' default MoE path). The error names the op and the user's line that made it,
and offers the TPU compiler, with its install hint; the offer itself is tested with the
TPU compiler in tests/tpu/test_topology_aot.py."""

from __future__ import annotations

import pytest

import shardlint
from shardlint.cli import main
from shardlint.commands._targets import build_mesh

from support import expert_parallel

DISPATCH = next(i for i, text in enumerate(open(expert_parallel.__file__).read().splitlines(), 1)
                if "<- dispatch" in text) - 1   # the call starts a line above its marker


def test_the_error_names_the_op_its_line_and_the_tpu_compiler():
    fn, args = expert_parallel.make_step(build_mesh({"expert": 4}))
    with pytest.raises(shardlint.AnalysisError) as raised:
        shardlint.analyze(fn, *args)
    message = str(raised.value)
    assert message.startswith("XLA:CPU cannot compile ragged-all-to-all (made at ")
    assert f"support/expert_parallel.py:{DISPATCH})" in message
    assert "--topology v5p:2x2x2" in message and "pip install 'shardlint[tpu]'" in message
    assert "UNIMPLEMENTED" in str(raised.value.__cause__)   # XLA's own words, kept as the cause


def test_the_command_says_it_in_one_line(capsys):
    assert main(["analyze", "support.expert_parallel:make_step", "--mesh", "expert=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("shardlint: error: XLA:CPU cannot compile ragged-all-to-all")
