"""JAX's private API is reached from one module only: `shardlint/_jax.py`.

A JAX upgrade then has one place to look. The check reads every module of the package
as text, so it fails the moment a `jax._src` import (or attribute path) appears anywhere
else.
"""

from __future__ import annotations

from pathlib import Path

import shardlint

PACKAGE = Path(shardlint.__file__).parent


def test_jax_private_api_lives_in_one_module():
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{number}"
                 for path in sorted(PACKAGE.rglob("*.py")) if path.name != "_jax.py" or path.parent != PACKAGE
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if "jax._src" in line]
    assert offenders == [], "jax._src outside shardlint/_jax.py: " + ", ".join(offenders)


def test_the_check_sees_the_package():
    assert (PACKAGE / "_jax.py").read_text().count("jax._src") > 3
    assert len(list(PACKAGE.rglob("*.py"))) > 40
