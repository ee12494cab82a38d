"""Targets and harnesses for the libraries users already train with: MaxText (`maxtext`, and
its own training loop, `maxtext.train`), Levanter (`levanter`), keras-hub (`keras_hub`).

A target is what `shardlint analyze package.module:make_step` (or `path/to/file.py:make_step`)
imports and calls, for every command:

    make_step(mesh, **options, devices=...) -> (step, args)

- `mesh`: the mesh `--mesh` built, or None under `--devices N` (N simulated CPU devices) and
  `--topology` alone: the target then lays its own mesh, and the analysis reads it from the
  arguments;
- `options`: the `--set KEY=VALUE` words as keyword arguments (a value read as JSON when it
  parses, else the string it is); a key the target's signature does not take is one line
  naming those it does, unless it takes `**options`;
- `devices=`: passed only under `--topology` without `--mesh` (the topology's compile-only
  chips), so a target that builds its own mesh must take it;
- it returns `(step, args)`: the step function and its arguments, arrays or
  `ShapeDtypeStruct`s carrying `NamedSharding`s on one mesh (`--mesh`'s, when one was given).

A target's mistakes (a key, a config, a mesh) raise a `shardlint.UsageError` subclass: one
line and exit 2, no traceback. Each library's target here is one module that names its
library once (`_library.Library`: the install hint, the Python it needs, its error type) and
keeps only what is the library's own: its config, its mesh and its step.

Nothing is re-exported: each module imports its library only inside its functions, so
importing `shardlint.integrations.<module>` costs nothing where the library is absent.
"""
