"""Prompts of any lengths padded to a few lengths, so that sampling compiles a few programs."""

from collections.abc import Sequence

import numpy as np
from jaxtyping import ArrayLike

from .._checks import check_positive, int32_overflow


def bucket_length(length: int, *, multiple: int = 64, max_length: int | None = None) -> int:
    """The padded length of a batch whose longest prompt has `length` tokens: the next
    multiple of `multiple`, at most `max_length`.

    Raises:
        ValueError: `length` is longer than `max_length`, or a setting is not positive.

    Example:
        >>> bucket_length(70), bucket_length(70, max_length=100)
        (128, 100)
    """
    check_positive("length", length, optional=False)
    check_positive("multiple", multiple, optional=False)
    check_positive("max_length", max_length)
    if max_length is not None and length > max_length:
        raise ValueError(
            f"a prompt of {length} tokens is longer than max_length={max_length}; truncate "
            "the prompts, or give room for them (a smaller max_new_tokens)."
        )
    padded = -(-length // multiple) * multiple
    return padded if max_length is None else min(padded, max_length)


def pad_prompts(
    prompts: Sequence[Sequence[int] | ArrayLike],
    *,
    multiple: int = 64,
    max_length: int | None = None,
    pad_id: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad a batch of token-id prompts to their bucket's length (`bucket_length`).

    `sample` and `generate` compile a program per prompt length; batches whose longest
    prompts fall in one bucket share it. Give `max_length` as the model's positions less
    `max_new_tokens` when it has a position table.

    Args:
        prompts: one sequence of token ids per prompt, each of at least one token.
        multiple: the bucket's step: a batch's prompts are padded to the next multiple.
        max_length: the longest padded length allowed (the last bucket is cut to it).
        pad_id: what the padding holds (never fed to the model).

    Returns:
        `(ids, lengths)`: int32 `(batch, bucket)` ids and `(batch,)` lengths, as
        `sample`'s `prompt_ids` and `prompt_lengths`.

    Raises:
        ValueError: no prompts, an empty prompt, one longer than `max_length`, or ids
            that are not integers or do not fit in int32.

    Example:
        >>> ids, lengths = pad_prompts([[5, 6, 7], [8, 9]], multiple=4)
        >>> ids.tolist(), lengths.tolist()
        ([[5, 6, 7, 0], [8, 9, 0, 0]], [3, 2])
    """
    rows = [np.asarray(p).reshape(-1) for p in prompts]
    if not rows:
        raise ValueError("pad_prompts got no prompts; give at least one.")
    lengths = np.array([len(r) for r in rows], np.int32)
    if lengths.min() == 0:
        raise ValueError(
            f"prompt {int(np.argmin(lengths))} has no tokens; each prompt needs at least one "
            "(e.g. the tokenizer's BOS token)."
        )
    every = np.concatenate(rows)
    if not np.issubdtype(every.dtype, np.integer):
        raise ValueError(f"prompts must hold integer token ids; got {every.dtype}.")
    if int32_overflow(every) is not None:
        raise ValueError(
            f"prompts hold token ids in [{every.min()}, {every.max()}], outside the int32 "
            "range of token ids; check what produced them."
        )
    width = bucket_length(int(lengths.max()), multiple=multiple, max_length=max_length)
    ids = np.full((len(rows), width), pad_id, np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids, lengths
