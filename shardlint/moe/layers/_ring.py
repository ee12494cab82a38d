"""Expert matmuls with weights sharded along D: gathered whole in pieces, or passed round a ring.

In the memory-lean layout every device holds a 1/n slice of each expert matrix along the
embed dimension D (n: the size of the weight axes). Gathering a layer's matrices whole at
once puts all of them on every device (64 experts x 2048 x 1024 x 3 in bf16 is 768 MiB)
and their full gradients too, until the reduce-scatter. Two schedules avoid that.

The gathered one (`ring=False`) cuts every device's slice into `pieces` pieces along the
weights' K and, one piece at a time in a loop, gathers the piece whole along D and adds
its product with x's matching columns to the result (a sum over K, which is the product).
The backward pass gathers each piece again, adds its share of the input gradient, and
reduce-scatters its gradient to the piece's owners. In 2n pieces (`ShardedRoutedMoE`'s
choice) a device holds, besides its own slice, a piece gathered whole and its gradient:
1/n of a matrix together.
  - Autodiff through a plain gather would save the gathered matrix for the backward pass,
    so that a stack of layers without remat holds every layer's whole matrices from its
    forward pass to its backward; here only the local slice is saved, as FSDP does.
  - The backward pass takes the slice through an optimization barrier: without it XLA
    sees the same gathers twice and keeps the forward's for the backward pass, which the
    TPU compiler did for every layer of a Python loop of layers (temp 85 / 139 / 262 MB
    for 1 / 2 / 4 layers against 51 / 47 / 77 MB with it; v5p, 4 chips, bf16, emb and
    mlp 1024, 8 experts, seq 1024). XLA:CPU drops optimization barriers before its last
    CSE pass and merges the two anyway.
  - Pieces are gathered along a new leading dimension: gathered along D itself (a minor
    dimension) the TPU compiler first re-laid out every device's whole slice.

The ring (`ring=True`) keeps one slice in hand:

  forward   n steps; at each, multiply by the slice in hand, then pass it to the next
            device (`ppermute`); a contraction over D sums the partial products of the
            matching slice of x, an expansion to D writes its slice of the output.
  backward  the slices go round again for the input gradient; each device adds its
            contribution to the gradient of one slice into a buffer that travels round
            the ring one step behind the slices and arrives, after n - 1 steps, at the
            slice's owner with every device's contribution (a reduce-scatter done as it
            computes).

Per device, the slice in hand and the one arriving: 2/n of a matrix, and as much of its
gradient. On the TPU compiler (v5p, bf16, emb 2048, mlp 1024, 64 experts, seq 8192) the
gathered schedule in 2n pieces measured less temp at 2, 4 and 8 devices.

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
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


# bilinear in (activations, weights); `aux`: integer operands it needs (group sizes)
Product = Callable[[jax.Array, Any, tuple], Any]


@dataclasses.dataclass(frozen=True)
class WeightSlices:
    """The mesh axes whose devices hold the slices of D, in the order `all_gather` stacks
    them, how many devices there are, and the schedule: passed round the ring (`ring`),
    or gathered whole in `pieces` pieces along K (fewer where that many do not divide a
    weight's K). On one device (`IN_PLACE`) the product is multiplied in place."""

    axes: tuple[str, ...]
    size: int
    ring: bool
    pieces: int = 1

    @property
    def whole(self) -> WeightSlices:
        """The same slices gathered whole in one piece (for weights too small to be worth
        a ring or a loop)."""
        return dataclasses.replace(self, ring=False, pieces=1)

    def _fitted(self, w: Any) -> WeightSlices:
        """These slices in `pieces` pieces, or the largest count below it that divides
        every weight's K."""
        pieces = math.gcd(self.pieces, *(v.shape[-2] for v in jax.tree.leaves(w)))
        return dataclasses.replace(self, pieces=pieces)

    def blocks(self, dim: int) -> int:
        """How many devices' slices make up the weights' K: all of them when K is D
        (`dim` -2), else one."""
        return self.size if dim == -2 else 1

    def contract(self, product: Product, x: jax.Array, w: Any, aux: tuple = ()) -> Any:
        """`product(x, w_whole, aux)` for a product that contracts x's last dimension (D)
        with the weights' K = D, each device holding its slice of D in `w`."""
        if self.size == 1:
            return product(x, w, aux)
        if not self.ring:
            return _gathered(product, -2, self._fitted(w), x, w, aux)
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
            return _gathered(product, -1, self._fitted(w), x, w, aux)

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
    """Every weight of `w` gathered whole along its dimension `dim` (from the end).

    Gathered along a new leading dimension, then moved to `dim`: a gather along a minor
    dimension made the TPU compiler re-lay out each device's whole slice in memory
    first (a copy of the slice per matrix, measured), a leading one does not."""
    def one(v: jax.Array) -> jax.Array:
        stacked = jax.lax.all_gather(v, axes, axis=0, tiled=False)
        d = v.ndim + dim
        return jnp.moveaxis(stacked, 0, d).reshape(v.shape[:d] + (-1,) + v.shape[d + 1:])
    with jax.named_scope("moe/gather_weights"):
        return jax.tree.map(one, w)


def _sum_scattered(g: jax.Array, dim: int, slices: WeightSlices) -> jax.Array:
    """The sum over devices of g, each device keeping its slice along `dim` (from the
    end): `_whole`'s transpose, its blocks moved to the front the same way."""
    d = g.ndim + dim
    blocks = g.reshape(g.shape[:d] + (slices.size, -1) + g.shape[d + 1:])
    return jax.lax.psum_scatter(jnp.moveaxis(blocks, d, 0), slices.axes, scatter_dimension=0)


def _piece(v: Any, c: Any, count: int, dim: int) -> Any:
    """Piece c of `count` equal pieces of every array of `v` along `dim` (from the end)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(
        a, c * (a.shape[dim] // count), a.shape[dim] // count, axis=a.ndim + dim), v)


def _put(total: Any, part: Any, c: Any, dim: int) -> Any:
    """`total` with piece c along `dim` (from the end) replaced by `part`."""
    return jax.tree.map(lambda t, p: jax.lax.dynamic_update_slice_in_dim(
        t, p, c * p.shape[dim], axis=t.ndim + dim), total, part)


def _columns(x: jax.Array, c: Any, pieces: int, blocks: int) -> jax.Array:
    """The columns of x that meet piece c of the weights' K gathered whole: x's last
    dimension in `blocks` blocks (one per device's slice when K is D, else one), piece c
    of each."""
    blocked = x.reshape(x.shape[:-1] + (blocks, -1))
    return _piece(blocked, c, pieces, -1).reshape(x.shape[:-1] + (-1,))


def _put_columns(x: jax.Array, part: jax.Array, c: Any, blocks: int) -> jax.Array:
    """x with the columns that `_columns(x, c, ...)` takes replaced by `part`."""
    blocked = x.reshape(x.shape[:-1] + (blocks, -1))
    part = part.reshape(x.shape[:-1] + (blocks, -1))
    return _put(blocked, part, c, -1).reshape(x.shape)


def _over_pieces(step: Callable[[Any, Any], Any], init: Any, pieces: int) -> Any:
    """`step(c, carry)` for c = 0 .. pieces - 1, in a loop after the first (whose result
    has the types the loop carries: varying over the mesh axes as the steps make it)."""
    first = step(0, init)
    return jax.lax.fori_loop(1, pieces, step, first) if pieces > 1 else first


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _gathered(product, dim, slices, x, w, aux):
    """product(x, w gathered whole along its dimension `dim`, aux): the sum over pieces c
    of the weights' K (every device's slice in `slices.pieces` pieces) of x's matching
    columns times piece c gathered whole."""
    pieces, blocks = slices.pieces, slices.blocks(dim)

    def step(c, y):
        whole_c = _whole(_piece(w, c, pieces, -2), dim, slices.axes)
        return _add(y, product(_columns(x, c, pieces, blocks), whole_c, aux))

    y = jax.eval_shape(product, x, _whole(w, dim, slices.axes), aux)
    return _over_pieces(step, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), y), pieces)


def _gathered_fwd(product, dim, slices, x, w, aux):
    return _gathered(product, dim, slices, x, w, aux), (x, w, aux)


def _gathered_bwd(product, dim, slices, residuals, ct):
    """Gather the matrix again, piece by piece; each piece's gradient leaves summed over
    the devices and scattered to their slices."""
    x, w, aux = residuals
    pieces, blocks = slices.pieces, slices.blocks(dim)
    w = jax.lax.optimization_barrier(w)   # gathered again, not the forward's

    def step(c, grads):
        dx, dw = grads
        whole_c = _whole(_piece(w, c, pieces, -2), dim, slices.axes)
        x_c = _columns(x, c, pieces, blocks)
        dx_c = jax.linear_transpose(lambda v: product(v, whole_c, aux), x_c)(ct)[0]
        dwhole_c = jax.linear_transpose(lambda v: product(x_c, v, aux), whole_c)(ct)[0]
        dw_c = jax.tree.map(lambda g: _sum_scattered(g, dim, slices), dwhole_c)
        return _put_columns(dx, dx_c, c, blocks), _put(dw, dw_c, c, -2)

    init = (jnp.zeros_like(x), jax.tree.map(jnp.zeros_like, w))
    dx, dw = _over_pieces(step, init, pieces)
    return dx, dw, jax.tree.map(_no_gradient, aux)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)
