"""Context parallelism for whole models: every sequence split over a mesh axis.

`ContextParallel` splits axis 1 (the sequence) of every batch array over a mesh
axis, the data axis by default, and has `redcoast.nn.attention` run
`context_parallel_attention` over it; everything else a decoder computes works
token by token, and the compiler keeps it split along the sequence.
"""

import dataclasses
import math
from typing import Any, Literal

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PyTree

from .._checks import check_choice
from ..nn._blockwise import default_block
from ._ring import STRATEGIES, context_parallel_attention
from .mesh import DATA

__all__ = ["ContextParallel", "check_context"]


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Every sequence split over a mesh axis: context parallelism for causal models.

    Device `i` of `axis` holds the `i`-th contiguous block of every sequence of the
    batch, so no device holds a whole sequence's activations, and the whole batch
    (no row is split off to another device of `axis`). The per-token parts of a model
    (embeddings, norms, projections, the loss) need nothing: the compiler keeps them
    split along the sequence. Attention is the one place where tokens meet:
    `redcoast.nn.attention` (the zoo's decoders', or a user's model's) then runs
    `context_parallel_attention` over `axis`, causally, with the attention's window,
    soft-cap and segment ids, each device's share in blocks (blockwise attention)
    unless the attention asks for `implementation="einsum"`. A model that attends
    otherwise, or not at all, is refused: its attention would gather the whole
    sequence on every device.

    With the default `axis="data"` the data axis splits each sequence instead of the
    batch: a batch smaller than the data axis (down to one sequence) trains on every
    device, and the model axis keeps tensor (and sequence) parallelism. Weights
    split over the data axis (FSDP) are gathered as without it.

    Pass it as `context_parallel=` to `train_step`, `eval_step` and `predict_step`
    (`fit(context_parallel=True)` builds it). In the batch, axis 1 of every array of
    two or more dimensions is the sequence; the axis's size must divide it.

    Attributes:
        mesh: the device mesh.
        axis: the mesh axis the sequence is split over.
        strategy: `"ring"` or `"all_gather"` (see `context_parallel_attention`).

    Raises:
        ValueError: `axis` is not an axis of `mesh`, or `strategy` is unknown.

    Example:
        >>> cp = rc.ContextParallel(rc.make_mesh(2))       # sequences over "data" (4)
        >>> step = rc.train_step(rc.models.lm_loss, optimizer, mesh=cp.mesh,
        ...                      context_parallel=cp)
    """

    mesh: Mesh
    axis: str = DATA
    strategy: Literal["ring", "all_gather"] = "ring"

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}.")
        if self.axis not in self.mesh.axis_names:
            raise ValueError(
                f"axis={self.axis!r} is not an axis of this mesh, whose axes are "
                f"{dict(self.mesh.shape)}; pass one of {list(self.mesh.axis_names)}."
            )
        check_choice("strategy", self.strategy, STRATEGIES)

    @property
    def size(self) -> int:
        """How many blocks each sequence is split into."""
        return int(self.mesh.shape[self.axis])

    def attend(
        self,
        q: Float[Array, "*batch seq heads head_dim"],
        k: Float[Array, "*batch seq kv_heads head_dim"],
        v: Float[Array, "*batch seq kv_heads head_dim"],
        *,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        segment_ids: Int[Array, "..."] | None = None,
        kv_segment_ids: Int[Array, "..."] | None = None,
        blockwise: bool = True,
        block_size: int | tuple[int, int] | None = None,
    ) -> Float[Array, "*batch seq heads head_dim"]:
        """Causal attention of `q` to `k` and `v`, the sequence split over `axis`.

        Args:
            q, k, v: as for `rc.nn.attention`.
            window, softcap, scale, segment_ids, kv_segment_ids: as for
                `rc.nn.attention`.
            blockwise: each device's share of the sequence in blocks (`block_size`,
                by default the largest divisor of the share up to 512), so no device
                holds a share's whole `(share, share)` scores; False: one block per
                ring step.
            block_size: queries and keys per block within a device's share.

        Raises:
            ValueError: the axis's size does not divide the sequence.
        """
        seq, n = q.shape[-3], self.size
        if seq % n:
            raise ValueError(
                f"context parallelism splits every sequence over the {self.axis!r} axis of "
                f"size {n}, and attention got a sequence of {seq} tokens, not a multiple of "
                f"{n}. Make the rows {math.ceil(seq / n) * n} tokens long (rc.text.packed's "
                "block_size, or padding in collate_fn; rc.models.lm_loss runs the model on "
                "whole rows), or use a mesh whose data axis divides the rows' length."
            )
        if blockwise and block_size is None and self.strategy == "ring":
            block_size = default_block(seq // n)
        return context_parallel_attention(
            q,
            k,
            v,
            mesh=self.mesh,
            axis=self.axis,
            causal=True,
            strategy=self.strategy,
            window=window,
            softcap=softcap,
            scale=scale,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            block_size=block_size if self.strategy == "ring" else None,
        )

    def constrain(self, batch: PyTree) -> PyTree:
        """`batch` with axis 1 (the sequence) of every array of 2+ dimensions split over `axis`.

        Arrays whose axis 1 the axis's size does not divide are left as they are; the
        attention names the sizes if such a sequence reaches it.
        """
        spec = NamedSharding(self.mesh, P(None, self.axis))

        def one(x: Any) -> Any:
            if not eqx.is_array(x) or x.ndim < 2 or x.shape[1] % self.size:
                return x
            return jax.lax.with_sharding_constraint(x, spec)

        return jax.tree.map(one, batch)


def check_context(option: object) -> None:
    """Raise a `TypeError` unless `option` is `None` or a `ContextParallel`."""
    if option is not None and not isinstance(option, ContextParallel):
        raise TypeError(
            "context_parallel must be None or an rc.ContextParallel, e.g. "
            f"context_parallel=rc.ContextParallel(mesh); got {type(option).__name__}."
        )
