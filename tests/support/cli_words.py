"""Command-line words for a target's options, as a user types them."""

from __future__ import annotations

import json


def set_words(options: dict) -> list[str]:
    """`{"num_layers": 2, "axes": {"context": 4}}` -> `["--set", "num_layers=2", "--set",
    'axes={"context": 4}']`: strings as they are, other values as JSON."""
    return [w for k, v in options.items() for w in ("--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}")]
