"""Stage 4 of the rewrite, one per kind of step: the jaxpr route (trace, plan, emit, jit:
`RewrittenStep`), a Flax `nnx.jit` step around it, and the swap route for models built on
`shardlint.moe`."""

from ._jaxpr import RewrittenStep as RewrittenStep
from ._jaxpr import warn_unchanged as warn_unchanged
from ._nnx import NnxRewrittenStep as NnxRewrittenStep
from ._swap import swap_moe_layers as swap_moe_layers
from ._swap import SwappedStep as SwappedStep
