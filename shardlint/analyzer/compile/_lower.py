"""Lower a step as `jax.jit` does, entering a mesh only where the step needs one.

`jax.jit(step).lower(*args)` lowers under whatever mesh its caller has in context, and
steps are written for one context or another:

- a library that `shard_map`s over a `Mesh` it builds itself (its own axis names, or two
  of the step's axes folded into one) lowers with no mesh in context and fails inside
  `jax.set_mesh(mesh)` ("The context mesh ... should match the mesh passed to shard_map");
- code that resolves bare PartitionSpecs, or takes shard_map's mesh, from the context
  fails with none ("requires a non-empty mesh in context"); pjit-era code (bare
  PartitionSpecs in `pjit`, `pxla.thread_resources`) needs `with mesh:`, which
  `jax.set_mesh` does not set;
- code that reads the mesh in context and does without one (Flax linen's logical
  constraints, which MaxText's decoders use) lowers with none, to another program.

So a step is lowered with no mesh in context first. Where that fails, it is lowered
inside `jax.set_mesh(mesh)`, then `with mesh:`. Where it lowers, it is lowered inside
`jax.set_mesh(mesh)` as well, and when that gives another StableHLO module the step read
the mesh in context: it was written to run there, and that module is analyzed. Lowering
twice costs a trace and a lowering, not a compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager

from ... import _jax
from ..._errors import AnalysisError, first_line
from ..._source import user_line


@dataclasses.dataclass(frozen=True)
class Lowering:
    """A step traced and lowered, and the mesh context it was lowered in."""

    traced: Any                      # jax.stages.Traced
    lowered: Any                     # jax.stages.Lowered
    context: str                     # how the mesh was in context, in words
    enter: Callable[[], ContextManager]   # enters that context again (for the compile)


@dataclasses.dataclass(frozen=True)
class InContext:
    """What `make` gave in the mesh context the step needs, and that context."""

    made: Any
    context: str                     # how the mesh was in context, in words
    enter: Callable[[], ContextManager]   # enters that context again


NO_MESH = "no mesh in context"
SET_MESH = "jax.set_mesh(mesh)"
WITH_MESH = "`with mesh:`"


def lower_as_jit(fn: Callable, args: tuple, mesh, progress: Callable[[str], None] | None = None) -> Lowering:
    """The step lowered as `jax.jit(fn).lower(*args)` lowers it with no mesh in context,
    or inside the mesh context the step needs (module docstring); raises AnalysisError
    naming what each context raised when none lowers it."""

    def make():
        traced = _jax.trace(fn, args)
        return traced, traced.lower()

    found = in_context_as_jit(make, mesh, lambda pair: pair[1].as_text(), progress, ("lower", "lowered"))
    (traced, lowered) = found.made
    return Lowering(traced, lowered, found.context, found.enter)


def in_context_as_jit(make: Callable[[], Any], mesh, text: Callable[[Any], str],
                      progress: Callable[[str], None] | None = None,
                      verb: tuple[str, str] = ("trace", "traced")) -> InContext:
    """`make()` (a trace or a lowering of the step) with no mesh in context, or inside the
    mesh context the step needs (module docstring): where `text` of what it makes differs
    inside `jax.set_mesh(mesh)`, the step read the mesh in context and that is what counts.
    Raises AnalysisError naming what each context raised when none makes it."""
    say = progress or (lambda message: None)
    (verb, done) = verb
    contexts = {NO_MESH: contextlib.nullcontext, SET_MESH: lambda: _jax.set_mesh(mesh),
                WITH_MESH: lambda: _jax.legacy_mesh(mesh)}
    failures: dict[str, Exception] = {}
    plain = _make(make, NO_MESH, contexts[NO_MESH], failures)
    if plain is not None:
        meshed = _make(make, SET_MESH, contexts[SET_MESH], {})
        if meshed is None or text(meshed.made) == text(plain.made):
            return plain
        say(f"the step {verb}s to another program inside {SET_MESH} than with {NO_MESH} (it reads "
            f"the mesh in context): taken as {done} inside {SET_MESH}")
        return meshed
    for name in (SET_MESH, WITH_MESH):
        found = _make(make, name, contexts[name], failures)
        if found is not None:
            error = failures[NO_MESH]
            say(f"the step does not {verb} with {NO_MESH} ({type(error).__name__}: {first_line(error)}): "
                f"{done} inside {name}")
            return found
    raise _none_lowers(failures) from failures[NO_MESH]


def _make(make, name: str, enter, failures: dict[str, Exception]) -> InContext | None:
    try:
        with enter():
            return InContext(make(), name, enter)
    except Exception as e:  # the user's code (or JAX on its behalf) raised while tracing
        failures[name] = e
        return None


def _none_lowers(failures: dict[str, Exception]) -> AnalysisError:
    """One error for every context's failure: the plain one in full, the others' first
    lines where they say something else (a step that is simply broken fails alike in all)."""
    first = failures[NO_MESH]
    said = {f"{type(first).__name__}: {first_line(first)}"}
    others = []
    for name, error in failures.items():
        text = f"{type(error).__name__}: {first_line(error)}"
        if text not in said:
            said.add(text)
            others.append(f"inside {name}: {text}")
    message = f"tracing the step failed{user_line(first)}: {type(first).__name__}: {first_line(first)}"
    if others:
        message += (f"; {'; '.join(others)}. No mesh context lowers it ({', '.join(failures)} "
                    "tried): name its meshes where it shards (NamedSharding(mesh, spec) rather "
                    "than a bare PartitionSpec, mesh= for shard_map), so that jax.jit(step).lower(*args) "
                    "lowers it in one of them")
    return AnalysisError(message)
