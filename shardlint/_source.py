"""Source frames and paths: which frames of a stack are the user's code, and how a file is
shown to a user. A ground module, like `_format` and `_vocab`: the analyzer, the rewrites,
the reports and the commands import it alike, and it imports nothing of shardlint's beyond
`_format`, so importing it pulls in neither JAX nor another package.

The innermost frame of a MaxText constraint is always the same helper line, so a finding
must show the frames that are the user's: this module drops frames inside JAX and the
libraries around it, the Python standard library and shardlint's own machinery, decided by
where the file lies on disk, and renders the rest relative to the working directory or the
`sys.path` entry that holds it. Paths in XLA's stack-frame tables (read by
`analyzer/parse/_stack.py`) are absolute, as JAX recorded them when it traced; frames are `Source`
records with those paths until `shown` gives them the path a user reads.

Which of the user's frames to show (`shown_frames`): MaxText wraps every sharding
constraint in helpers, so the innermost frame of each is the same helper line
(`maxtext/utils/sharding.py:128`); the line that matters is the first frame that is not such
a helper (the analyzer's `helper_frames` says which frames are). Shown as
`maxtext/layers/moe.py:3969 via maxtext/utils/sharding.py:128`; one frame when the innermost
is already the user's line.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
import sysconfig
import traceback
from pathlib import PurePath

from ._format import clip

# Frames inside these installed packages are never the user's: JAX and the libraries
# around it, and the test runner a step may be analyzed under.
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy", "opt_einsum", "_pytest", "pytest", "pluggy")
# A stack keeps at most this many user frames, innermost first: the outer ones (the
# training loop's entry point, the command line) say nothing about the op.
MAX_FRAMES = 12
# shardlint's machinery; its `moe` and `examples` are model code that users run, and stay.
_MACHINERY_PACKAGES = ("analyzer", "rewrites", "gate", "reports", "commands")
_MACHINERY_MODULES = ("cli.py", "pytest_plugin.py", "testing.py")
_INSTALL_DIRS = ("site-packages", "dist-packages")


# One frame of a stack: a file (absolute as traced, or as a user reads it once `shown`), a
# line, and the function the line is in.
@dataclasses.dataclass(frozen=True)
class Source:
    file: str
    line: int
    function: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def user_stack(stack: tuple[Source, ...]) -> tuple[Source, ...]:
    """The frames of a stack that are the user's code (at most `MAX_FRAMES`, innermost
    first); the innermost frame if none is."""
    kept = tuple(frame for frame in stack
                 if not is_library_file(frame.file) and not is_jax_shim(frame.file, frame.function))
    return kept[:MAX_FRAMES] or tuple(stack[:1])


def raised_at(error: BaseException) -> tuple[Source, str] | None:
    """Where the user's code raised `error`, or called what raised it: the innermost frame of
    its traceback that is the user's (`is_library_file`), shown as a user reads it, with the
    text of that line ("" where its source cannot be read). None if no frame is the user's."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not is_library_file(frame.filename) and not is_jax_shim(frame.filename, frame.name):
            return shown(Source(frame.filename, frame.lineno or 0, frame.name)), (frame.line or "").strip()
    return None


def user_line(error: BaseException) -> str:
    """` at model.py:12 in layer (x @ w)`: `raised_at` for a one-line message ("" where no
    frame is the user's)."""
    found = raised_at(error)
    if found is None:
        return ""
    where, text = found
    text = clip(" ".join(text.split()), 100)
    return f" at {where.file}:{where.line} in {where.function}" + (f" ({text})" if text else "")


def shown(frame: Source) -> Source:
    """The frame with its file as a user reads it (`display_path`)."""
    return dataclasses.replace(frame, file=display_path(frame.file))


def user_sources(stack: tuple[Source, ...]) -> tuple[Source, ...]:
    """`user_stack`, each frame `shown`: what records carry."""
    return tuple(shown(frame) for frame in user_stack(stack))


# The public JAX namespaces a library may patch in place.
_JAX_NAMESPACES = ("jax", "jax.lax", "jax.numpy", "jax.nn", "jax.random")


def is_jax_shim(file: str, function: str) -> bool:
    """Whether the frame's function (qualified or not) is installed in place of JAX's own."""
    return function.rpartition(".")[2] in _jax_shims_in(file)


@functools.lru_cache(maxsize=4096)
def _jax_shims_in(file: str) -> frozenset[str]:
    """Names of the functions in `file` that are installed in place of public JAX
    functions: MaxText wraps `jax.lax.top_k` and `with_sharding_constraint` in compat
    shims, so every top_k's innermost frame would be the shim, not the model's line.
    Read after the step was traced, when the patches are in place."""
    if not os.path.isabs(file):
        return frozenset()
    target = os.path.normpath(file)
    names = set()
    for namespace in _JAX_NAMESPACES:
        module = sys.modules.get(namespace)
        for value in vars(module).values() if module is not None else ():
            code = getattr(value, "__code__", None)
            if code is not None and os.path.normpath(code.co_filename) == target:
                names.add(code.co_name)
    return frozenset(names)


@functools.lru_cache(maxsize=65536)
def is_library_file(file: str) -> bool:
    """Whether a file belongs to JAX and its libraries, the standard library, or shardlint's
    own machinery (not its `moe` and `examples`, which are model code)."""
    if file.startswith("<frozen "):
        return True  # the standard library's frozen modules (`<frozen runpy>`)
    if file == "<string>":
        return True  # code run from a string: a spawned process's entry (`_engine`), `python -c`
    if not os.path.isabs(file):
        return False
    path = PurePath(os.path.normpath(file))
    shardlint_dir, library_dirs, stdlib_dir = _installed()
    if any(path.is_relative_to(d) for d in library_dirs):
        return True
    if path.parent == _scripts_dir():
        return True  # a console-script launcher (the `shardlint` command itself)
    if path.is_relative_to(shardlint_dir):
        return _is_machinery(path.relative_to(shardlint_dir).parts)
    parts = path.parts
    installed = [i for i, part in enumerate(parts) if part in _INSTALL_DIRS]
    if installed:  # an installed package, maybe of another environment than this one
        inside = parts[installed[-1] + 1:]
        if inside and inside[0] in LIBRARIES:
            return True
        return len(inside) > 1 and inside[0] == "shardlint" and _is_machinery(inside[1:])
    return path.is_relative_to(stdlib_dir) or _looks_like_stdlib(parts)


def raised_by_shardlint(error: BaseException) -> bool:
    """Whether `error` was raised in shardlint's own machinery (a bug of shardlint's), not
    by JAX, a library or the user's code it called."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or not os.path.isabs(frames[-1].filename):
        return False
    path = PurePath(os.path.normpath(frames[-1].filename))
    shardlint_dir = _installed()[0]
    return path.is_relative_to(shardlint_dir) and _is_machinery(path.relative_to(shardlint_dir).parts)


def located(file: str) -> str | None:
    """The file on disk that a shown path names (`display_path`'s inverse, in the environment
    that ran the analysis): as it is, or under the `sys.path` entry it is shown relative to
    (an installed library's `nano_moe/layers.py`); None where it is not on this machine."""
    if os.path.isfile(file):
        return file
    if not os.path.isabs(file):
        for entry in sys.path:
            path = os.path.join(entry or os.curdir, file)
            if os.path.isfile(path):
                return path
    return None


def display_path(file: str) -> str:
    """A file as a user reads it: relative to the working directory when it lies under it
    (unless that path runs through an installed package folder, as a virtual environment
    inside the project does), else to the longest `sys.path` entry that holds it
    (`.../site-packages/maxtext/layers/moe.py` is `maxtext/layers/moe.py`), else to the
    folder its outermost package lies in (editable installs import from off `sys.path`),
    else as it is."""
    return _display(file, os.getcwd(), tuple(sys.path))


@functools.lru_cache(maxsize=65536)
def _display(file: str, cwd: str, entries: tuple[str, ...]) -> str:
    if not os.path.isabs(file):
        return file
    path = PurePath(os.path.normpath(file))
    here = PurePath(cwd)
    if path.is_relative_to(here):
        inside = path.relative_to(here)
        if not any(part in _INSTALL_DIRS for part in inside.parts):
            return str(inside)
    roots = [PurePath(os.path.normpath(e)) for e in entries if e and os.path.isabs(e)]
    holding = [r for r in roots if path.is_relative_to(r) and path != r]
    if holding:
        return str(path.relative_to(max(holding, key=lambda r: len(r.parts))))
    if path.is_relative_to(here):
        return str(path.relative_to(here))
    package_root = _package_root(path)
    return str(path.relative_to(package_root)) if package_root is not None else file


def _package_root(path: PurePath) -> PurePath | None:
    """The folder above the outermost package holding `path` (one with `__init__.py` all
    the way down): where an editable install's finder imports it from, off `sys.path`."""
    root = None
    folder = path.parent
    while os.path.exists(folder / "__init__.py"):
        root = folder = folder.parent
    return root


@functools.lru_cache(maxsize=None)
def _installed() -> tuple[PurePath, tuple[PurePath, ...], PurePath]:
    """shardlint's package folder, the folders of the libraries, and the standard library."""
    library_dirs = []
    for name in LIBRARIES:
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            library_dirs.append(PurePath(os.path.normpath(os.path.realpath(folder))))
            library_dirs.append(PurePath(os.path.normpath(folder)))
    shardlint_dir = PurePath(os.path.normpath(os.path.dirname(__file__)))
    stdlib_dir = PurePath(os.path.normpath(sysconfig.get_paths()["stdlib"]))
    return shardlint_dir, tuple(dict.fromkeys(library_dirs)), stdlib_dir


@functools.lru_cache(maxsize=1)
def _scripts_dir() -> PurePath:
    return PurePath(os.path.normpath(sysconfig.get_paths()["scripts"]))


def _is_machinery(parts: tuple[str, ...]) -> bool:
    if not parts:
        return False
    if len(parts) == 1:
        return parts[0].startswith("_") or parts[0] in _MACHINERY_MODULES
    return parts[0] in _MACHINERY_PACKAGES


def _looks_like_stdlib(parts: tuple[str, ...]) -> bool:
    # `.../lib/python3.12/contextlib.py` of another interpreter than this one.
    return any(parts[i] == "lib" and parts[i + 1].startswith("python")
               and parts[i + 1][len("python"):].replace(".", "").isdigit()
               for i in range(len(parts) - 2))


def shown_frames(stack: tuple[Source, ...], helpers: frozenset, fallback: Source | None = None
                 ) -> tuple[Source, ...]:
    """(the user's line,) or (the user's line, the innermost helper frame)."""
    if not stack:
        return (fallback,) if fallback is not None else ()
    shared = [(f.file, f.line) in helpers for f in stack]
    last = -1
    for i in range(len(stack)):
        if shared[i]:
            last = i
        elif not (i + 1 < len(stack) and shared[i + 1]):
            break
    innermost = stack[0]
    mine = stack[last + 1] if last + 1 < len(stack) else innermost
    return (mine,) if mine == innermost else (mine, innermost)


def frames_text(stack: tuple[Source, ...], helpers: frozenset, fallback: Source | None = None) -> str:
    shown = shown_frames(stack, helpers, fallback)
    return " via ".join(f"{f.file}:{f.line}" for f in shown) if shown else "-"
