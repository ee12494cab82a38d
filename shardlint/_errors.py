"""Named exception types. A user mistake raises one of these with the way out in its text;
the CLI turns them into one line and exit code 2."""

from __future__ import annotations

import sys
import traceback
from typing import Callable

from . import _interrupt


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


def shardlint_bug(doing: str, error: BaseException, where: str = "") -> RewriteError:
    """An exception raised in shardlint's own rewrite code, said as shardlint's bug: what it
    was `doing` (the op and line it worked on), the error, and `where` it was raised."""
    return RewriteError(f"shardlint failed {doing}: {type(error).__name__}: {first_line(error)}{where}. The "
                        "step is left as it is; this is a bug of shardlint's: report it with this message "
                        "and what --traceback prints")


def exit_code(command: Callable[[], int], *, show_traceback: bool = False) -> int:
    """What a command line returns: `command()`'s exit code; 2 after one line on stderr for
    a ShardlintError (never a traceback, unless `show_traceback`: then the whole of it after
    the line); 130 on Ctrl-C, after removing what the run registered (`_interrupt`)."""
    try:
        return command()
    except ShardlintError as e:
        # The hint where the cause's frames say more than the line: not where the operating
        # system refused a file (the line names the file and why) or shardlint said it.
        raised_elsewhere = e.__cause__ is not None and not isinstance(e.__cause__, (ShardlintError, OSError))
        hint = " (--traceback shows the whole traceback)" if raised_elsewhere and not show_traceback else ""
        print(f"shardlint: error: {e}{hint}", file=sys.stderr)
        if show_traceback:
            traceback.print_exception(e, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _interrupt.remove_registered()
        print("shardlint: interrupted", file=sys.stderr)
        return _interrupt.INTERRUPTED
    finally:
        _interrupt.forget_all()
