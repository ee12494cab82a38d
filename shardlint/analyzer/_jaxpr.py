"""What only the jaxpr knows: which equations are grouped matmuls, and where they are.

XLA:CPU lowers `ragged_dot` to a masked dense dot that is indistinguishable from other
dots in HLO, so the analysis asks the traced program instead and matches by source line.
Reading a user frame goes through JAX's private `source_info_util`, behind
`shardlint._jax.user_frame`.
"""

from __future__ import annotations

from .. import _jax
from ._patterns import is_grouped_matmul_eqn


def grouped_matmul_sources(closed_jaxpr) -> frozenset[tuple[str, int]]:
    found = (_jax.user_frame(eqn) for eqn in _jax.equations(closed_jaxpr.jaxpr) if is_grouped_matmul_eqn(eqn))
    return frozenset(frame for frame in found if frame is not None)
