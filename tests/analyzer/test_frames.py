"""Which frames the text and HTML show: the user's line, via the helper shared by callers."""

from __future__ import annotations

from shardlint.analyzer import Analysis, Collective, Memory, Source
from shardlint._source import frames_text
from shardlint.analyzer.memory._frames import helper_frames

HELPER = Source("maxtext/utils/sharding.py", 128, "maybe_shard_with_name")
WRAPPER = Source("maxtext/layers/moe.py", 1216, "_maybe_shard_with_logical")


def _collective(cid: str, *stack: Source) -> Collective:
    return Collective(id=cid, kind="all-gather", axes=("context",), bytes=1, result_bytes=1,
                      shape="f32[1]", op_path="", source=stack[0], stack=stack)


def test_a_helper_reached_from_several_callers_is_shown_after_the_users_line():
    gate = _collective("a", HELPER, WRAPPER, Source("maxtext/layers/moe.py", 3969, "dense_matmul"))
    other = _collective("b", HELPER, WRAPPER, Source("maxtext/layers/moe.py", 3659, "reshape"))
    plain = _collective("c", Source("model.py", 7, "layer"), Source("train.py", 3, "main"))
    analysis = Analysis(mesh={"context": 4}, memory=Memory.empty(),
                        collectives=(gate, other, plain), findings=(), requested=(),
                        versions={}, partitioner="shardy")
    helpers = helper_frames(analysis)
    assert helpers == {(WRAPPER.file, WRAPPER.line)}  # HELPER only leads into it
    assert frames_text(gate.stack, helpers) == "maxtext/layers/moe.py:3969 via maxtext/utils/sharding.py:128"
    assert frames_text(plain.stack, helpers) == "model.py:7"
    assert frames_text((), helpers, fallback=Source("x.py", 1)) == "x.py:1"
