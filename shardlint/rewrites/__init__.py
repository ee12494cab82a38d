"""The rewrite: put the sharding-preserving routed MoE into a step.

The pipeline, one stage a folder: trace (what to rewrite, which values carry tokens) ->
plan (the routed regions of each level) -> emit (each region inside a `shard_map`) ->
routes (jitted as the step was: the jaxpr route, an `nnx.jit` wrapper, or the swap route
for `shardlint.moe` models); `shard/` binds equations at one shard's shapes for them all.
`rewrite` picks the route and `verify_same` checks the numbers.
"""

from .._token_axes import TokenAxes as TokenAxes
from .._wrapped import Wrapped as Wrapped
from ._rewrite import rewrite as rewrite
from ._step import JittedStep as JittedStep
from ._verify import verify_same as verify_same
from .routes import RewrittenStep as RewrittenStep
from .routes import SwappedStep as SwappedStep
