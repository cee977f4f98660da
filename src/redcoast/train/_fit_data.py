"""`fit`'s examples: each epoch's examples into global batches, the first of them
collated once (to trace `loss_fn`), and what a checkpoint records of the data."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from ..parallel.mesh import mesh_shape
from ._resume import Run
from .data import Batch, CollateFn, Examples, batches, order_fingerprint
from .evaluate import check_examples


def epochs(
    train_examples: Examples | Callable[[int], Examples],
    *,
    collate_fn: CollateFn,
    run: Run,
) -> tuple[Batch, Callable[[int, int], tuple[Iterator[Batch], int]], Run]:
    """The first batch (collated once, to trace `loss_fn`), `(epoch, start) -> batches`, and
    `run` whose `data` is `epoch -> {"n_examples", "order"}` (its length and
    `order_fingerprint`), what checkpoints record of each epoch."""
    size, seed = run.size, run.seed

    def examples_of(epoch: int) -> Examples:
        examples = train_examples(epoch) if callable(train_examples) else train_examples
        examples = check_examples(examples, f"train_examples (epoch {epoch})")
        if len(examples) < size:
            shards = "" if run.context else f" x {mesh_shape(run.mesh)[0]} data shards"
            raise ValueError(
                f"train_examples has {len(examples)} examples in epoch {epoch}, fewer than one "
                f"global batch of {size} (per_device_batch_size{shards} x "
                "accumulate_grad_batches); the partial batch would be dropped. Use a smaller "
                "per_device_batch_size."
            )
        return examples

    # Asked for once an epoch: train_examples(epoch) may build the examples anew on each call.
    held: dict[int, Examples] = {0: examples_of(0)}

    def examples(epoch: int) -> Examples:
        if epoch not in held:
            held.clear()
            held[epoch] = examples_of(epoch)
        return held[epoch]

    first_examples = held[0]
    kw: dict[str, Any] = {
        "collate_fn": collate_fn,
        "mesh": run.mesh,
        "batch_size": size,
        "seed": seed,
        "split_rows": run.context is None,
    }
    first = next(batches(first_examples, epoch=0, **kw))

    def epoch_batches(epoch: int, start: int) -> tuple[Iterator[Batch], int]:
        those = examples(epoch)
        if epoch == 0 and start == 0:
            it = itertools.chain([first], batches(those, epoch=0, start=1, **kw))
        else:
            it = batches(those, epoch=epoch, start=start, **kw)
        return it, len(those) // size

    @functools.lru_cache(maxsize=2)
    def data(epoch: int) -> dict[str, Any]:
        n = len(examples(epoch))
        return {"n_examples": n, "order": order_fingerprint(n, seed=seed, epoch=epoch)}

    return first, epoch_batches, dataclasses.replace(run, data=data)


def total_steps(
    train_examples: Any, n_epochs: int | None, max_steps: int | None, size: int
) -> int | None:
    if callable(train_examples) or n_epochs is None:
        return max_steps
    per_run = n_epochs * (len(train_examples) // size)
    return per_run if max_steps is None else min(max_steps, per_run)
