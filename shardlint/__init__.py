"""shardlint: find where XLA loses the sharding of a JAX step, fix the routed-MoE case,
and keep it fixed in CI. This module only re-exports the public face.

The re-exports that pull in JAX load on first use: shardlint's pytest plugin is imported
by every pytest session in an environment where shardlint is installed, and a session
that never analyzes a step should not pay for importing JAX.
"""

from __future__ import annotations

import importlib

from ._errors import AnalysisError as AnalysisError
from ._errors import HloParseError as HloParseError
from ._errors import NothingToRewrite as NothingToRewrite
from ._errors import RewriteError as RewriteError
from ._errors import ShardlintError as ShardlintError
from ._errors import UsageError as UsageError

__version__ = "0.1.0"

_LAZY = {
    "Analysis": ("shardlint.analyzer", "Analysis"),
    "analyze": ("shardlint.analyzer", "analyze"),
    "analyze_dump": ("shardlint.analyzer", "analyze_dump"),
    "rewrite": ("shardlint.rewrites", "rewrite"),
    "moe": ("shardlint.moe", None),
    "reports": ("shardlint.reports", None),
    "testing": ("shardlint.testing", None),
    "gate": ("shardlint.gate", None),
    "examples": ("shardlint.examples", None),
}

__all__ = ["AnalysisError", "HloParseError", "NothingToRewrite", "RewriteError", "ShardlintError", "UsageError", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'shardlint' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
