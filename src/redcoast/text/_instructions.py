"""`tokenize_instructions`: prompt/completion and chat records, with the loss's mask."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._build import Writer, build, is_lead
from ._sources import (
    Source,
    describe_keys,
    hashed,
    json_line,
    list_files,
    progress_bar,
    same_sources,
    text_signature,
)
from ._token_file import TokenFile
from ._tokenizer import Tokenizer, load_tokenizer


def read_records(
    source: Any, text_errors: str, output: Path
) -> tuple[list[Path] | None, Callable[[list[list[Any]]], Iterator[Any]]]:
    """The files `source` names (None for records given directly), and a reader of its
    records, which appends each file's fingerprint to the list it is given."""
    files = list_files(source, "**/*.jsonl", output=output)
    if files is None:
        if isinstance(source, str | bytes | Mapping) or not isinstance(source, Iterable):
            raise TypeError(
                "source must be a .jsonl file, a folder of them, a list of Paths or an "
                f"iterable of dicts; got {type(source).__name__}."
            )
        return None, lambda _: ((r, (-1, -1), f"record #{i}") for i, r in enumerate(source))

    def read(prints: list[list[Any]]) -> Iterator[Any]:
        assert files is not None
        for i, path in enumerate(files):
            with open(path, "rb") as f:
                for line_no, line in enumerate(hashed(f, path, prints), 1):
                    if line.strip():
                        yield (
                            json_line(line, path, line_no, text_errors),
                            (i, line_no),
                            (f"{path}:{line_no}"),
                        )

    return files, read


def chat_ids(tok: Tokenizer, messages: Any, where: str) -> tuple[list[int], list[bool]]:
    """A conversation through the chat template; the loss counts the assistant's turns
    (see `assistant_ids`)."""
    hf = tok.hf
    if hf is None or not getattr(hf, "chat_template", None):
        raise ValueError(
            f"{where} holds chat messages, but the tokenizer {tok.name} has no chat template; "
            "use prompt/completion records, or a tokenizer with a chat_template."
        )
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in messages
    ):
        raise ValueError(
            f"{where}: messages must be a list of {{'role': ..., 'content': str}} dicts."
        )

    def render(ms: list[Any], generation_prompt: bool) -> list[int]:
        return list(
            hf.apply_chat_template(
                ms, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
            )
        )

    return assistant_ids(render, messages, where)


def assistant_ids(
    render: Callable[[list[Any], bool], list[int]], messages: list[Any], where: str
) -> tuple[list[int], list[bool]]:
    """The ids `render` gives the conversation, and which of them are the assistant's.

    Each assistant turn's tokens are found as the difference between the rendered
    conversation up to that turn and the one before it with the generation prompt
    (`render(messages, generation_prompt)`).
    """
    ids = render(messages, False)
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = render(messages[:i], True), render(messages[: i + 1], False)
        if ids[: len(upto)] != upto or upto[: len(before)] != before:
            raise ValueError(
                f"{where}: the tokenizer's chat template does not render a conversation as "
                "the extension of its prefixes, so the assistant's tokens cannot be found."
            )
        mask[len(before) : len(upto)] = [True] * (len(upto) - len(before))
    if not any(mask):
        raise ValueError(f"{where} has no assistant message: nothing for the loss to count.")
    return ids, mask


def tokenize_instructions(
    source: Source,
    tokenizer: Any,
    path: str | os.PathLike[str],
    *,
    prompt_key: str = "prompt",
    completion_key: str = "completion",
    messages_key: str = "messages",
    errors: str = "strict",
    eos_id: int | None = None,
    progress: bool = True,
) -> TokenFile:
    """Tokenize instruction records into a token folder whose mask marks the completions.

    A record is `{"prompt": str, "completion": str}` (the tokenizer's prefix and the
    prompt, uncounted; the completion and EOS, counted) or `{"messages": [{"role":
    ..., "content": ...}, ...]}` rendered by the tokenizer's chat template (the
    assistant turns counted). Rows made with `padded` hold one record each; with
    `packed`, records follow one another. The folder is reused, replaced, locked
    and checksummed as `tokenize`'s is (see there), with these options and fields.

    Args:
        source: a `.jsonl` file, a folder of them, a list of `Path`s, or an iterable
            of dicts.
        tokenizer: a checkpoint folder, a `tokenizer.json`, or a tokenizer object.
        path: the token folder to write.
        prompt_key, completion_key, messages_key: the records' field names.
        errors: `"strict"` or `"replace"` for undecodable bytes.
        eos_id: the id ending a completion; default: the tokenizer's EOS.
        progress: show a progress bar (records).

    Returns:
        The `TokenFile`, with `mask`.

    Raises:
        ValueError: a record without the fields (naming the file and line and the
            fields it has), chat messages without a chat template, an empty source.

    Example:
        >>> data = rc.text.tokenize_instructions("train.jsonl", "checkpoints/llama", "cache/sft")
        >>> rows = rc.text.padded(data, 512)
    """
    keys = {"prompt": prompt_key, "completion": completion_key, "messages": messages_key}
    tok = load_tokenizer(tokenizer, eos_id=eos_id)
    return build_records(
        "instructions",
        source,
        tok,
        Path(path),
        keys,
        _encode_records,
        errors=errors,
        progress=progress,
        label="instructions",
    )


def records_signature(source: Any, files: list[Path] | None) -> list[str] | None:
    """What identifies records given directly: a list's hash, or a `datasets.Dataset`'s
    (its records streamed through the hash); None for files (fingerprinted from the
    very bytes tokenized) and for a one-shot iterator."""
    if files is not None:
        return None
    if isinstance(source, Sequence) or not hasattr(source, "column_names"):
        return text_signature(source)
    h = hashlib.sha256()
    for record in source:
        h.update(json.dumps(record, sort_keys=True, default=str).encode())
        h.update(b"\x00")
    return [h.hexdigest()]


Encoder = Callable[[Tokenizer, list[Any], dict[str, str]], Iterator[tuple[Any, Any, Any]]]
"""`(tokenizer, records, keys) -> (ids, mask, origin)` for each document of the records."""


def build_records(
    kind: str,
    source: Source,
    tok: Tokenizer,
    out: Path,
    keys: dict[str, str],
    encode: Encoder,
    *,
    errors: str,
    progress: bool,
    label: str,
) -> TokenFile:
    """A token folder of records, each made into documents with loss masks by `encode`.

    `tokenize_instructions` and `tokenize_preferences` differ only in `kind`, the
    records' field names and how a record becomes documents.
    """
    files, read = read_records(source, errors, out)
    template = getattr(tok.hf, "chat_template", None) or ""
    meta = {
        "kind": kind,
        "tokenizer": tok.fingerprint(template if isinstance(template, str) else ""),
        "tokenizer_name": tok.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "files": [str(f) for f in files or []],
        "sources": records_signature(source, files),
        "options": {**keys, "errors": errors},
    }

    def fill(writer: Writer) -> None:
        prints: list[list[Any]] = []
        with progress_bar(None, progress and is_lead(), label, unit="record") as bar:
            for chunk in batched(read(prints), 1024):
                for ids, mask, origin in encode(tok, chunk, keys):
                    writer.add(ids, origin, mask)
                bar.advance(len(chunk))
        # Files are fingerprinted from the very bytes tokenized.
        if files is not None:
            writer.meta["sources"] = prints

    return build(
        out,
        tok,
        meta,
        mask=True,
        same_sources=same_sources(files, meta["sources"]),
        fill=fill,
        what=str(source)[:60],
    )


def batched(it: Iterator[Any], n: int) -> Iterator[list[Any]]:
    while chunk := list(itertools.islice(it, n)):
        yield chunk


def _encode_records(
    tok: Tokenizer, chunk: list[Any], keys: Mapping[str, str]
) -> Iterator[tuple[list[int], list[bool], tuple[int, int]]]:
    """Ids and loss masks of a chunk of records; prompts and completions encoded in one batch."""
    pairs, texts = [], []
    for record, origin, where in chunk:
        if isinstance(record, dict) and keys["messages"] in record:
            pairs.append((origin, where, None))
            continue
        fields = [
            record.get(keys[k]) if isinstance(record, dict) else None
            for k in ("prompt", "completion")
        ]
        if not all(isinstance(f, str) for f in fields):
            raise ValueError(
                f"{where} needs string fields {keys['prompt']!r} and {keys['completion']!r} "
                f"(or a {keys['messages']!r} list); it has {describe_keys(record)}. Name other "
                "fields with prompt_key=, completion_key=, messages_key=."
            )
        pairs.append((origin, where, len(texts)))
        texts += fields
    encoded = tok.encode(texts) if texts else []
    prefix = tok.prefix
    eos = [] if tok.eos_id is None else [tok.eos_id]
    for (record, _, _), (origin, where, at) in zip(chunk, pairs, strict=True):
        if at is None:
            ids, mask = chat_ids(tok, record[keys["messages"]], where)
        else:
            prompt, completion = prefix + encoded[at], encoded[at + 1] + eos
            if len(completion) == len(eos):
                raise ValueError(f"{where} has an empty completion: nothing for the loss to count.")
            ids = prompt + completion
            mask = [False] * len(prompt) + [True] * len(completion)
        yield ids, mask, origin
