"""Stable keys for collectives, shared by the CI gate and the report's before/after diff.

A key must survive recompiling and unrelated edits, so it is built from what the program
means, not from how XLA numbered it: kind, mesh axes, the op path with JAX's transform
wrappers removed (`jit(step)/transpose(jvp())/reshape` -> `step/reshape`), the source file
relative to the project root plus the enclosing function (no line number), and the
per-device shape and dtype.
"""

from __future__ import annotations

import os
import re

from ..analyzer import Collective

# JAX wraps op names in the transformations that produced them; these carry no identity.
_WRAPPERS = ("jvp", "transpose", "vmap", "remat", "checkpoint", "custom_jvp_call",
             "custom_vjp_call", "custom_vjp_call_jaxpr", "pjit", "jit", "shard_map", "xla_call",
             "named_call", "core_call", "remat2", "rematted_computation", "cond", "while",
             "scan", "body", "checkpoint_name", "vmap_jvp")
_WRAPPER_RE = re.compile(r"\b(" + "|".join(_WRAPPERS) + r")\(([^()]*)\)")


def normalize_op_path(op_path: str) -> str:
    parts = []
    for part in op_path.split("/"):
        previous = None
        while previous != part:
            previous = part
            part = _WRAPPER_RE.sub(lambda m: m.group(2), part)
        part = part.strip("()")
        if part:
            parts.append(part)
    return "/".join(parts)


def relative_source(file: str, root: str) -> str:
    if not file:
        return ""
    absolute = os.path.abspath(file)
    root = os.path.abspath(root)
    if absolute == root or absolute.startswith(root + os.sep):
        return os.path.relpath(absolute, root).replace(os.sep, "/")
    marker = f"site-packages{os.sep}"
    if marker in absolute:
        return absolute.split(marker, 1)[1].replace(os.sep, "/")
    return os.path.basename(absolute)


def collective_key(collective: Collective, root: str = ".") -> str:
    src = collective.source
    where = f"{relative_source(src.file, root)}:{src.function}" if src else "-"
    return " | ".join((collective.kind, ",".join(collective.axes) or "-",
                       normalize_op_path(collective.op_path) or "-", where, collective.shape))
