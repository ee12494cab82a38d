"""A compat shim the way MaxText writes one (its tunix adapter): a module-level function
installed in place of `jax.lax.top_k` that forwards to the original. Imported by
test_stack; installing it is the test's job."""

from __future__ import annotations

import jax

ORIGINAL_TOP_K = jax.lax.top_k


def compat_top_k(operand, k, axis=-1):
    return ORIGINAL_TOP_K(operand, k, axis=axis)
