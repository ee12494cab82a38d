"""Stable keys for collectives, shared by the CI gate and the report's before/after diff.

A key must survive recompiling, unrelated edits and changes to shardlint's own heuristics,
so it is built from the collective's own identity, never from how XLA numbered it or which
op the analysis attributed it to: kind, mesh axes, the JAX primitive XLA labelled it with,
the user's source file (relative to the project root) and enclosing function of the value
it moves (no line number, so inserting lines above the code changes nothing), and the
per-device shape and dtype.

Op paths are read by `analyzer._op_paths` (`normalize_op_path`, for display).
"""

from __future__ import annotations


from ..analyzer import Collective
from .._format import relative_source
from ..analyzer._collectives import primitive_of

SEPARATOR = " | "


def key_parts(collective: Collective, root: str = ".") -> tuple[str, str, str, str, str]:
    """(kind, axes, XLA's primitive, `file:function`, per-device shape); '-' when empty.

    The primitive and the source are the collective's own (XLA's label, its innermost user
    frame), not those of the op the analysis attributed it to."""
    src = collective.xla_source or collective.source
    where = f"{relative_source(src.file, root)}:{src.function}" if src else "-"
    return (collective.kind, ",".join(collective.axes) or "-",
            primitive_of(collective.xla_op_path) or "-", where, collective.shape)


def collective_key(collective: Collective, root: str = ".") -> str:
    return SEPARATOR.join(key_parts(collective, root))


def split_key(key: str) -> tuple[str, str, str, str, str] | None:
    """The inverse of `collective_key` (None if `key` has another form), for describing a
    collective that only the baseline still knows."""
    parts = key.split(SEPARATOR)
    return tuple(parts) if len(parts) == 5 else None
