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
    found: set[tuple[str, int]] = set()
    _walk(closed_jaxpr.jaxpr, found)
    return frozenset(found)


def _walk(jaxpr, found: set) -> None:
    for eqn in jaxpr.eqns:
        if is_grouped_matmul_eqn(eqn):
            frame = _jax.user_frame(eqn)
            if frame is not None:
                found.add(frame)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _walk(inner, found)
