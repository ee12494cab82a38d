"""What every integration does and says the same way about the library it builds a step
from: its error type, the install hint, the Python it needs and its import (`Library`);
the devices a target lays the library's mesh over and the refusal of a `--mesh` that is not
the library's; a mistyped key and the keys closest to it; the library's own error in one
line; its stdout chatter kept off shardlint's report.

An integration names its library once (`Library(...)`, beside its error type) and keeps
only what is the library's own: its config, its mesh, its step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import sys
from types import ModuleType
from typing import Any, Iterable, Mapping, Sequence

from .._errors import UsageError


class LibraryError(UsageError):
    """A library is missing, or its config or mesh cannot be built as asked (each
    integration raises its own kind: `MaxTextError`, `LevanterError`, `KerasHubError`)."""


@dataclasses.dataclass(frozen=True)
class Library:
    """A library a target builds its step from, as shardlint's messages name it."""

    name: str                       # as its users write it: "MaxText", "Levanter", "keras-hub"
    extra: str                      # shardlint's extra that installs it: pip install 'shardlint[extra]'
    error: type[LibraryError]       # what the integration raises
    modules: tuple[str, ...]        # what `require` imports, first to last
    python: tuple[int, int] | None = None   # the oldest Python it runs on
    distribution: str = ""          # its package's name, where that is not `name`

    @property
    def install(self) -> str:
        return f"pip install 'shardlint[{self.extra}]'"

    def require(self) -> tuple[ModuleType, ...]:
        """`modules`, imported with their stdout on stderr; a Python too old for the library
        or a library that is not installed is one line with the install hint."""
        if self.python is not None and sys.version_info < self.python:
            named = f"{self.name} ({self.distribution})" if self.distribution else self.name
            version = ".".join(map(str, self.python))
            raise self.error(f"{named} needs Python {version}+ (this is {sys.version.split()[0]}); "
                             f"in a Python {version} environment: {self.install}")
        try:
            with quiet():
                return tuple(importlib.import_module(module) for module in self.modules)
        except ImportError as e:
            raise self.error(f"{self.name} is not installed ({e}); {self.install}") from e

    def refuse_other_mesh(self, mesh, theirs: Mapping[str, int], *, way_out: str,
                          owner: str | None = None, shown: str | None = None) -> None:
        """A `mesh` given (not None) must have the axes and sizes `theirs` the library lays
        for this config; else one line saying what to pass instead of `--mesh` (`way_out`,
        after `--devices N`). `owner` names whose mesh it is (default the library),
        `shown` writes `theirs` when the dict itself says too much."""
        if mesh is not None and dict(mesh.shape) != dict(theirs):
            raise self.error(f"the mesh {dict(mesh.shape)} is not {owner or self.name}'s for this config "
                             f"({shown or dict(theirs)}); use --devices N and {way_out} instead of --mesh")


def devices_of(mesh, devices: Sequence[Any] | None) -> list:
    """The devices a target lays its library's mesh over: those given (a TPU topology's
    chips), else the `mesh`'s, else all of JAX's (`--devices N` simulates them)."""
    if devices is not None:
        return list(devices)
    if mesh is not None:
        return list(mesh.devices.flat)
    import jax

    return jax.devices()


def unknown_key(has_no: str, key: str, valid: Iterable[str] = ()) -> str:
    """`{has_no} 'key' (--set key=...)`, then up to three of `valid` close to `key`."""
    return f"{has_no} {key!r} (--set {key}=...){did_you_mean(key, valid)}"


def closest(key: str, valid: Iterable[str], n: int = 3) -> list[str]:
    """Up to `n` of `valid` close to `key`, closest first."""
    return difflib.get_close_matches(key, list(valid), n=n)


def did_you_mean(key: str, valid: Iterable[str]) -> str:
    """"; did you mean a, b?" with up to three keys close to `key`, or ""."""
    close = closest(key, valid)
    return f"; did you mean {', '.join(close)}?" if close else ""


def described(error: BaseException) -> str:
    """A library's error as a message quotes it: its text on one line, or its type's name
    when it has none."""
    return one_line(error) or type(error).__name__


def one_line(error: BaseException, limit: int = 300) -> str:
    """A library's error text on one line, cut at `limit` characters ("" when it has none)."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def quiet():
    """Sends stdout to stderr while a library imports or configures itself (MaxText prints
    its config, transformers and TensorFlow print notes): shardlint's stdout is the report."""
    with contextlib.redirect_stdout(sys.stderr):
        yield
