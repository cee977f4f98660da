"""Fixed-length rows over a token folder, read from the memory map on demand."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, overload

import numpy as np

from ._token_file import TokenFile


def _check_model(tokens: TokenFile, seq_len: int, model: Any) -> None:
    """Refuse rows the model cannot take: ids past its vocabulary, rows past its positions."""
    if model is None:
        return
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None and tokens.meta["max_id"] >= vocab:
        bad = int(np.argmax(np.asarray(tokens.tokens) >= vocab))
        raise ValueError(
            f"{tokens.path} holds token id {int(tokens.tokens[bad])} (first at "
            f"{tokens.origin_of_token(bad)}; the largest is {tokens.meta['max_id']}), but "
            f"{type(model).__name__} has a vocabulary of {vocab}: the tokenizer "
            f"{tokens.meta['tokenizer_name']} ({tokens.meta['vocab_size']} ids) is not this "
            "model's. Use the checkpoint's own tokenizer."
        )
    limit = getattr(model, "max_positions", None)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"seq_len={seq_len} is longer than {type(model).__name__}'s position table "
            f"({limit} positions); use seq_len <= {limit}."
        )


def _check_seq_len(seq_len: Any) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int | np.integer) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2 (tokens per row), got {seq_len!r}.")
    return int(seq_len)


class _Rows(Sequence[dict[str, np.ndarray]]):
    """Rows `[start, stop)` of a token file; slicing gives another view, never a copy."""

    def __init__(self, tokens: TokenFile, seq_len: int, start: int, stop: int):
        self.tokens, self.seq_len, self.start, self.stop = tokens, seq_len, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    @overload
    def __getitem__(self, i: int) -> dict[str, np.ndarray]: ...
    @overload
    def __getitem__(self, i: slice) -> _Rows: ...
    def __getitem__(self, i: int | slice) -> dict[str, np.ndarray] | _Rows:
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                raise ValueError("rows can be sliced with step 1 only.")
            new = object.__new__(type(self))
            new.__dict__.update(self.__dict__, start=self.start + a, stop=self.start + max(a, b))
            return new
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        return self._row(self.start + (i % len(self)))

    def _row(self, i: int) -> dict[str, np.ndarray]:
        raise NotImplementedError


class PackedRows(_Rows):
    """The token stream cut into rows of `seq_len` tokens; see `packed`."""

    def _row(self, i: int) -> dict[str, np.ndarray]:
        a, b = i * self.seq_len, (i + 1) * self.seq_len
        mask = self.tokens.mask
        return {
            "input_ids": self.tokens.tokens[a:b].astype(np.int32),
            "loss_mask": np.ones(self.seq_len, np.bool_) if mask is None else np.array(mask[a:b]),
        }


class PaddedRows(_Rows):
    """One document per row, padded to `seq_len`; see `padded`."""

    def __init__(self, tokens: TokenFile, seq_len: int, start: int, stop: int, pad_id: int):
        super().__init__(tokens, seq_len, start, stop)
        self.pad_id = pad_id

    def _row(self, i: int) -> dict[str, np.ndarray]:
        a, b = (int(v) for v in self.tokens.starts[i : i + 2])
        n = b - a
        ids = np.full(self.seq_len, self.pad_id, np.int32)
        ids[:n] = self.tokens.tokens[a:b]
        mask = np.zeros(self.seq_len, np.bool_)
        mask[:n] = True if self.tokens.mask is None else self.tokens.mask[a:b]
        return {"input_ids": ids, "loss_mask": mask}


def packed(tokens: TokenFile, seq_len: int, *, model: Any = None) -> PackedRows:
    """Rows of `seq_len` consecutive tokens: documents packed with EOS between them.

    As `run_clm.py`'s `group_texts`: the stream is cut into `len(tokens) // seq_len`
    rows and the remainder dropped. `loss_mask` is all true for text and the
    completion mask for instruction data.

    Args:
        tokens: from `tokenize` or `tokenize_instructions`.
        seq_len: tokens per row.
        model: when given, checked: every id within its `vocab_size`, and `seq_len`
            within its position table (`max_positions`).

    Returns:
        A sequence of `{"input_ids": int32[seq_len], "loss_mask": bool[seq_len]}`;
        slicing it (`rows[:-100]`) gives a view.

    Raises:
        ValueError: bad `seq_len`, a corpus shorter than one row, or a model that
            cannot take the rows (naming the file and line of the first bad id).

    Example:
        >>> rows = packed(tokens, 1024, model=model)
        >>> train, held_out = rows[: len(rows) - 64], rows[len(rows) - 64 :]
    """
    seq_len = _check_seq_len(seq_len)
    n = len(tokens.tokens) // seq_len
    if n == 0:
        raise ValueError(
            f"{tokens.path} holds {len(tokens.tokens)} tokens, fewer than one row of "
            f"seq_len={seq_len}; use a shorter seq_len or more text."
        )
    _check_model(tokens, seq_len, model)
    return PackedRows(tokens, seq_len, 0, n)


def padded(
    tokens: TokenFile, seq_len: int, *, pad_id: int | None = None, model: Any = None
) -> PaddedRows:
    """One document (record) per row, right-padded to `seq_len`, padding uncounted.

    Causal attention never lets a real token see the padding after it, so no
    attention mask is needed; `loss_mask` is false on padding.

    Args:
        tokens: from `tokenize_instructions` (or `tokenize`).
        seq_len: tokens per row; every document must fit.
        pad_id: the padding id; default: the tokenizer's pad token, else its EOS.
        model: when given, checked as in `packed`.

    Returns:
        A sequence of `{"input_ids": int32[seq_len], "loss_mask": bool[seq_len]}`.

    Raises:
        ValueError: a document longer than `seq_len` (naming how many, the longest
            and where it came from), or a model that cannot take the rows.

    Example:
        >>> rows = padded(rc.text.tokenize_instructions("sft.jsonl", tok, "cache/sft"), 512)
    """
    seq_len = _check_seq_len(seq_len)
    lengths = np.diff(tokens.starts)
    over = np.flatnonzero(lengths > seq_len)
    if over.size:
        longest = int(over[np.argmax(lengths[over])])
        raise ValueError(
            f"{over.size} of {tokens.n_documents} documents in {tokens.path} are longer than "
            f"seq_len={seq_len}; the longest has {int(lengths[longest])} tokens "
            f"({tokens.origin(longest)}). Use a larger seq_len, `packed`, or drop them."
        )
    pad = pad_id if pad_id is not None else tokens.meta.get("pad_id")
    pad = tokens.eos_id if pad is None else pad
    if pad is None:
        raise ValueError(f"{tokens.path}'s tokenizer has no pad or EOS token; pass pad_id=.")
    _check_model(tokens, seq_len, model)
    return PaddedRows(tokens, seq_len, 0, tokens.n_documents, int(pad))


def collate(rows: list[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Stack rows (dicts of equal-shaped arrays) into a batch: a `collate_fn` for `fit`.

    Args:
        rows: e.g. items of `packed` or `padded`, or of a `datasets.Dataset`.

    Returns:
        `{key: array}` with the rows on the leading axis.

    Example:
        >>> rc.fit(model, opt, rows, collate_fn=rc.text.collate, loss_fn=rc.models.lm_loss, ...)
    """
    return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}
