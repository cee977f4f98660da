"""What a model's computation must know of how it is split: one object, passed to the steps.

Three settings follow from how a model is placed and what a run asks for: which
weights are stored split over the data axis (FSDP gathers each where it is used),
which projections split the activations over the model axis (sequence
parallelism), and whether every sequence is split over a mesh axis (context
parallelism). `Parallelism` holds all three. It is read once from the placed
model (`Parallelism.of`), handed to the jitted step as a static argument (two
models placed alike share a compilation), and activated while the step traces the
user's function (`Parallelism.applied`), where `redcoast.nn` and `redcoast.fsdp`
read it. Nothing of it is written into the model, whose structure is the same
wherever its arrays are placed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
from jax.sharding import Mesh
from jaxtyping import PyTree

from . import _active
from ._context_parallel import ContextParallel
from ._sequence import KEEP_GATHERED, SequenceParallel
from .fsdp import StoredLayout
from .place import model_mesh

__all__ = ["ContextOption", "Parallelism", "SequenceOption", "check_options", "with_parallelism"]

SequenceOption = bool | Literal["keep gathered"] | SequenceParallel
"""`sequence_parallel=`: `False`; `True` or `"keep gathered"` (read from the model's
placement); or a `SequenceParallel` read once."""
ContextOption = bool | ContextParallel | None
"""`context_parallel=`: `False` (or None); `True` (every sequence split over the data
axis of the mesh); or a `ContextParallel` (another axis or strategy)."""


def check_options(sequence_parallel: Any, context_parallel: Any) -> None:
    """Raise a `TypeError` naming the option unless each has one of its accepted types."""
    if not isinstance(sequence_parallel, bool | SequenceParallel) and (
        sequence_parallel != KEEP_GATHERED
    ):
        raise TypeError(
            "sequence_parallel must be True, False, 'keep gathered' or an "
            f"rc.SequenceParallel; got {sequence_parallel!r}."
        )
    if not isinstance(context_parallel, bool | ContextParallel | None):
        raise TypeError(
            "context_parallel must be True, False or an rc.ContextParallel, e.g. "
            f"context_parallel=rc.ContextParallel(mesh); got {type(context_parallel).__name__}."
        )


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How a model's computation is split beyond what its arrays' shardings say.

    Hashable: a step takes it as a static argument. `train_step`, `eval_step`,
    `predict_step` and `fit` read it from the model at each call; under your own
    `jax.jit` of a step made with `jit=False`, read it once from the placed model
    and pass it as `parallelism=`.

    Attributes:
        fsdp: the weights stored split over the data axis, gathered where they are
            used (`redcoast.fsdp`); None when there are none.
        sequence: the activations split over the model axis (`SequenceParallel`).
        context: every sequence split over a mesh axis (`ContextParallel`).

    Example:
        >>> model = rc.place(model, mesh, fsdp=True)
        >>> parallelism = rc.Parallelism.of(model, sequence_parallel=True)
        >>> step = rc.train_step(loss_fn, optimizer, jit=False, parallelism=parallelism)
    """

    fsdp: StoredLayout | None = None
    sequence: SequenceParallel | None = None
    context: ContextParallel | None = None

    @classmethod
    def of(
        cls,
        model: PyTree,
        *,
        sequence_parallel: SequenceOption = False,
        context_parallel: ContextOption = False,
        mesh: Mesh | None = None,
    ) -> Parallelism:
        """What `model`'s placement implies, with the splits asked for.

        Args:
            model: the placed model (or its `jax.ShapeDtypeStruct`s with shardings);
                inside a step, its traced arrays (what the active step knows of them).
            sequence_parallel: see `SequenceOption`.
            context_parallel: see `ContextOption`; `True` needs `mesh` or a placed model.
            mesh: the mesh `context_parallel=True` splits over (default: the model's).

        Raises:
            TypeError: an option of the wrong type.
            ValueError: `sequence_parallel` on a model with no projection split over a
                model axis, or on traced arrays (`SequenceParallel.of`);
                `context_parallel=True` with no mesh to split over.
        """
        check_options(sequence_parallel, context_parallel)
        fsdp = StoredLayout.of(model) if _placed(model) else StoredLayout.carried(model)
        sequence = None
        if isinstance(sequence_parallel, SequenceParallel):
            sequence = sequence_parallel
        elif sequence_parallel:
            if not _placed(model):
                raise ValueError(
                    f"sequence_parallel={sequence_parallel!r} reads where to split from the "
                    "model's placement, and this model's arrays are traced (the step runs "
                    "inside your own jax.jit). Read it once from the placed model and pass "
                    "that: parallelism=rc.Parallelism.of(model, sequence_parallel=True)."
                )
            keep = sequence_parallel == KEEP_GATHERED
            sequence = SequenceParallel.of(model, keep_gathered=keep)
        context = context_parallel if isinstance(context_parallel, ContextParallel) else None
        if context_parallel is True:
            mesh = mesh or model_mesh(model)
            if mesh is None:
                raise ValueError(
                    "context_parallel=True splits every sequence over the mesh's data axis, "
                    "and this model is not placed on a mesh: place it (rc.place), or pass "
                    "mesh= or context_parallel=rc.ContextParallel(mesh)."
                )
            context = ContextParallel(mesh)
        return cls(fsdp, sequence, context)

    @property
    def mesh(self) -> Mesh | None:
        """The mesh the split is over, when a part of it names one (FSDP's stored
        weights, sequence or context parallelism); None for data or tensor parallelism
        alone, which the arrays' shardings carry."""
        if self.context is not None:
            return self.context.mesh
        if self.sequence is not None:
            return self.sequence.mesh
        if self.fsdp is not None and self.fsdp.shardings:
            mesh = self.fsdp.shardings[0][1].mesh
            return mesh if isinstance(mesh, Mesh) else None
        return None

    @contextlib.contextmanager
    def applied(
        self, model: PyTree, batch: PyTree = None, *, mesh: Mesh | None = None
    ) -> Iterator[tuple[PyTree, PyTree]]:
        """Active around the user's function: `with p.applied(model, batch) as (model, batch):`.

        Yields the model with its sequence-parallel projections wrapped and the batch
        with its sequences split (context parallelism); inside the block,
        `fsdp.layouts` finds `model`'s data-split weights and `nn.attention` splits
        the sequence. Call it where the function receives the model it runs, after
        any cast: the weights are known by the arrays `model` holds. `mesh`, the
        step's own, is the one attention kernels run over (`nn.attention`'s
        `"pallas"` under `shard_map`) when no part of the split names one.

        Raises:
            ValueError: under context parallelism, the block ran no attention through
                `rc.nn.attention` or `rc.context_parallel_attention` (its attention,
                if any, would gather every sequence on every device).
        """
        gathers = {} if self.fsdp is None else self.fsdp.gathers(model)
        if self.sequence is not None:
            model = self.sequence.apply(model)
        if self.context is not None:
            batch = self.context.constrain(batch)
        active = _active.Active(gathers, self.context, self.mesh or mesh)
        with _active.activated(active):
            yield model, batch
        if self.context is not None and active.attention_calls == 0:
            raise ValueError(
                "context parallelism splits every sequence over the "
                f"{self.context.axis!r} axis, and this model attends through neither "
                "rc.nn.attention nor rc.context_parallel_attention (eqx.nn."
                "MultiheadAttention, its own einsum, or no attention at all): its "
                "attention would gather each whole sequence on every device. Call "
                "rc.nn.attention(q, k, v, causal=True) in its attention, or train "
                "without context_parallel."
            )


def _placed(model: PyTree) -> bool:
    """Whether `model`'s arrays say where they are: concrete, or abstract with shardings.

    A traced array has no `sharding` to read.
    """
    for x in jax.tree.leaves(model):
        if isinstance(x, jax.ShapeDtypeStruct):
            return getattr(x, "sharding", None) is not None
        if isinstance(x, jax.Array):
            return hasattr(x, "sharding")
    return False


def with_parallelism(
    fn: Callable[..., Any],
    *,
    sequence_parallel: SequenceOption,
    context_parallel: ContextOption,
    mesh: Mesh | None,
    given: Parallelism | None,
) -> Callable[..., Any]:
    """`fn(model, *args)` calling `fn(model, *args, parallelism=...)`: `given`, or read
    from the model at each call with the options asked for.

    Read outside `fn`, so a jitted `fn` takes it as a static argument. `lower` is
    kept when `fn` has it.

    Raises:
        ValueError: both `given` and one of the options.
    """
    check_options(sequence_parallel, context_parallel)
    if given is not None and (sequence_parallel is not False or context_parallel):
        raise ValueError(
            "parallelism= already says how the model is split; pass it alone, or "
            "sequence_parallel= / context_parallel= to read it from the model at each call."
        )

    def resolve(model: Any) -> Parallelism:
        if given is not None:
            return given
        return Parallelism.of(
            model,
            sequence_parallel=sequence_parallel,
            context_parallel=context_parallel,
            mesh=mesh,
        )

    @functools.wraps(fn)
    def call(model: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(model, *args, parallelism=resolve(model), **kwargs)

    if hasattr(fn, "lower"):
        lower = fn.lower  # type: ignore[attr-defined]

        def lowered(model: Any, *args: Any, **kwargs: Any) -> Any:
            return lower(model, *args, parallelism=resolve(model), **kwargs)

        call.lower = lowered  # type: ignore[attr-defined]
    return call
