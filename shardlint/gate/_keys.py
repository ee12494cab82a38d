"""Stable keys for collectives, shared by the CI gate and the report's before/after diff.

A key must survive recompiling, unrelated edits and changes to shardlint's own heuristics,
so it is built from the collective's own identity, never from how XLA numbered it or which
op the analysis attributed it to: kind, mesh axes, the JAX primitive XLA labelled it with,
the user's source file (relative to the project root) and enclosing function of the value
it moves (no line number, so inserting lines above the code changes nothing), and the
per-device shape and dtype.

`normalize_op_path` (for display) removes JAX's transform wrappers from an op path
(`jit(step)/transpose(jvp())/reshape` -> `step/reshape`).

Named scopes may contain '/' and sit inside a wrapper (`transpose(jvp(moe/route))`), so
wrappers are removed from the whole path before it is split. XLA names a collective that
it merged from several ops (a tuple all-reduce of gradients) `prefix/(a/op1:b/op2)`; each
member is normalised on its own, giving `step/(op1:op2)`.
"""

from __future__ import annotations

import os
import re

from ..analyzer import Collective
from ..analyzer._collectives import primitive_of

# JAX wraps op names in the transformations that produced them; these carry no identity.
_WRAPPERS = ("jvp", "transpose", "vmap", "remat", "checkpoint", "custom_jvp_call",
             "custom_vjp_call", "custom_vjp_call_jaxpr", "pjit", "jit", "shard_map", "xla_call",
             "named_call", "core_call", "remat2", "rematted_computation", "cond", "while",
             "scan", "body", "checkpoint_name", "vmap_jvp")
_WRAPPER_RE = re.compile(r"\b(" + "|".join(_WRAPPERS) + r")\(([^()]*)\)")

SEPARATOR = " | "


def normalize_op_path(op_path: str) -> str:
    """`jit(step)/transpose(jvp(moe/route))/reshape` -> `step/moe/route/reshape`."""
    text, previous = op_path, None
    while previous != text:  # innermost wrapper first; scopes inside may contain '/'
        previous = text
        text = _WRAPPER_RE.sub(lambda m: m.group(2), text)
    return _join_path(text)


def _join_path(text: str) -> str:
    parts = []
    for part in _split_top_level(text, "/"):
        part = part.strip()
        if part.startswith("(") and part.endswith(")") and _balanced(part[1:-1]):
            members = [m for m in (_join_path(m) for m in _split_top_level(part[1:-1], ":")) if m]
            part = "(" + ":".join(members) + ")" if len(members) > 1 else "".join(members)
        if part:
            parts.append(part)
    return "/".join(parts)


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth < 0:
            return False
    return depth == 0


def _split_top_level(text: str, sep: str) -> list[str]:
    """Splits on `sep` outside parentheses: `a(b:c):d` -> [`a(b:c)`, `d`]."""
    pieces, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == sep and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    pieces.append(text[start:])
    return pieces


def relative_source(file: str, root: str) -> str:
    if not file:
        return ""
    if not os.path.isabs(file):  # the analysis already made it relative to cwd or sys.path
        return file.replace(os.sep, "/")
    absolute = os.path.abspath(file)
    root = os.path.abspath(root)
    if absolute == root or absolute.startswith(root + os.sep):
        return os.path.relpath(absolute, root).replace(os.sep, "/")
    marker = f"site-packages{os.sep}"
    if marker in absolute:
        return absolute.split(marker, 1)[1].replace(os.sep, "/")
    return os.path.basename(absolute)


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
