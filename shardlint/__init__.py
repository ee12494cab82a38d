"""shardlint: find where XLA loses the sharding of a JAX step, fix the routed-MoE case,
and keep it fixed in CI. This module only re-exports the public face."""

from ._errors import AnalysisError as AnalysisError
from ._errors import RewriteError as RewriteError
from ._errors import ShardlintError as ShardlintError
from ._errors import UsageError as UsageError
from .analyzer import Analysis as Analysis
from .analyzer import analyze as analyze
from .rewrites import rewrite as rewrite

__version__ = "0.1.0"
