"""Packages talk through each other's public `__init__` or through `shardlint.internal`,
never through another package's private module (as tests/test_jax_internals.py keeps
`jax._src` in one module).

Read from the source with `ast`: an import `from ..analyzer._stack import x` (or
`from ..analyzer import _stack`) in shardlint/rewrites fails here. The top-level leaf
modules (`shardlint/_errors.py`, `_vocab.py`, `_jax.py`, ...) belong to every package.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import shardlint
from shardlint import internal

PACKAGE = Path(shardlint.__file__).parent
SEAM = PACKAGE / "internal.py"


def _is_module(parts: list[str]) -> bool:
    path = PACKAGE.parent.joinpath(*parts)
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def cross_package_private_imports(path: Path, source: str | None = None) -> list[str]:
    """`line: module` for each import in the module at `path` (its text: `source`, or the
    file's) of a private module of another package."""
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = list(package[:len(package) - node.level + 1]) if node.level else []
        target = base + (node.module.split(".") if node.module else [])
        if not target or target[0] != "shardlint":
            continue
        modules = [target] + [target + [a.name] for a in node.names
                              if a.name.startswith("_") and _is_module(target + [a.name])]
        for module in modules:
            if len(module) < 3 or not module[2].startswith("_"):
                continue
            if len(package) < 2 or module[1] != package[1]:
                found.append(f"{node.lineno}: {'.'.join(module)}")
    return found


def test_no_package_imports_another_packages_private_module():
    offenders = {str(p.relative_to(PACKAGE.parent)): found
                 for p in sorted(PACKAGE.rglob("*.py")) if p != SEAM
                 for found in [cross_package_private_imports(p)] if found}
    assert not offenders, (
        "import these through the package's __init__ or shardlint.internal: "
        + "; ".join(f"{f} line {', line '.join(lines)}" for f, lines in offenders.items()))


def test_the_check_finds_such_an_import():
    """The walk above can fail: a rewrites module importing the analyzer's _stack."""
    source = ("from ..analyzer._stack import display_path\nfrom ..analyzer import _detect\n"
              "from .._errors import RewriteError\nfrom ._trace import Tokens\n")
    assert cross_package_private_imports(PACKAGE / "rewrites" / "_probe.py", source) == [
        "1: shardlint.analyzer._stack", "2: shardlint.analyzer._detect"]


def test_every_name_the_seam_lends_resolves_to_another_packages_private_module():
    for name, module in internal._LENT.items():
        assert module.split(".")[2].startswith("_"), (name, module)
        assert getattr(internal, name) is getattr(importlib.import_module(module), name)
    assert sorted(dir(internal)) == sorted(internal._LENT)
