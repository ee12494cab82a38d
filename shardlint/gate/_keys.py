"""Stable keys for collectives, shared by the CI gate and the report's before/after diff.

A key must survive recompiling, unrelated edits and changes to shardlint's own heuristics,
so it is built from the collective's own identity, never from how XLA numbered it or which
op the analysis attributed it to: kind, mesh axes, the JAX primitive XLA labelled it with,
the user's source file (relative to the project root) and enclosing function of the value
it moves (no line number, so inserting lines above the code changes nothing), and the
per-device shape and dtype.

The key is a `CollectiveKey` record; its text (`str()`, the fields joined with " | ", '-'
for an empty one) is what baseline files hold, and `CollectiveKey.parse` reads it back.

Op paths are read by `shardlint._op_paths` (`normalize_op_path`, for display).
"""

from __future__ import annotations

import dataclasses

from .._format import relative_source
from ..analyzer import Collective
from .._op_paths import primitive_of

SEPARATOR = " | "
_NONE = "-"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveKey:
    """A collective's stable identity. The primitive and the source are the collective's
    own (XLA's label, its innermost user frame), not those of the op the analysis
    attributed it to."""

    kind: str                    # all-gather, all-reduce, ...
    axes: tuple[str, ...]        # mesh axes it communicates over
    primitive: str               # the JAX primitive XLA labelled it with ("" when none)
    where: str                   # `file:function` of its source ("" when none)
    shape: str                   # per-device result, e.g. "f32[2,64,16]"

    @classmethod
    def of(cls, collective: Collective, root: str = ".") -> CollectiveKey:
        src = collective.xla_source or collective.source
        return cls(kind=collective.kind, axes=tuple(collective.axes),
                   primitive=primitive_of(collective.xla_op_path),
                   where=f"{relative_source(src.file, root)}:{src.function}" if src else "",
                   shape=collective.shape)

    @classmethod
    def parse(cls, text: str) -> CollectiveKey | None:
        """The key `text` spells (None if it has another form): for describing a
        collective that only the baseline still knows."""
        parts = text.split(SEPARATOR)
        if len(parts) != 5:
            return None
        kind, axes, primitive, where, shape = parts
        return cls(kind=kind, axes=() if axes == _NONE else tuple(axes.split(",")),
                   primitive="" if primitive == _NONE else primitive,
                   where="" if where == _NONE else where, shape=shape)

    @property
    def file(self) -> str:
        """The source file relative to the project root ("" when XLA gave none)."""
        return self.where.rpartition(":")[0]

    @property
    def function(self) -> str:
        return self.where.rpartition(":")[2]

    def __str__(self) -> str:
        return SEPARATOR.join((self.kind, ",".join(self.axes) or _NONE, self.primitive or _NONE,
                               self.where or _NONE, self.shape))


def collective_key(collective: Collective, root: str = ".") -> str:
    """The text of the collective's key, as baseline files hold it."""
    return str(CollectiveKey.of(collective, root))
