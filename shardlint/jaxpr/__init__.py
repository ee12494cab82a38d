"""The jaxpr toolkit, below the analyzer and the rewrites: a jaxpr's levels and what flows
where in one (`_levels`), equations replayed as JAX binds them and bound again with a
rewritten body (`_replay`), a body jitted as the step was (`_jitted`), and which equations
are grouped and expert matmuls (`_patterns`)."""

from ._jitted import jit_equation as jit_equation
from ._jitted import jitted_like as jitted_like
from ._levels import carries as carries
from ._levels import connected_parts as connected_parts
from ._levels import consumers_of as consumers_of
from ._levels import downstream as downstream
from ._levels import equations as equations
from ._levels import is_literal as is_literal
from ._levels import reaches as reaches
from ._levels import Sub as Sub
from ._levels import sub_of as sub_of
from ._levels import variables as variables
from ._patterns import grouped_matmul_sources as grouped_matmul_sources
from ._patterns import is_expert_batched_eqn as is_expert_batched_eqn
from ._patterns import is_grouped_matmul_eqn as is_grouped_matmul_eqn
from ._patterns import reads_expert_weights as reads_expert_weights
from ._replay import ANNOTATIONS as ANNOTATIONS
from ._replay import bind_eqn as bind_eqn
from ._replay import bind_with as bind_with
from ._replay import read as read
from ._replay import replay as replay
from ._replay import SHARDING_PARAMS as SHARDING_PARAMS
