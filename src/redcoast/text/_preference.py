"""`tokenize_preferences` and `paired`: a prompt with a chosen and a rejected answer per row.

A pair is stored as two instruction documents of an ordinary token folder, one
after the other: the prompt then the chosen answer, the prompt then the rejected
one, each with the mask on its answer. So the folder is built, reused, locked and
checksummed as every token folder is, and `paired` reads row `i` from documents
`2i` and `2i + 1`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast, overload

import numpy as np

from ._instructions import build_records, chat_ids
from ._rows import PaddedRows, padded, row_index, slice_span
from ._sources import Source, describe_keys
from ._token_file import TokenFile
from ._tokenizer import Tokenizer, load_tokenizer

ANSWERS = ("chosen", "rejected")


def _chat_answer(
    tok: Tokenizer, prompt: list[Any], answer: list[Any], where: str
) -> tuple[list[int], list[bool]]:
    """The conversation `prompt + answer` through the chat template; the answer's
    assistant turns counted, never the prompt's."""
    ids, mask = chat_ids(tok, prompt + answer, where)
    hf = tok.hf
    start = len(
        hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False)
    )
    return ids, [False] * start + mask[start:]


def _encode_pairs(
    tok: Tokenizer, chunk: list[Any], keys: Mapping[str, str]
) -> Iterator[tuple[list[int], list[bool], tuple[int, int]]]:
    """Two documents per record (prompt + chosen, prompt + rejected), with their masks."""
    names = [keys["prompt"], keys["chosen"], keys["rejected"]]
    texts: list[str] = []
    plans = []
    for record, origin, where in chunk:
        fields = [record.get(n) if isinstance(record, Mapping) else None for n in names]
        if all(isinstance(f, str) for f in fields):
            plans.append((origin, where, len(texts), fields))
            texts += [f for f in fields if isinstance(f, str)]
        elif all(isinstance(f, list) for f in fields):
            plans.append((origin, where, None, fields))
        else:
            raise ValueError(
                f"{where} needs fields {names[0]!r}, {names[1]!r} and {names[2]!r}, all strings "
                f"(or chat message lists); it has {describe_keys(record)}. Name other fields "
                "with prompt_key=, chosen_key=, rejected_key=."
            )
    encoded = tok.encode(texts) if texts else []
    prefix = tok.prefix
    eos = [] if tok.eos_id is None else [tok.eos_id]
    for origin, where, at, fields in plans:
        for j, name in enumerate(ANSWERS, 1):
            if at is None:
                ids, mask = _chat_answer(tok, fields[0], fields[j], where)
            else:
                prompt, answer = prefix + encoded[at], encoded[at + j] + eos
                if len(answer) == len(eos):
                    ids, mask = [], []
                else:
                    ids, mask = prompt + answer, [False] * len(prompt) + [True] * len(answer)
            if not any(mask):
                raise ValueError(
                    f"{where} has an empty {name} answer: nothing for the loss to count."
                )
            if mask[0]:
                raise ValueError(
                    f"{where} has an empty prompt, and this tokenizer puts nothing before it: "
                    "the answer's first token would have nothing to be predicted from. Give a "
                    "prompt."
                )
            yield ids, mask, origin


def tokenize_preferences(
    source: Source,
    tokenizer: Any,
    path: str | os.PathLike[str],
    *,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    errors: str = "strict",
    eos_id: int | None = None,
    progress: bool = True,
) -> TokenFile:
    """Tokenize preference pairs into a token folder: each prompt with both its answers.

    A record is `{"prompt": str, "chosen": str, "rejected": str}` (the tokenizer's
    prefix and the prompt, uncounted; each answer and EOS, counted), or the same
    fields as chat message lists (`[{"role": ..., "content": ...}, ...]`, TRL's
    conversational format) rendered by the tokenizer's chat template, the answer's
    assistant turns counted. Prompt and answer are encoded apart, as
    `tokenize_instructions` does. The folder holds two documents per record
    (prompt + chosen, prompt + rejected) and is reused, replaced, locked and
    checksummed as `tokenize`'s is; `paired` makes rows of it.

    Args:
        source: a `.jsonl` file, a folder of them, a list of `Path`s, an iterable of
            dicts, or a `datasets.Dataset` with those columns.
        tokenizer: a checkpoint folder, a `tokenizer.json`, or a tokenizer object.
        path: the token folder to write.
        prompt_key, chosen_key, rejected_key: the records' field names.
        errors: `"strict"` or `"replace"` for undecodable bytes.
        eos_id: the id ending an answer; default: the tokenizer's EOS.
        progress: show a progress bar (records).

    Returns:
        The `TokenFile` (with `mask`), two documents per pair.

    Raises:
        ValueError: a record without the three fields (naming the file and line, or
            the record's number, and the fields it has), an empty answer, an empty
            prompt where the tokenizer adds no prefix, chat messages without a chat
            template, an empty source.

    Example:
        >>> pairs = rc.text.tokenize_preferences("pairs.jsonl", "checkpoints/gpt2", "cache/pairs")
        >>> rows = rc.text.paired(pairs, 256)
    """
    keys = {"prompt": prompt_key, "chosen": chosen_key, "rejected": rejected_key}
    tok = load_tokenizer(tokenizer, eos_id=eos_id)
    return build_records(
        "preference",
        source,
        tok,
        Path(path),
        keys,
        _encode_pairs,
        errors=errors,
        progress=progress,
        label="pairs",
    )


class PairedRows(Sequence[dict[str, np.ndarray]]):
    """Pairs of padded documents read as one row each; see `paired`. Slicing gives a view."""

    def __init__(self, documents: PaddedRows):
        self.documents = documents

    def __len__(self) -> int:
        return len(self.documents) // 2

    @overload
    def __getitem__(self, i: int) -> dict[str, np.ndarray]: ...
    @overload
    def __getitem__(self, i: slice) -> PairedRows: ...
    def __getitem__(self, i: int | slice) -> dict[str, np.ndarray] | PairedRows:
        if isinstance(i, slice):
            a, b = slice_span(i, len(self))
            return PairedRows(cast(PaddedRows, self.documents[2 * a : 2 * b]))
        i = row_index(i, len(self))
        chosen, rejected = self.documents[2 * i], self.documents[2 * i + 1]
        return {
            "chosen_ids": chosen["input_ids"],
            "chosen_mask": chosen["loss_mask"],
            "rejected_ids": rejected["input_ids"],
            "rejected_mask": rejected["loss_mask"],
        }


def _pair_origin(tokens: TokenFile, pair: int) -> str:
    f, _ = (int(v) for v in tokens.origins[2 * pair])
    return f"record #{pair}" if f < 0 else tokens.origin(2 * pair)


def paired(
    tokens: TokenFile, seq_len: int, *, pad_id: int | None = None, model: Any = None
) -> PairedRows:
    """Rows of preference pairs, each sequence right-padded to `seq_len`, padding uncounted.

    Args:
        tokens: from `tokenize_preferences`.
        seq_len: tokens per sequence; every prompt with either answer must fit.
        pad_id: the padding id; default: the tokenizer's pad token, else its EOS.
        model: when given, checked as in `packed` (ids within its vocabulary,
            `seq_len` within its positions).

    Returns:
        A sequence of `{"chosen_ids": int32[seq_len], "chosen_mask": bool[seq_len],
        "rejected_ids": int32[seq_len], "rejected_mask": bool[seq_len]}`, the masks on
        each answer only; `rc.text.collate` stacks them for `rc.preference`'s losses.

    Raises:
        ValueError: a folder not from `tokenize_preferences`, or a prompt with an
            answer longer than `seq_len` (naming how many, the longest and the record
            it came from: its file and line, or its number).

    Example:
        >>> rows = rc.text.paired(rc.text.tokenize_preferences(src, tok, "cache/pairs"), 256)
        >>> rc.fit(model, opt, rows, collate_fn=rc.text.collate,
        ...        loss_fn=rc.preference.dpo_loss, ...)
    """
    if tokens.meta.get("kind") != "preference" or tokens.n_documents % 2:
        raise ValueError(
            f"{tokens.path} holds {tokens.meta.get('kind')} documents, not preference pairs; "
            "make the folder with rc.text.tokenize_preferences."
        )
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2 (tokens per sequence), got {seq_len!r}.")
    lengths = np.diff(tokens.starts).reshape(-1, 2).max(axis=1)
    over = np.flatnonzero(lengths > seq_len)
    if over.size:
        longest = int(over[np.argmax(lengths[over])])
        raise ValueError(
            f"{over.size} of {len(lengths)} pairs in {tokens.path} have a prompt and answer "
            f"longer than seq_len={seq_len}; the longest has {int(lengths[longest])} tokens "
            f"({_pair_origin(tokens, longest)}). Use a larger seq_len, or shorten or drop them."
        )
    return PairedRows(padded(tokens, seq_len, pad_id=pad_id, model=model))
