"""Fixed-length rows over a token folder, read from disk on demand; and `collate`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, overload

import numpy as np

from ._token_file import TokenFile


def _check_model(tokens: TokenFile, seq_len: int, model: Any) -> int | None:
    """Refuse rows the model cannot take: ids past its vocabulary, rows past its positions.

    The vocabulary is checked here against meta.json's largest id (a wrong tokenizer
    is found at once), and again on every row as it is read (a token file that
    disagrees with its meta.json is found too). Returns the vocabulary size, if any.
    """
    if model is None:
        return None
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None and tokens.meta["max_id"] >= vocab:
        bad = _first_id_at_least(tokens, vocab)
        found = (
            f"token ids up to {tokens.meta['max_id']} (by its meta.json)"
            if bad is None
            else f"token id {bad[1]} (first at {tokens.origin_of_token(bad[0])}; the largest "
            f"is {tokens.meta['max_id']})"
        )
        raise ValueError(
            f"{tokens.path} holds {found}, but "
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
    return None if vocab is None else int(vocab)


def _first_id_at_least(tokens: TokenFile, vocab: int) -> tuple[int, int] | None:
    """Where the first id >= `vocab` is, and the id; read a block at a time (bounded memory)."""
    n, step = len(tokens.tokens), 1 << 20
    for start in range(0, n, step):
        ids, _ = tokens.read(start, min(n, start + step))
        hits = np.flatnonzero(ids >= vocab)
        if hits.size:
            return start + int(hits[0]), int(ids[hits[0]])
    return None


def _check_seq_len(seq_len: Any) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int | np.integer) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2 (tokens per row), got {seq_len!r}.")
    return int(seq_len)


def slice_span(s: slice, n: int) -> tuple[int, int]:
    """Where the slice `s` of `n` rows starts and stops; a `ValueError` for a step other than 1."""
    a, b, step = s.indices(n)
    if step != 1:
        raise ValueError("rows can be sliced with step 1 only.")
    return a, max(a, b)


def row_index(i: int, n: int) -> int:
    """Row `i` of `n`, counted from 0 (negative from the end); an `IndexError` past either end."""
    i = int(i)
    if not -n <= i < n:
        raise IndexError(f"row {i} of {n}")
    return i % n


class _Rows(Sequence[dict[str, np.ndarray]]):
    """Rows `[start, stop)` of a token file; slicing gives another view, never a copy.

    A row is read from disk with `TokenFile.read` (checksummed, never faulting); when
    the rows know the model's vocabulary, each row's ids are checked against it.
    """

    def __init__(
        self, tokens: TokenFile, seq_len: int, start: int, stop: int, *, vocab: int | None = None
    ):
        self.tokens, self.seq_len, self.start, self.stop = tokens, seq_len, start, stop
        self.vocab = vocab

    def __len__(self) -> int:
        return self.stop - self.start

    @overload
    def __getitem__(self, i: int) -> dict[str, np.ndarray]: ...
    @overload
    def __getitem__(self, i: slice) -> _Rows: ...
    def __getitem__(self, i: int | slice) -> dict[str, np.ndarray] | _Rows:
        if isinstance(i, slice):
            a, b = slice_span(i, len(self))
            new = object.__new__(type(self))
            new.__dict__.update(self.__dict__, start=self.start + a, stop=self.start + b)
            return new
        return self._row(self.start + row_index(i, len(self)))

    def _row(self, i: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _check_ids(self, row: int, ids: np.ndarray, first_token: int) -> None:
        if self.vocab is None or not ids.size or int(ids.max()) < self.vocab:
            return
        at = int(np.argmax(ids >= self.vocab))
        t = self.tokens
        raise ValueError(
            f"row {row} of {t.path} holds token id {int(ids[at])} (from "
            f"{t.origin_of_token(first_token + at)}), past the model's vocabulary of "
            f"{self.vocab}, though meta.json says the largest id is {t.meta['max_id']}: the "
            f"token folder does not match its meta.json. Delete {t.path} and tokenize again."
        )


class PackedRows(_Rows):
    """The token stream cut into rows of `seq_len` tokens; see `packed`."""

    def __init__(
        self,
        tokens: TokenFile,
        seq_len: int,
        start: int,
        stop: int,
        *,
        vocab: int | None = None,
        separate_documents: bool = True,
    ):
        super().__init__(tokens, seq_len, start, stop, vocab=vocab)
        self.separate_documents = separate_documents

    def _row(self, i: int) -> dict[str, np.ndarray]:
        a = i * self.seq_len
        raw, mask = self.tokens.read(a, a + self.seq_len)
        ids = raw.astype(np.int32)
        self._check_ids(i, ids, a)
        row = {
            "input_ids": ids,
            "loss_mask": np.ones(self.seq_len, np.bool_) if mask is None else mask,
        }
        if self.separate_documents:
            row["segment_ids"], row["positions"] = documents_of(
                self.tokens.starts, a, a + self.seq_len
            )
        return row


def documents_of(starts: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens `[a, b)`'s documents: `(segment_ids, positions)`, int32.

    Segment ids count the documents from 0 at the row's first token; positions restart
    at 0 at each document's start, and at the row's start for a document begun in the
    row before (the model sees that part of it alone).
    """
    tokens = np.arange(a, b)
    document = np.searchsorted(starts, tokens, side="right") - 1
    segment_ids = (document - document[0]).astype(np.int32)
    first = np.maximum(starts[document], a)
    return segment_ids, (tokens - first).astype(np.int32)


class PaddedRows(_Rows):
    """One document per row, padded to `seq_len`; see `padded`."""

    def __init__(
        self,
        tokens: TokenFile,
        seq_len: int,
        start: int,
        stop: int,
        pad_id: int,
        *,
        vocab: int | None = None,
    ):
        super().__init__(tokens, seq_len, start, stop, vocab=vocab)
        self.pad_id = pad_id

    def _row(self, i: int) -> dict[str, np.ndarray]:
        a, b = (int(v) for v in self.tokens.starts[i : i + 2])
        n = b - a
        raw, doc_mask = self.tokens.read(a, b)
        ids = np.full(self.seq_len, self.pad_id, np.int32)
        ids[:n] = raw
        self._check_ids(i, ids[:n], a)
        mask = np.zeros(self.seq_len, np.bool_)
        mask[:n] = True if doc_mask is None else doc_mask
        return {"input_ids": ids, "loss_mask": mask}


def packed(
    tokens: TokenFile, seq_len: int, *, model: Any = None, separate_documents: bool = True
) -> PackedRows:
    """Rows of `seq_len` consecutive tokens: documents packed with EOS between them.

    As `run_clm.py`'s `group_texts`: the stream is cut into `len(tokens) // seq_len`
    rows and the remainder dropped. `loss_mask` is all true for text and the
    completion mask for instruction data.

    With `separate_documents` (the default) each row also says where its documents
    are, as MaxText, Levanter and TRL's padding-free packing do: `segment_ids` number
    the documents of the row from 0, and `positions` restart at 0 at each document
    (and at the row's start). `rc.models.lm_loss` gives both to the model, so a
    document attends to itself alone, as if it were in a row of its own, and its
    first token is not a target predicted from the document before it.

    Args:
        tokens: from `tokenize` or `tokenize_instructions`.
        seq_len: tokens per row.
        model: when given, checked: every id within its `vocab_size` (against
            meta.json's largest id here, and each row's ids as it is read), and
            `seq_len` within its position table (`max_positions`).
        separate_documents: give each row `segment_ids` and `positions`; False:
            `run_clm.py`'s rows, whose documents see the ones before them.

    Returns:
        A sequence of `{"input_ids": int32[seq_len], "loss_mask": bool[seq_len]}`,
        with `"segment_ids"` and `"positions"` (int32[seq_len]) when
        `separate_documents`; slicing it (`rows[:-100]`) gives a view.

    Raises:
        ValueError: bad `seq_len`, a corpus shorter than one row, or a model that
            cannot take the rows (naming the file and line of the first bad id).
            Reading a row raises `ValueError` too, naming the file and bytes, when
            the token file was changed or truncated after it was written, or (with
            `model=`) the row, file and line of an id past the vocabulary.

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
    vocab = _check_model(tokens, seq_len, model)
    return PackedRows(
        tokens, seq_len, 0, n, vocab=vocab, separate_documents=bool(separate_documents)
    )


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
    vocab = _check_model(tokens, seq_len, model)
    return PaddedRows(tokens, seq_len, 0, tokens.n_documents, int(pad), vocab=vocab)


def collate(rows: list[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Stack rows (dicts of equal-shaped arrays) into a batch: a `collate_fn` for `fit`.

    Args:
        rows: e.g. items of `packed` or `padded`, or of a `datasets.Dataset`.

    Returns:
        `{key: array}` with the rows on the leading axis.

    Raises:
        ValueError: no rows, rows with different keys (naming the key and the first
            row without it or with it extra), or a key whose arrays differ in shape
            (naming the key, the first row that differs and both shapes).

    Example:
        >>> rc.fit(model, opt, rows, collate_fn=rc.text.collate, loss_fn=rc.models.lm_loss, ...)
    """
    if not rows:
        raise ValueError("collate got no rows; a batch needs at least one.")
    keys = rows[0].keys()
    for j, row in enumerate(rows):
        if row.keys() != keys:
            missing, extra = sorted(set(keys) - set(row)), sorted(set(row) - set(keys))
            key, how = (missing[0], "lacks") if missing else (extra[0], "has")
            raise ValueError(
                f"collate: row {j} {how} key {key!r}, which row 0 "
                f"{'has' if missing else 'lacks'} (row 0's keys: {sorted(keys)}; row {j}'s: "
                f"{sorted(row)}). Give every row the same keys."
            )
    out = {}
    for k in keys:
        arrays = [np.asarray(r[k]) for r in rows]
        try:
            out[k] = np.stack(arrays)
        except ValueError:
            j = next((j for j, a in enumerate(arrays) if a.shape != arrays[0].shape), None)
            if j is None:
                raise
            raise ValueError(
                f"collate: row {j}'s {k!r} has shape {arrays[j].shape}, but row 0's has "
                f"{arrays[0].shape}; the rows of a batch must be equal in shape. Make rows "
                "of one length with rc.text.padded (one document per row) or rc.text.packed, "
                "or pad them in your own collate_fn."
            ) from None
    return out
