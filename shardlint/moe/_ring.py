"""Expert matmuls with weights sharded along D: gathered whole, or passed round a ring.

In the memory-lean layout every device holds a 1/n slice of each expert matrix along the
embed dimension D (n: the size of the weight axes). Gathering a layer's matrices whole
puts all of them on every device at once (64 experts x 2048 x 1024 x 3 in bf16 is 768 MiB)
and their full gradients too, until the reduce-scatter. The ring keeps one slice in hand:

  forward   n steps; at each, multiply by the slice in hand, then pass it to the next
            device (`ppermute`); a contraction over D sums the partial products of the
            matching slice of x, an expansion to D writes its slice of the output.
  backward  the slices go round again for the input gradient; each device adds its
            contribution to the gradient of one slice into a buffer that travels round
            the ring one step behind the slices and arrives, after n - 1 steps, at the
            slice's owner with every device's contribution (a reduce-scatter done as it
            computes).

Per device, the slice in hand and the one arriving (2/n of a matrix, and as much of its
gradient) instead of the whole matrix and its whole gradient: less from n = 3 on in
principle; at n = 2 they are the whole matrix. On the TPU compiler the whole gather
measured less up to n = 4, so that is `ShardedRoutedMoE`'s default there.

The other schedule (`ring=False`): all-gather the matrix for the product, and in the
backward pass gather it again and reduce-scatter its gradient. Autodiff through a plain
gather would save the gathered matrix for the backward pass, so that a stack of layers
without remat holds every layer's whole matrices from its forward pass to its backward
(measured: temp grew by the gathered matrices for every layer of a scan); here only the
local slice is saved, as FSDP does. The backward pass gathers the slice as it comes out
of an optimization barrier: without one XLA sees the same gather twice and keeps the
forward's result for the backward pass, which the TPU compiler did for every layer of a
Python loop of layers: temp 85 / 139 / 262 MB for 1 / 2 / 4 layers, against 51 / 47 /
77 MB with the barrier (v5p, 4 chips, bf16, emb and mlp 1024, 8 experts, seq 1024). XLA:CPU
drops optimization barriers before its last CSE pass and merges the two gathers anyway.

The products are any bilinear map of (x, w): `jax.lax.ragged_dot` for the grouped matmul,
an einsum for expert-batched slots, `matmul` for the router and the shared expert. Their
transposes come from `jax.linear_transpose`, so neither schedule restates a product's
gradient. The weights' last two dimensions are the product's contracted (K) and output
(N) ones, as in `ragged_dot`'s [G, K, N]; D is K for a contraction and N for an
expansion. On one device both are the plain product.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import _layout

# bilinear in (activations, weights); `aux`: integer operands it needs (group sizes)
Product = Callable[[jax.Array, Any, tuple], Any]


@dataclasses.dataclass(frozen=True)
class WeightSlices:
    """The mesh axes whose devices hold the slices of D, in the order `all_gather` tiles
    them, how many devices there are, and the schedule: passed round the ring (`ring`),
    or gathered whole. On one device (`IN_PLACE`) the product is multiplied in place."""

    axes: tuple[str, ...]
    size: int
    ring: bool

    @property
    def whole(self) -> WeightSlices:
        """The same slices gathered whole (for weights too small to be worth a ring)."""
        return dataclasses.replace(self, ring=False)

    def contract(self, product: Product, x: jax.Array, w: Any, aux: tuple = ()) -> Any:
        """`product(x, w_whole, aux)` for a product that contracts x's last dimension (D)
        with the weights' K = D, each device holding its slice of D in `w`."""
        if self.size == 1:
            return product(x, w, aux)
        if not self.ring:
            return _gathered(product, -2, self.axes, x, w, aux)
        d = x.shape[-1] // self.size

        def term(x, w, c, aux):
            return product(jax.lax.dynamic_slice_in_dim(x, c * d, d, axis=x.ndim - 1), w, aux)
        return _ring(term, self, x, w, aux)

    def expand(self, product: Product, x: jax.Array, w: Any, aux: tuple = ()) -> Any:
        """`product(x, w_whole, aux)` for a product whose output's last dimension is the
        weights' N = D, each device holding its slice of D in `w`."""
        if self.size == 1:
            return product(x, w, aux)
        if not self.ring:
            return _gathered(product, -1, self.axes, x, w, aux)

        def term(x, w, c, aux):
            y = product(x, w, aux)
            d = y.shape[-1]
            whole = jnp.zeros(y.shape[:-1] + (d * self.size,), y.dtype)
            return jax.lax.dynamic_update_slice_in_dim(whole, y, c * d, axis=y.ndim - 1)
        return _ring(term, self, x, w, aux)


IN_PLACE = WeightSlices((), 1, ring=False)


def matmul(x_TK: jax.Array, w: Any, aux: tuple = ()) -> Any:
    """The plain product: x times a [K, N] matrix over its last dimension, for one matrix
    or a tuple of them (in the dtype the two promote to)."""
    return jax.tree.map(lambda w_KN: jnp.einsum("...k,kn->...n", x_TK, w_KN), w)


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _pass_on(tree: Any, ring: WeightSlices) -> Any:
    """Every device's value to the next device of the ring (i -> i + 1 mod n)."""
    perm = [(i, (i + 1) % ring.size) for i in range(ring.size)]
    return jax.tree.map(lambda v: jax.lax.ppermute(v, ring.axes, perm), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(term, ring, x, w, aux):
    """sum over devices c of term(x, w_c, c, aux), w_c being device c's `w`; `term` is
    bilinear in (x, w). At step j a device holds the slice of device (me - j) mod n.
    `term` must close over no traced value (custom_vjp's rule): what it needs comes in
    as `aux`, integers that take no gradient."""
    me = jax.lax.axis_index(ring.axes)

    def step(j, carry):
        w_held, y = carry
        w_held = _pass_on(w_held, ring)
        return w_held, _add(y, term(x, w_held, (me - j) % ring.size, aux))

    return jax.lax.fori_loop(1, ring.size, step, (w, term(x, w, me, aux)))[1]


def _ring_fwd(term, ring, x, w, aux):
    return _ring(term, ring, x, w, aux), (x, w, aux)


def _ring_bwd(term, ring, residuals, ct):
    """The input gradient from the slices going round again. The weights' gradient: at
    step j a device adds its share of dW for the slice of device (me - 1 - j) mod n to a
    buffer that travels round the ring one step behind the weights and reaches that
    device, at j = n - 1, with every device's share (a reduce-scatter done while
    computing)."""
    x, w, aux = residuals
    n, me = ring.size, jax.lax.axis_index(ring.axes)

    def grad_x(w_c, c):
        return jax.linear_transpose(lambda v: term(v, w_c, c, aux), x)(ct)[0]

    def grad_w(c):
        return jax.linear_transpose(lambda v: term(x, v, c, aux), w)(ct)[0]

    def step(j, carry):
        w_held, dx, dw_travelling = carry
        w_held = _pass_on(w_held, ring)
        dw_travelling = _pass_on(dw_travelling, ring)
        return (w_held, dx + grad_x(w_held, (me - j) % n),
                _add(dw_travelling, grad_w((me - 1 - j) % n)))

    first = (w, grad_x(w, me), grad_w((me - 1) % n))
    _, dx, dw = jax.lax.fori_loop(1, n, step, first)
    return dx, dw, jax.tree.map(_no_gradient, aux)


def _no_gradient(v: jax.Array) -> np.ndarray:
    """The cotangent of an integer operand: float0 zeros."""
    return np.zeros(v.shape, jax.dtypes.float0)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _whole(w: Any, dim: int, axes: tuple[str, ...]) -> Any:
    """Every weight of `w` gathered whole along its dimension `dim` (from the end)."""
    return _layout.gather(w, jax.tree.map(lambda v: v.ndim + dim, w), axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _gathered(product, dim, axes, x, w, aux):
    """product(x, w gathered whole along its dimension `dim`, aux)."""
    return product(x, _whole(w, dim, axes), aux)


def _gathered_fwd(product, dim, axes, x, w, aux):
    return _gathered(product, dim, axes, x, w, aux), (x, w, aux)


def _gathered_bwd(product, dim, axes, residuals, ct):
    """Gather the matrix again; its whole gradient leaves reduce-scattered to the slice."""
    x, w, aux = residuals
    whole = _whole(jax.lax.optimization_barrier(w), dim, axes)   # again, not the forward's
    dx = jax.linear_transpose(lambda v: product(v, whole, aux), x)(ct)[0]
    dwhole = jax.linear_transpose(lambda v: product(x, v, aux), whole)(ct)[0]
    dw = jax.tree.map(lambda g: jax.lax.psum_scatter(
        g, axes, scatter_dimension=g.ndim + dim, tiled=True), dwhole)
    return dx, dw, jax.tree.map(_no_gradient, aux)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)
