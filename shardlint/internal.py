"""The one seam between shardlint's packages: what a package lends the others beyond its
public face (equinox's `internal` idiom). Not part of the user API; names may change.

A package reaches another through that package's `__init__` or through this module, never
through another package's private module (`tests/test_package_seams.py` fails on such an
import). Each name loads its module on first use, so a package importing from here pulls
in only what it names, and no import cycle can run through this module.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the private module that defines it
_LENT = {
    # gate: what the check command words and records
    "mesh_text": "shardlint.gate._compare",
    "record": "shardlint.gate._gate",
    "headline": "shardlint.gate._wording",
    # moe: which reference layer a sharded one serves (the rewrite's swap route)
    "served_by": "shardlint.moe._reference",
}

__all__ = sorted(_LENT)

def __getattr__(name: str) -> Any:
    if name not in _LENT:
        raise AttributeError(f"module 'shardlint.internal' lends no {name!r}")
    value = getattr(importlib.import_module(_LENT[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
