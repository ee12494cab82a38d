"""The gate's pieces on hand-made analyses: keys, the baseline file, the comparison rules.

No compiles here; the real analyzer is exercised in test_gate_check.py.
"""

from __future__ import annotations

import dataclasses

import json
import os

import pytest

from shardlint import UsageError
from shardlint.analyzer import Analysis, Collective, Finding, Memory, Source
from shardlint.gate import (SCHEMA, BaselineError, CollectiveKey, baseline_of, collective_key, compare, dumps,
                            normalize_op_path, parse_kinds, parse_tolerance, read_baseline,
                            relative_source, write_baseline)

ROOT = "/repo"


def _collective(id, kind="all-gather", axes=("context",), nbytes=6144, line=53,
                op_path="jit(step)/jvp()/reshape", function="routed_moe", shape="f32[2,64,16]"):
    source = Source(f"{ROOT}/model/moe.py", line, function)
    return Collective(id=id, kind=kind, axes=axes, bytes=nbytes, result_bytes=nbytes,
                      shape=shape, op_path=op_path, source=source,
                      xla_op_path=op_path, xla_source=source)


def _analysis(*collectives, findings=(), mesh=None):
    return Analysis(mesh=mesh or {"data": 2, "context": 4}, memory=Memory.empty(),
                    collectives=tuple(collectives), findings=tuple(findings), requested=(),
                    versions={"jax": "0.10.2"}, partitioner="shardy")


@pytest.mark.parametrize("op_path, expected", [
    ("jit(step)/jvp()/reshape", "step/reshape"),
    ("jit(step)/transpose(jvp())/reshape", "step/reshape"),
    ("jit(step)/jvp(jit(argsort))/sort", "step/argsort/sort"),
    # named scopes contain '/' and sit inside the transform wrappers
    ("jit(f)/transpose(jvp(moe/route))/reshape", "f/moe/route/reshape"),
    ("jit(f)/jvp(moe/route)/cos", "f/moe/route/cos"),
    # a collective XLA merged from several ops
    ("jit(step)/(jvp()/reduce_sum:transpose(jvp())/dot_general:transpose(jvp())/gather)",
     "step/(reduce_sum:dot_general:gather)"),
    # user names with parentheses that are not JAX wrappers survive whole
    ("jit(f)/layer(3)/dot_general", "f/layer(3)/dot_general"),
    ("", ""),
])
def test_op_paths_lose_transform_wrappers_only(op_path, expected):
    assert normalize_op_path(op_path) == expected


def test_forward_and_backward_copies_share_a_key():
    fwd = _collective("all-gather", op_path="jit(step)/jvp()/reshape")
    bwd = _collective("all-gather.7", op_path="jit(step)/transpose(jvp())/reshape", line=99)
    assert collective_key(fwd, ROOT) == collective_key(bwd, ROOT)
    assert collective_key(fwd, ROOT) == (
        "all-gather | context | reshape | model/moe.py:routed_moe | f32[2,64,16]")


def test_a_key_reads_back_from_its_text():
    with_source = _collective("all-gather", axes=("data", "context"))
    without = dataclasses.replace(with_source, axes=(), op_path="p", xla_op_path="p", source=None,
                                  xla_source=None)
    for c in (with_source, without):
        key = CollectiveKey.of(c, ROOT)
        assert CollectiveKey.parse(str(key)) == key and str(key) == collective_key(c, ROOT)
    key = CollectiveKey.of(with_source, ROOT)
    assert (key.axes, key.primitive, key.file, key.function) == (
        ("data", "context"), "reshape", "model/moe.py", "routed_moe")
    assert str(CollectiveKey.of(without, ROOT)) == "all-gather | - | - | - | f32[2,64,16]"
    assert CollectiveKey.parse("all-gather | context") is None


def test_the_key_ignores_which_op_the_analysis_attributed_it_to():
    # Attribution moves `op_path`/`source` to a finding's op; the key reads XLA's own label.
    own = _collective("all-gather")
    moved = dataclasses.replace(own, op_path="jit(step)/jvp()/sort",
                                source=Source(f"{ROOT}/model/other.py", 3, "elsewhere"))
    assert collective_key(own, ROOT) == collective_key(moved, ROOT)


def test_relative_source_inside_and_outside_the_root():
    assert relative_source("/repo/a/b.py", "/repo") == "a/b.py"
    assert relative_source("/usr/lib/python3/site-packages/pkg/m.py", "/repo") == "pkg/m.py"
    assert relative_source("/elsewhere/m.py", "/repo") == "m.py"
    assert relative_source("", "/repo") == ""


def test_baseline_document_is_sorted_versioned_and_free_of_lines_and_ids():
    a = _analysis(_collective("all-gather.3", nbytes=10, line=7),
                  _collective("all-gather", nbytes=20, line=9),
                  _collective("all-reduce", kind="all-reduce", axes=("data",), nbytes=4,
                              shape="f32[]", op_path="jit(step)/jvp()/reduce_sum"))
    text = dumps(baseline_of(a, ROOT, target="t"))
    doc = json.loads(text)
    assert doc["schema"] == SCHEMA == "shardlint.baseline/2"
    assert doc["mesh"] == {"data": 2, "context": 4} and doc["jax"] == "0.10.2"
    keys = [e["key"] for e in doc["collectives"]]
    assert keys == sorted(keys) and len(keys) == 2
    gather = doc["collectives"][0]
    assert gather["kind"] == "all-gather" and gather["count"] == 2 and gather["bytes"] == 30
    assert gather["file"] == "model/moe.py"
    assert "all-gather.3" not in text and ":53" not in text and ROOT not in text
    assert text.endswith("\n")


def test_baseline_round_trips_and_update_without_change_leaves_the_file(tmp_path):
    path = str(tmp_path / "sub" / "b.json")
    base = baseline_of(_analysis(_collective("all-gather")), ROOT)
    assert write_baseline(base, path) is True
    assert read_baseline(path) == base
    before = os.stat(path).st_mtime_ns
    assert write_baseline(base, path) is False
    assert os.stat(path).st_mtime_ns == before


def test_interrupted_write_keeps_the_old_baseline_and_no_temporary(tmp_path, monkeypatch):
    path = str(tmp_path / "b.json")
    old = baseline_of(_analysis(_collective("all-gather")), ROOT)
    write_baseline(old, path)
    original = open(path).read()

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    new = baseline_of(_analysis(_collective("all-gather", nbytes=1)), ROOT)
    with pytest.raises(KeyboardInterrupt):
        write_baseline(new, path)
    assert open(path).read() == original
    assert os.listdir(tmp_path) == ["b.json"]


@pytest.mark.parametrize("content, says", [
    (None, "no baseline at"),
    ("{ not json", "not valid JSON"),
    # a hand edit that put a raw tab or line break inside a string: said in words, with where
    ('{"schema": "shardlint.baseline/2", "target": "a\tb"}',
     "is not valid JSON: a control character (a raw tab or line break) inside a string at line 1, column 48;"),
    ('{"schema": "shardlint.baseline/2", "target": "ab', "a string that is never closed at line 1, column 46"),
    ('{"schema": "shardlint.baseline/0", "collectives": []}', "expected 'shardlint.baseline/2'"),
    ('[1, 2]', "has schema None"),
    ('{"schema": "shardlint.baseline/2", "collectives": [{"key": "k"}]}', "damaged"),
    ('{"schema": "shardlint.baseline/2", "collectives": '
     '[{"key": "k", "kind": "all-gather", "count": -1, "bytes": 0}]}', "damaged"),
])
def test_bad_baselines_say_how_to_create_one(tmp_path, content, says):
    path = tmp_path / "b.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BaselineError) as info:
        read_baseline(str(path), how_to_create="shardlint check T --mesh M --update")
    assert says in str(info.value)
    assert "shardlint check T --mesh M --update" in str(info.value)
    assert " at)" not in str(info.value) and " at;" not in str(info.value)   # json's cut-off wording


def _check(before, after, **kw):
    base = baseline_of(_analysis(*before), ROOT)
    return compare(_analysis(*after), base, root=ROOT, **kw)


def test_unchanged_passes_with_no_changes():
    result = _check([_collective("a")], [_collective("b", line=80)])
    assert result.passed and result.changes == ()


def test_new_all_gather_fails_and_carries_its_finding():
    gather = _collective("all-gather.4")
    finding = Finding(kind="lost-sharding", op="reshape", axes=("context",),
                      feeds_grouped_matmul=True, source=gather.source, op_path=gather.op_path,
                      operand_shape="", result_shape="", collectives=("all-gather.4",),
                      bytes=gather.bytes, message="reshape drops context", way_out="shard_map")
    base = baseline_of(_analysis(), ROOT)
    result = compare(_analysis(gather, findings=[finding]), base, root=ROOT)
    assert not result.passed
    (change,) = result.regressions
    assert change.status == "new" and change.findings == (finding,)
    assert change.lines(ROOT) == (("model/moe.py", 53),)


def test_a_second_copy_is_growth_even_within_tolerance():
    result = _check([_collective("a", nbytes=100)],
                    [_collective("a", nbytes=50), _collective("b", nbytes=50)], tolerance=0.5)
    (change,) = result.regressions
    assert change.status == "grown" and (change.count, change.baseline_count) == (2, 1)


def test_byte_growth_is_measured_against_the_tolerance():
    grown = [_collective("a", nbytes=105)]
    assert not _check([_collective("a", nbytes=100)], grown).passed
    assert not _check([_collective("a", nbytes=100)], grown, tolerance=0.04).passed
    assert _check([_collective("a", nbytes=100)], grown, tolerance=0.05).passed


def test_gone_and_shrunk_are_improvements_that_pass():
    result = _check([_collective("a", nbytes=100), _collective("b", axes=("data",), nbytes=8)],
                    [_collective("a", nbytes=60)])
    assert result.passed
    assert sorted(c.status for c in result.improvements) == ["gone", "shrunk"]


def test_only_watched_kinds_can_fail():
    reduce = _collective("r", kind="all-reduce", axes=("data",), op_path="jit(s)/jvp()/x")
    to_all = _collective("t", kind="all-to-all", axes=("data",), op_path="jit(s)/jvp()/y")
    assert _check([], [reduce, to_all]).passed
    result = _check([], [reduce, to_all], kinds=("all-gather", "all-to-all"))
    assert [c.kind for c in result.regressions] == ["all-to-all"]


def test_a_different_mesh_is_noted():
    base = baseline_of(_analysis(mesh={"data": 8}), ROOT)
    result = compare(_analysis(), base, root=ROOT)
    assert any("data=8" in n and "data=2,context=4" in n for n in result.notes())


def test_kinds_and_tolerance_options():
    assert parse_kinds("all-gather, all-to-all") == ("all-gather", "all-to-all")
    assert "collective-permute" in parse_kinds("all")
    with pytest.raises(UsageError, match="all-gathr"):
        parse_kinds("all-gathr")
    assert parse_tolerance("5%") == parse_tolerance("5") == 0.05
    assert parse_tolerance("0%") == 0.0
    for bad in ("-1%", "five", "nan"):
        with pytest.raises(UsageError, match="--tolerance"):
            parse_tolerance(bad)


def test_a_gone_collective_is_described_from_its_key():
    result = _check([_collective("a")], [])
    (change,) = result.improvements
    assert change.status == "gone" and change.collectives == ()
    assert change.axes == ("context",) and change.function == "routed_moe"
    assert change.parts.primitive == "reshape"
    assert str(change.parts) == change.key
