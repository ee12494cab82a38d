"""ShardedRoutedMoE's gathered weights on the TPU compiler: one layer's at a time.

The whole gather gathers each expert matrix for the forward pass and again for the
backward pass (`shardlint.moe.layers._ring`). If XLA may treat the two gathers as one, it keeps
the forward's result until the backward pass: in a Python loop of layers (no scan), every
layer's whole matrices then stay in memory from its forward pass to its backward. XLA:CPU
does that whatever the code says (it drops optimization barriers before its last CSE
pass), so only the TPU compiler can check it. Needs libtpu; run with
`python -m pytest -q -m tpu -n 0`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint import moe
from shardlint.analyzer.compile._topology import topology_mesh

pytestmark = pytest.mark.tpu

TOPOLOGY = "v5p:2x2x1"
CFG = moe.MoeConfig(num_experts=8, top_k=2, emb_dim=512, mlp_dim=512, dtype=jnp.bfloat16)
SEQ = 512


@pytest.mark.parametrize("gather", ["whole", "ring"])
def test_a_python_loop_of_layers_holds_one_layer_s_gathered_matrices(gather):
    mesh = topology_mesh({"data": 1, "context": 4}, TOPOLOGY)
    layer = moe.ShardedRoutedMoE(CFG, mesh, batch_axes=(), seq_axes="context",
                                 weight_gather=gather)
    shapes = jax.eval_shape(layer.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, SEQ, CFG.emb_dim), CFG.dtype,
                             sharding=NamedSharding(mesh, P(None, "context")))

    def loss(stack, x):
        for params in stack:
            x = x + layer(params, x)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    def temp(layers: int) -> int:
        stack = [jax.tree.map(lambda w, s: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=s),
                              shapes, layer.param_shardings()) for _ in range(layers)]
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return step.lower(stack, x).compile().memory_analysis().temp_size_in_bytes

    matrices = sum(shapes[k].size * shapes[k].dtype.itemsize for k in ("wi_0", "wi_1", "wo"))
    two, four = temp(2), temp(4)
    # Two layers more add their activations, not their whole expert matrices.
    assert four - two < 2 * matrices, (two, four, matrices)
