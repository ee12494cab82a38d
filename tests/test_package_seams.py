"""Packages talk through each other's public `__init__` (plain `from ._x import y as y`
re-exports) or through the top-level ground modules, never through another package's private
module (as tests/test_jax_internals.py keeps `jax._src` in one module), and never through a
table of module names resolved at run time, which hides the edge from an IDE, a type
checker and an import graph (issue 42).

Read from the source with `ast`: an import `from ..analyzer._stack import x` (or
`from ..analyzer import _stack`) in shardlint/rewrites fails here, and so does a string that
names a shardlint module (`"shardlint.analyzer.memory._peak"`, the stuff of an `importlib` table).
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


def _imports(path: Path, source: str | None = None) -> list[tuple[int, list[str]]]:
    """`(line, module)` for each shardlint module the module at `path` imports: the `from`
    module, and each imported name that is a module itself (`from . import _refusals`)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(_tree(path, source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = list(package[:len(package) - node.level + 1]) if node.level else []
        target = base + (node.module.split(".") if node.module else [])
        if not target or target[0] != "shardlint":
            continue
        found.append((node.lineno, target))
        found += [(node.lineno, target + [a.name]) for a in node.names if _is_module(target + [a.name])]
    return found


def private_imports_across_seams(path: Path, source: str | None = None) -> list[str]:
    """`line: module` for each import in the module at `path` of a private module (`_x`) that
    is neither its own package's nor an enclosing package's: a private module is seen from its
    package and from the packages below it, and from anywhere else through its package's face
    (a stage folder's `__init__` too)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = []
    for line, module in _imports(path, source):
        private = next((i for i, part in enumerate(module) if part.startswith("_")), None)
        if private is not None and tuple(module[:private]) != package[:private]:
            found.append(f"{line}: {'.'.join(module)}")
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
                 for p in _modules() for found in [private_imports_across_seams(p)] if found}
    assert not offenders, (
        "import these through the package's __init__ (add a plain re-export there) or move "
        "them to a top-level ground module: "
        + "; ".join(f"{f} line {', line '.join(lines)}" for f, lines in offenders.items()))


def test_the_check_finds_such_an_import():
    """The walk above can fail: a planner module importing the analyzer's parser of stack
    tables, a detector, and the private module of the rewrite's trace stage; its own stage's,
    its package's and the ground's private modules are its to import."""
    source = ("from ...analyzer.parse._stack import parse_stack_frames\n"
              "from ...analyzer.explain import _detect\nfrom ..._errors import RewriteError\n"
              "from ..trace._trace import Tokens\nfrom ._grow import Grower\n"
              "from .._step import JittedStep\nfrom ..trace import Tokens\n")
    assert private_imports_across_seams(PACKAGE / "rewrites" / "plan" / "_probe.py", source) == [
        "1: shardlint.analyzer.parse._stack", "2: shardlint.analyzer.explain._detect",
        "4: shardlint.rewrites.trace._trace"]


# The stages of each package, first to last: a stage imports only the stages before it.
STAGES = {
    "analyzer": ["parse", "compile", "graph", "explain", "memory"],
    "rewrites": ["shard", "trace", "plan", "emit", "routes"],
    "moe": ["kernels", "layers"],
}


def imports_of_later_stages(path: Path, source: str | None = None) -> list[str]:
    """`line: module` for each import in the module at `path`, inside one of `STAGES`, of its
    own stage's successors."""
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts
    stages = STAGES.get(here[1], []) if len(here) > 3 else []
    if not stages or here[2] not in stages:
        return []
    return [f"{line}: {'.'.join(module)}" for line, module in _imports(path, source)
            if module[1:2] == [here[1]] and len(module) > 2 and module[2] in stages
            and stages.index(module[2]) > stages.index(here[2])]


def test_each_stage_imports_only_the_stages_before_it():
    offenders = {str(p.relative_to(PACKAGE.parent)): found
                 for p in _modules() for found in [imports_of_later_stages(p)] if found}
    assert not offenders, "; ".join(f"{f} line {', line '.join(lines)}" for f, lines in offenders.items())


def test_the_stage_check_finds_an_import_of_a_later_stage():
    source = "from ..emit import emit\nfrom ..trace import Tokens\nfrom .._step import JittedStep\n"
    assert imports_of_later_stages(PACKAGE / "rewrites" / "plan" / "_probe.py", source) == [
        "1: shardlint.rewrites.emit"]


def test_the_jaxpr_toolkit_imports_neither_the_analyzer_nor_the_rewrite():
    """Both ask jaxpr questions of `shardlint.jaxpr`, which stands below them."""
    loaded = _imported_after("import shardlint.jaxpr")
    assert not [m for m in loaded if m.split(".")[1:2] in (["analyzer"], ["rewrites"])], loaded


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
              '_LENT = {"display_path": "shardlint.analyzer.parse._stack",\n'
              '         "record": "shardlint.gate._gate"}\n'
              'mod = importlib.import_module(f"shardlint.analyzer.{name}")\n'
              'peak = importlib.import_module("._peak", "shardlint.analyzer")\n'
              'BASELINE = "shardlint.baseline.json"\n')
    assert sorted(module_names_in_strings(PACKAGE / "_probe.py", source)) == [
        "2: shardlint.analyzer.parse._stack", "3: shardlint.gate._gate", "4: shardlint.analyzer.",
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
@pytest.mark.parametrize("first", ["analyzer", "rewrites", "jaxpr", "gate", "moe", "reports", "cli"])
def test_the_packages_import_in_any_order(first):
    """No import cycle between the packages: each one imported first, in a fresh interpreter."""
    rest = [m for m in ["analyzer", "rewrites", "jaxpr", "gate", "moe", "reports", "cli", "commands", "testing"]
            if m != first]
    _imported_after("; ".join(f"import shardlint.{m}" for m in [first, *rest]))
