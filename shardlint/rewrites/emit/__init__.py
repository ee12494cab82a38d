"""Stage 3 of the rewrite: the step's equations again, each planned group inside one
`shard_map` over the token axes (`emit`)."""

from ._emit import emit as emit
