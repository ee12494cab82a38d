"""The jaxpr toolkit, below the analyzer and the rewrites: what flows where in a level
(`_flow`), the jaxprs an equation carries and how to bind it again with one rewritten
(`_inner`), equations replayed as JAX binds them (`_replay`), a body jitted as the step was
(`_jitted`), and which equations are grouped and expert matmuls (`_patterns`)."""

from ._flow import connected_parts as connected_parts
from ._flow import consumers_of as consumers_of
from ._flow import downstream as downstream
from ._flow import reaches as reaches
from ._flow import variables as variables
from ._inner import bind_with as bind_with
from ._inner import carries as carries
from ._inner import sub_of as sub_of
from ._jitted import jit_equation as jit_equation
from ._jitted import jitted_like as jitted_like
from ._patterns import grouped_matmul_sources as grouped_matmul_sources
from ._patterns import is_expert_batched_eqn as is_expert_batched_eqn
from ._patterns import is_grouped_matmul_eqn as is_grouped_matmul_eqn
from ._patterns import reads_expert_weights as reads_expert_weights
from ._replay import ANNOTATIONS as ANNOTATIONS
from ._replay import SHARDING_PARAMS as SHARDING_PARAMS
from ._replay import bind_eqn as bind_eqn
from ._replay import read as read
