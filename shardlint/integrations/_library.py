"""What every integration says the same way about the library it builds a step from:
the library's error in one line, its stdout chatter kept off shardlint's report, and the
keys closest to a mistyped one."""

from __future__ import annotations

import contextlib
import difflib
import sys


def one_line(error: BaseException, limit: int = 300) -> str:
    """A library's error text on one line, cut at `limit` characters ("" when it has none)."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def quiet():
    """Sends stdout to stderr while a library imports or configures itself (MaxText prints
    its config, transformers and TensorFlow print notes): shardlint's stdout is the report."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def did_you_mean(key: str, valid) -> str:
    """"; did you mean a, b?" with up to three keys close to `key`, or ""."""
    close = difflib.get_close_matches(key, list(valid), n=3)
    return f"; did you mean {', '.join(close)}?" if close else ""
