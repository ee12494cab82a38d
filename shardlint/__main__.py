"""`python -m shardlint ...`: the same as the `shardlint` console script."""

from .cli import run

run()
