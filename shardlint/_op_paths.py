"""JAX op paths: the one reader of the names JAX gives ops (`op_name` in XLA's metadata).

`jit(step)/transpose(jvp(layer_0))/moe/route/top_k` says which jitted function, which named
scopes or modules (`jax.named_scope`, Flax module paths), whether the op belongs to the
backward pass (`transpose(...)`), and the primitive. `normalize_op_path` removes JAX's
transform wrappers (`jit(step)/transpose(jvp())/reshape` -> `step/reshape`); `scope_of`
says where in the model an op sits and in which direction.

Named scopes may contain '/' and sit inside a wrapper (`transpose(jvp(moe/route))`), so
wrappers are removed from the whole path before it is split. XLA names a collective that
it merged from several ops (a tuple all-reduce of gradients) `prefix/(a/op1:b/op2)`; each
member is normalised on its own, giving `step/(op1:op2)`.

A leaf beside `_vocab` (it imports nothing of shardlint's): the analyzer, the gate and the
reports read op paths through it alike.
"""

from __future__ import annotations

import re

# JAX wraps op names in the transformations that produced them; these carry no identity.
_WRAPPERS = ("jvp", "transpose", "vmap", "remat", "checkpoint", "custom_jvp_call",
             "custom_vjp_call", "custom_vjp_call_jaxpr", "pjit", "jit", "shard_map", "xla_call",
             "named_call", "core_call", "remat2", "rematted_computation", "cond", "while",
             "scan", "body", "checkpoint_name", "vmap_jvp")
_WRAPPER_RE = re.compile(r"\b(" + "|".join(_WRAPPERS) + r")\(([^()]*)\)")

FORWARD, BACKWARD = "forward", "backward"


def is_backward(op_path: str) -> bool:
    """The op belongs to the backward pass: its path runs under `transpose(...)`. XLA joins
    the names of ops it merged with ';' (JAX 0.12): the first one decides."""
    return "transpose(" in op_path.split(";", 1)[0]


def members_of(op_path: str) -> tuple[str, ...]:
    """The op paths a collective's name stands for: XLA names one it merged from several
    `prefix/(a/op1:b/op2)` -> (`prefix/a/op1`, `prefix/b/op2`), and joins merged names with
    ';' (JAX 0.12); any other path stands for itself."""
    found = []
    for name in op_path.split(";"):
        prefix, _, rest = name.partition("/(")
        if rest.endswith(")") and _balanced(rest[:-1]):
            found += [f"{prefix}/{m}" for m in _split_top_level(rest[:-1], ":")]
        else:
            found.append(name)
    return tuple(found)


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


def scope_of(op_path: str) -> tuple[str, tuple[str, ...]]:
    """(direction, scope): `jit(step)/transpose(jvp(layer_0))/moe/route/top_k` ->
    (`backward`, (`layer_0`, `moe`, `route`)). The jitted function's name and the primitive
    are not scopes, nor an einsum's spec (`bsd,dhk->bshk`); a merged collective (one tuple
    op from several) has no single scope: ()."""
    direction = BACKWARD if is_backward(op_path) else FORWARD
    parts = _split_top_level(normalize_op_path(op_path), "/")
    if len(parts) < 3 or any(p.startswith("(") for p in parts):
        return direction, ()
    return direction, tuple(p for p in parts[1:-1] if "->" not in p and "," not in p)


def primitive_of(op_path: str) -> str:
    """The JAX primitive an op path ends in: `jit(step)/jvp()/scatter-add` -> `scatter-add`.

    XLA joins the names of merged ops with ';' (JAX 0.12): the first one names it. A path
    without '/' is an argument's name (JAX 0.12 labels a gathered argument so): no op."""
    first = op_path.split(";", 1)[0]
    if "/" not in first:
        return ""
    last = first.rsplit("/", 1)[1]
    return last.split("(", 1)[0].strip(")") or last


def transform_of(op_path: str) -> str:
    """The transformations an op path's op ran under: `jit(step)/transpose(jvp())/mul` ->
    `jit(step)/transpose(jvp())`. XLA joins the names of ops it merged with ';' (JAX 0.12):
    the first one decides."""
    first = op_path.split(";", 1)[0]
    return first.rsplit("/", 1)[0] if "/" in first else ""
