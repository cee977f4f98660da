"""Grouped matmuls over rows sorted by expert, and where each routing's row goes.

`slots` lays out a mixture's routings as the rows ("slots") of one matrix, grouped by
expert: sorted (`"ragged"`, for `jax.lax.ragged_dot`), in equal blocks of one
expert's rows (`"blocked"`), or in a static capacity per expert (`"capacity"`).
`Groups` multiplies those rows by their experts' matrices -- forward (`mm`), by the
transposed matrices (`mm_t`) and the per-expert outer products of the weights'
gradients (`outer`) -- each only on its own expert's rows. `rc.nn.experts` runs them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import Array

__all__ = ["Groups", "Slots", "block_size", "slots"]


class Groups(eqx.Module):
    """Which slots (rows of the dispatched matrix) belong to which expert.

    `kind`: `"ragged"` (slots sorted by expert, `sizes` of each group, the slots past
    their sum empty), `"blocked"` (equal blocks of slots, each of one expert: expert
    `e`'s `count[e]` blocks from block `first[e]`; the blocks' number is `first`'s
    last entry plus its count, their size the slots over the blocks, so that no
    static field depends on how many rows were folded) or `"capacity"` (`experts`
    groups of equal size, one after the other).
    """

    kind: str = eqx.field(static=True)
    experts: int = eqx.field(static=True)
    sizes: Array | None = None
    first: Array | None = None
    count: Array | None = None
    n_blocks: Array | None = None  # `(blocks,)`: its shape is the number of blocks

    def mm(self, x: Array, w: Array) -> Array:
        """Each slot's row times its expert's `w.T`: `(S, in) x (G, out, in) -> (S, out)`."""
        return self._apply(x, w, transpose=True)

    def mm_t(self, x: Array, w: Array) -> Array:
        """Each slot's row times its expert's `w`: `(S, out) x (G, out, in) -> (S, in)`."""
        return self._apply(x, w, transpose=False)

    def outer(self, a: Array, b: Array, dtype: Any) -> Array:
        """Per expert, the sum over its slots of `a[s]^T b[s]`: `(G, out, in)`."""
        if self.kind == "capacity":
            n = self.experts
            a_, b_ = a.reshape(n, -1, a.shape[-1]), b.reshape(n, -1, b.shape[-1])
            out = jnp.einsum("ecf,ecd->efd", a_, b_, preferred_element_type=jnp.float32)
            return out.astype(dtype)
        if self.kind == "ragged":
            assert self.sizes is not None
            dims = jax.lax.RaggedDotDimensionNumbers(
                dot_dimension_numbers=(([0], [0]), ([], [])),
                lhs_ragged_dimensions=[0],
                rhs_group_dimensions=[],
            )
            # In the weights' dtype: the matrix units accumulate in float32 regardless.
            return jax.lax.ragged_dot_general(a, b, self.sizes, dims, preferred_element_type=dtype)
        assert self.first is not None and self.count is not None
        ab, bb = self._blocks(a), self._blocks(b)
        first, count = self.first, self.count

        def per_expert(e: Array, out: Array) -> Array:
            def per_block(j: Array, acc: Array) -> Array:
                i = first[e] + j
                return acc + jnp.einsum(
                    "bf,bd->fd", ab[i], bb[i], preferred_element_type=jnp.float32
                )

            acc = jnp.zeros((a.shape[-1], b.shape[-1]), jnp.float32)
            return out.at[e].set(jax.lax.fori_loop(0, count[e], per_block, acc))

        init = jnp.zeros((self.experts, a.shape[-1], b.shape[-1]), jnp.float32)
        return jax.lax.fori_loop(0, self.experts, per_expert, init).astype(dtype)

    def _apply(self, x: Array, w: Array, *, transpose: bool) -> Array:
        if self.kind == "capacity":
            spec = "ecd,efd->ecf" if transpose else "ecf,efd->ecd"
            out = jnp.einsum(spec, x.reshape(self.experts, -1, x.shape[-1]), w)
            return out.reshape(-1, out.shape[-1])
        if self.kind == "ragged":
            assert self.sizes is not None
            dims = jax.lax.RaggedDotDimensionNumbers(
                dot_dimension_numbers=(([1], [2 if transpose else 1]), ([], [])),
                lhs_ragged_dimensions=[0],
                rhs_group_dimensions=[0],
            )
            return jax.lax.ragged_dot_general(x, w, self.sizes, dims)
        assert self.first is not None and self.count is not None
        blocks, first, count = self._blocks(x), self.first, self.count
        out_dim = w.shape[1] if transpose else w.shape[2]

        def per_expert(e: Array, out: Array) -> Array:
            # The expert's matrix laid out once, for all of its blocks.
            we = jnp.swapaxes(w[e], 0, 1) if transpose else w[e]

            def per_block(j: Array, out: Array) -> Array:
                i = first[e] + j
                return out.at[i].set((blocks[i] @ we).astype(out.dtype))

            return jax.lax.fori_loop(0, count[e], per_block, out)

        init = jnp.zeros((blocks.shape[0], blocks.shape[1], out_dim), x.dtype)
        return jax.lax.fori_loop(0, self.experts, per_expert, init).reshape(-1, out_dim)

    def _blocks(self, x: Array) -> Array:
        assert self.n_blocks is not None
        return x.reshape(self.n_blocks.shape[0], -1, x.shape[-1])


def block_size(assignments: int, experts: int) -> int:
    """Rows per block: a power of two in [8, 512], such that padding every expert's last
    block adds at most an eighth of the `assignments`' work."""
    b = 8
    while b < 512 and 2 * b * experts * 8 <= assignments:
        b *= 2
    return b


class Slots(NamedTuple):
    """Where each routing goes: `assign[s]` is the routing (`token * k + j`) in slot
    `s`, or the count of routings for an empty slot."""

    assign: Array
    groups: Groups


def slots(
    chosen: Array,
    first: Array | int,
    n_local: int,
    n_experts: int,
    kind: str,
    capacity: float | None,
) -> Slots:
    """The slots of the routings to experts `first .. first + n_local - 1` of `n_experts`."""
    rows, tokens, k = chosen.shape
    a = rows * tokens * k
    e = chosen.reshape(-1).astype(jnp.int32) - first
    key = jnp.where((e >= 0) & (e < n_local), e, n_local)
    if capacity is not None:
        c = max(1, math.ceil(capacity * tokens * k / n_experts))
        c = min(c, tokens * k)
        row = jnp.arange(a, dtype=jnp.int32) // (tokens * k)
        key2 = row * (n_local + 1) + key
        order = jnp.argsort(key2, stable=True)
        counts = jnp.bincount(key2, length=rows * (n_local + 1))
        start = jnp.cumsum(counts) - counts
        sk = key2[order]
        rank = jnp.arange(a, dtype=jnp.int32) - start[sk]
        e_s, row_s = key[order], row[order]
        keep = (e_s < n_local) & (rank < c)
        size = n_local * rows * c
        pos = jnp.where(keep, e_s * (rows * c) + row_s * c + rank, size)
        assign = jnp.full((size,), a, jnp.int32).at[pos].set(order, mode="drop")
        return Slots(assign, Groups("capacity", n_local))
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)
    sk = key[order]
    if kind == "ragged":
        assign = jnp.where(sk < n_local, order, a)
        return Slots(assign, Groups("ragged", n_local, sizes=sizes))
    b = block_size(a, n_local)
    n_blocks = -(-a // b) + n_local
    counts = -(-sizes // b)
    start, first = jnp.cumsum(sizes) - sizes, jnp.cumsum(counts) - counts
    sk_c = jnp.minimum(sk, n_local - 1)
    pos = first[sk_c] * b + jnp.arange(a, dtype=jnp.int32) - start[sk_c]
    pos = jnp.where(sk < n_local, pos, n_blocks * b)
    assign = jnp.full((n_blocks * b,), a, jnp.int32).at[pos].set(order, mode="drop")
    groups = Groups(
        "blocked",
        n_local,
        first=first.astype(jnp.int32),
        count=counts.astype(jnp.int32),
        n_blocks=jnp.zeros((n_blocks,), jnp.int8),
    )
    return Slots(assign, groups)
