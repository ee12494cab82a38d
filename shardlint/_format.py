"""How shardlint writes numbers and places for people, and its progress lines: one leaf
module, imported by the analyzer, the reports, the gate and the commands alike (it imports
nothing of shardlint's)."""

from __future__ import annotations

import os
import sys


def human_bytes(n: float | None) -> str:
    """`1.50 MiB`: the largest binary unit that keeps the number at least 1; `-` for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def clip(text: str, n: int) -> str:
    """`text` cut to `n` characters, the last one an ellipsis when cut."""
    return text if len(text) <= n else text[: n - 1] + "…"


def relative_source(file: str, root: str) -> str:
    """A source file as a project sees it: relative to `root` when under it, else its
    path inside site-packages, else its name (paths the analysis already made relative
    stay as they are)."""
    if not file:
        return ""
    if not os.path.isabs(file):
        return file.replace(os.sep, "/")
    absolute = os.path.abspath(file)
    root = os.path.abspath(root)
    if absolute == root or absolute.startswith(root + os.sep):
        return os.path.relpath(absolute, root).replace(os.sep, "/")
    marker = f"site-packages{os.sep}"
    if marker in absolute:
        return absolute.split(marker, 1)[1].replace(os.sep, "/")
    return os.path.basename(absolute)


def source_text(source, root: str = ".") -> str:
    """`file:line` of a Source (relative as `relative_source` makes it), or `-`."""
    if source is None:
        return "-"
    return f"{relative_source(source.file, root)}:{source.line}"


def progress(message: str) -> None:
    """One progress line on stderr, as every shardlint command and harness writes them."""
    print(f"shardlint: {message}", file=sys.stderr, flush=True)
