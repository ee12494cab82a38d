"""What XLA's compiled program gathers, read from an analysis's collectives before any
explanation: for the real-code tests (tests/integrations/test_levanter.py,
test_keras_hub.py), which set their sizes so that the sequence and the flattened token
dimensions have lengths no weight has.

Each of `Analysis.collectives` is one instruction of the partitioned HLO module:
its per-device result shape, the mesh axes of its replica groups and the op name and source
line XLA attached (`xla_op_path`, `xla_source`) are XLA's own; its cause, consumer and user
stack are shardlint's reading, which the tests compare with this.
"""

from __future__ import annotations

import re
from collections import Counter


def direction(collective) -> str:
    """"backward" where XLA's op name is a transposed (VJP) op, "forward" where it is another
    op, "unnamed" where XLA attached none."""
    if not collective.xla_op_path:
        return "unnamed"
    return "backward" if "transpose(" in collective.xla_op_path else "forward"


def activation_gathers(collectives, lengths: set[int]) -> Counter:
    """Of `collectives` (an analysis's, or some of them), the all-gathers whose per-device
    result has a dimension of one of `lengths` (the sequence, the tokens):
    `(shape, axes, direction) -> how many`."""
    return Counter((c.shape, c.axes, direction(c)) for c in collectives
                   if c.kind == "all-gather" and has_length(c, lengths))


def has_length(collective, lengths: set[int]) -> bool:
    """Whether the collective's per-device result has a dimension of one of `lengths`."""
    return bool(lengths & set(_dims(collective.shape)))


def _dims(shape: str) -> list[int]:
    """"f32[4,128,64]" (or a tuple's "f32[..], f32[..]") -> every dimension's length."""
    return [int(d) for group in re.findall(r"\[([\d,]*)\]", shape) for d in group.split(",") if d]
