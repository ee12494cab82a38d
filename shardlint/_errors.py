"""Named exception types. A user mistake raises one of these with the way out in its text;
the CLI turns them into one line and exit code 2."""

from __future__ import annotations

import sys
from typing import Callable


class ShardlintError(Exception):
    """Base of every error shardlint raises on purpose."""


class UsageError(ShardlintError):
    """A command-line argument or target that cannot be used (bad mesh spec, unknown target)."""


class AnalysisError(ShardlintError):
    """The step could not be lowered or compiled as given (arguments, mesh, tracing)."""


class HloParseError(AnalysisError):
    """HLO text that cannot be read: truncated, edited, or printed by an XLA version whose
    text shardlint does not know. Names the line (1-based), a short excerpt of it and what
    was expected there."""

    EXCERPT_CHARS = 120

    def __init__(self, expected: str, found: str | None, line: int | None = None):
        self.expected, self.found, self.line = expected, found, line
        where = f"HLO line {line}" if line is not None else "HLO text"
        super().__init__(f"{where}: expected {expected}; found {_excerpt(found, self.EXCERPT_CHARS)}")


def _excerpt(text: str | None, limit: int) -> str:
    if text is None:
        return "the end of the text"
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


class RewriteError(ShardlintError):
    """A step that cannot be rewritten safely, or whose rewrite changed the numbers."""


class NothingToRewrite(UserWarning):
    """`shardlint.rewrite` found no routed region that loses sharding: the step is unchanged."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's text, without its closing full stop: what a
    message that quotes someone else's error keeps of it."""
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else ""


def exit_code(command: Callable[[], int]) -> int:
    """What a command line returns: `command()`'s exit code; 2 after one line on stderr for
    a ShardlintError (never a traceback); 130 on Ctrl-C."""
    try:
        return command()
    except ShardlintError as e:
        print(f"shardlint: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardlint: interrupted", file=sys.stderr)
        return 130
