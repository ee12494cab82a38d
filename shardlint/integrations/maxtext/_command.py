"""`python -m shardlint.integrations.maxtext.train`: MaxText's command line, MaxText's loop.

The command line is MaxText's (`python -m maxtext.trainers.pre_train.train <config.yml>
key=value ...`); the `shardlint_*=` keys among the overrides are shardlint's and are taken
out before MaxText sees the rest (`split`). MaxText's `main` then runs under absl's
`app.run`, as MaxText's own module runs it, inside `handed_over`: MaxText's config, mesh,
data pipeline, optimizer, checkpoints and logs are its own, and the steps it jits come back
rewritten. MaxText's exit status is the command's; a mistake in a `shardlint_*` key, a
config the hand-over cannot serve or a refused rewrite is one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

from ..._errors import UsageError, exit_code
from .._library import closest
from ._handover import Fixed, Options, handed_over
from ._target import MAXTEXT

PREFIX = "shardlint_"
# key -> Options field
KEYS = {f"{PREFIX}{field.name}": field.name for field in dataclasses.fields(Options)}
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")

USAGE = f"""usage: python -m shardlint.integrations.maxtext.train <config.yml> [key=value ...]

Runs MaxText's own training loop (python -m maxtext.trainers.pre_train.train takes the same
command line) with each routed MoE of the steps MaxText jits computed per shard.
shardlint's own keys go among MaxText's (true or false, default false):
  {PREFIX}per_shard_capacity=true   a capacity computed from the tokens (capacity_factor > 0 on
                                    MaxText's dense path) runs per shard: each shard drops by its own
  {PREFIX}verify=true               run MaxText's step and the rewritten one once on random inputs of
                                    the real shapes and stop if their outputs differ"""


def split(argv: Sequence[str]) -> tuple[Options, list[str]]:
    """(shardlint's options, MaxText's arguments) of a command line (without the program
    name). Every mistake in a `shardlint_*` argument is said at once, in one line."""
    values: dict[str, bool] = {}
    rest: list[str] = []
    mistakes: list[str] = []
    for arg in argv:
        if not arg.startswith(PREFIX):
            rest.append(arg)
            continue
        key, eq, value = arg.partition("=")
        if key not in KEYS:
            close = closest(key, KEYS, n=1)
            mistakes.append(f"shardlint has no key {key!r}"
                            + (f" (did you mean {close[0]}?)" if close else "")
                            + f"; its keys are {', '.join(KEYS)}")
        elif not eq:
            mistakes.append(f"{key} needs a value: {key}=true or {key}=false")
        elif value.lower() not in _TRUE + _FALSE:
            mistakes.append(f"{arg}: expected {key}=true or {key}=false")
        elif KEYS[key] in values:
            mistakes.append(f"{key} is given twice")
        else:
            values[KEYS[key]] = value.lower() in _TRUE
    options = Options(**values)
    if options.verify and options.per_shard_capacity:
        mistakes.append(f"{PREFIX}verify=true cannot check {PREFIX}per_shard_capacity=true: each shard "
                        "drops other tokens than the whole batch does, so the numbers differ by design")
    if mistakes:
        raise UsageError("; ".join(mistakes))
    return options, rest


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    return exit_code(lambda: _run(*split(argv)))


def _run(options: Options, maxtext_argv: list[str]) -> int:
    MAXTEXT.require()
    from absl import app
    from maxtext.trainers.pre_train import train

    def say(fixed: Fixed) -> None:
        print(fixed.line(), flush=True)

    with handed_over(options, say):
        try:
            app.run(train.main, argv=["maxtext.trainers.pre_train.train", *maxtext_argv])
        except SystemExit as e:   # app.run ends with sys.exit(main(argv))
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
