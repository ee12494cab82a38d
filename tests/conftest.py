"""Test configuration: simulate 8 CPU devices before any backend starts.

This is the one place the device count is set; test modules never touch XLA_FLAGS.
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
