"""Named exception types. A user mistake raises one of these with the way out in its text;
the CLI turns them into one line and exit code 2."""

from __future__ import annotations


class ShardlintError(Exception):
    """Base of every error shardlint raises on purpose."""


class UsageError(ShardlintError):
    """A command-line argument or target that cannot be used (bad mesh spec, unknown target)."""


class AnalysisError(ShardlintError):
    """The step could not be lowered or compiled as given (arguments, mesh, tracing)."""


class RewriteError(ShardlintError):
    """A step that cannot be rewritten safely, or whose rewrite changed the numbers."""


class NothingToRewrite(UserWarning):
    """`shardlint.rewrite` found no routed region that loses sharding: the step is unchanged."""
