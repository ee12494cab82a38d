"""Packages talk through each other's public `__init__` (plain `from ._x import y as y`
re-exports) or through the top-level ground modules, never through another package's private
module (as tests/test_jax_internals.py keeps `jax._src` in one module), and never through a
table of module names resolved at run time, which hides the edge from an IDE, a type
checker and an import graph (issue 42).

Read from the source with `ast`: an import `from ..analyzer._stack import x` (or
`from ..analyzer import _stack`) in shardlint/rewrites fails here, and so does a string that
names a shardlint module (`"shardlint.analyzer._peak"`, the stuff of an `importlib` table).
The top-level leaf modules (`shardlint/_errors.py`, `_vocab.py`, `_source.py`, `_jax.py`,
...) belong to every package. The package face (`shardlint/__init__.py`) alone keeps a lazy
table of its public subpackages, so that `import shardlint` (which every pytest session
does, through the plugin) does not import JAX.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardlint

PACKAGE = Path(shardlint.__file__).parent
FACE = PACKAGE / "__init__.py"
_DOTTED = re.compile(r"shardlint(\.[A-Za-z_]\w*)+\.?")


def _is_module(parts: list[str]) -> bool:
    path = PACKAGE.parent.joinpath(*parts)
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _tree(path: Path, source: str | None) -> ast.AST:
    return ast.parse(path.read_text() if source is None else source)


def cross_package_private_imports(path: Path, source: str | None = None) -> list[str]:
    """`line: module` for each import in the module at `path` (its text: `source`, or the
    file's) of a private module of another package."""
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = here[:-1]
    found = []
    for node in ast.walk(_tree(path, source)):
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


def module_names_in_strings(path: Path, source: str | None = None) -> list[str]:
    """`line: text` for each string in the module at `path` that names a shardlint module
    (`"shardlint.gate._wording"`, or the `"shardlint.analyzer."` an f-string starts with),
    and each relative name handed to `import_module` (`import_module("._peak", ...)`)."""
    found = []
    for node in ast.walk(_tree(path, source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if _DOTTED.fullmatch(text) and _is_module(text.rstrip(".").split(".")):
                found.append(f"{node.lineno}: {text}")
        elif isinstance(node, ast.Call) and node.args:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0]
            if (name in ("import_module", "__import__") and isinstance(first, ast.Constant)
                    and isinstance(first.value, str) and first.value.startswith(".")):
                found.append(f"{node.lineno}: {first.value}")
    return found


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_package_imports_another_packages_private_module():
    offenders = {str(p.relative_to(PACKAGE.parent)): found
                 for p in _modules() for found in [cross_package_private_imports(p)] if found}
    assert not offenders, (
        "import these through the package's __init__ (add a plain re-export there) or move "
        "them to a top-level ground module: "
        + "; ".join(f"{f} line {', line '.join(lines)}" for f, lines in offenders.items()))


def test_the_check_finds_such_an_import():
    """The walk above can fail: a rewrites module importing the analyzer's _stack."""
    source = ("from ..analyzer._stack import display_path\nfrom ..analyzer import _detect\n"
              "from .._errors import RewriteError\nfrom ._trace import Tokens\n")
    assert cross_package_private_imports(PACKAGE / "rewrites" / "_probe.py", source) == [
        "1: shardlint.analyzer._stack", "2: shardlint.analyzer._detect"]


def test_no_module_resolves_shardlint_modules_by_name_at_run_time():
    offenders = {str(p.relative_to(PACKAGE.parent)): found
                 for p in _modules() if p != FACE
                 for found in [module_names_in_strings(p)] if found}
    assert not offenders, (
        "import these statically (a plain `from ..x import y`, inside a function if it must "
        "load late), not by a name resolved at run time: "
        + "; ".join(f"{f} line {', line '.join(lines)}" for f, lines in offenders.items()))


def test_the_check_finds_a_table_of_module_names():
    """The walk above can fail: the `importlib` table `shardlint/internal.py` once was."""
    source = ('import importlib\n'
              '_LENT = {"display_path": "shardlint.analyzer._stack",\n'
              '         "record": "shardlint.gate._gate"}\n'
              'mod = importlib.import_module(f"shardlint.analyzer.{name}")\n'
              'peak = importlib.import_module("._peak", "shardlint.analyzer")\n'
              'BASELINE = "shardlint.baseline.json"\n')
    assert sorted(module_names_in_strings(PACKAGE / "_probe.py", source)) == [
        "2: shardlint.analyzer._stack", "3: shardlint.gate._gate", "4: shardlint.analyzer.",
        "5: ._peak", "5: shardlint.analyzer"]


def _imported_after(code: str) -> list[str]:
    """The modules a fresh interpreter holds after `code`: JAX, and shardlint's."""
    shown = "import sys; print(' '.join(m for m in sys.modules if m == 'jax' or m.startswith('shardlint')))"
    done = subprocess.run([sys.executable, "-c", f"{code}\n{shown}"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_ground_modules_import_no_package():
    """A top-level leaf module belongs to every package, so it may import none of them."""
    ground = sorted(p.stem for p in PACKAGE.glob("_*.py") if p.stem not in ("__init__", "__main__"))
    loaded = _imported_after("; ".join(f"import shardlint.{m}" for m in ground))
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert not [m for m in loaded if len(m.split(".")) > 1 and m.split(".")[1] in packages], loaded


def test_the_face_the_command_line_and_the_source_and_op_readers_do_not_import_jax():
    """`import shardlint` stays light (the pytest plugin imports it in every session), and
    so do the command line's start and the leaves the commands read before any analysis."""
    light = ["shardlint", "shardlint.cli", "shardlint._source", "shardlint._ops", "shardlint._op_paths",
             "shardlint._vocab", "shardlint._format"]
    assert "jax" not in _imported_after("; ".join(f"import {m}" for m in light))


@pytest.mark.slow
@pytest.mark.parametrize("first", ["analyzer", "rewrites", "gate", "moe", "reports", "cli"])
def test_the_packages_import_in_any_order(first):
    """No import cycle between the packages: each one imported first, in a fresh interpreter."""
    rest = [m for m in ["analyzer", "rewrites", "gate", "moe", "reports", "cli", "commands", "testing"]
            if m != first]
    _imported_after("; ".join(f"import shardlint.{m}" for m in [first, *rest]))
