"""`tokenize`: plain text, streamed in pieces through the tokenizer into a token folder."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ._build import Writer, build, is_lead
from ._sources import (
    Source,
    decode,
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

SPACE = frozenset(b" \t\r\n\x0b\x0c")
NEWLINE = b"\n"
# Long documents are tokenized in pieces of about this many bytes (see `_cut`).
PIECE_BYTES = 1 << 16


# Pieces handed to the tokenizer at once; it encodes them in parallel.
BATCH_BYTES = 1 << 22


_Piece = tuple[int, str, bool, tuple[int, int], int]
"""(document index, text, last piece of its document, origin, bytes read)."""


def _cut(data: bytes, start: int, target: int) -> int:
    """A cut point after `start`, near `start + target`, where tokenization does not change.

    The cut goes after a newline that has a non-space byte on either side: byte-level
    BPE's pre-tokenizer (GPT-2, LLaMA 3, ...) ends a pre-token there in any case.
    Returns `len(data)` when no such newline exists before the end.
    """
    pos = data.find(b"\n", start + target)
    while 0 <= pos < len(data) - 1:
        if data[pos - 1] not in SPACE and data[pos + 1] not in SPACE:
            return pos + 1
        pos = data.find(b"\n", pos + 1)
    return len(data)


def _file_pieces(
    files: list[Path], errors: str, text_key: str, prints: list[list[Any]]
) -> Iterator[_Piece]:
    """Documents from files (a file each; a `.jsonl` file a record per line), in pieces;
    each file's fingerprint goes to `prints` once it is read to the end."""
    doc = 0
    for i, path in enumerate(files):
        if path.suffix == ".jsonl":
            with open(path, "rb") as f:
                for line_no, line in enumerate(hashed(f, path, prints), 1):
                    if not line.strip():
                        continue
                    record = json_line(line, path, line_no, errors)
                    text = record.get(text_key) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        raise ValueError(
                            f"{path}:{line_no} has no string field {text_key!r} (found "
                            f"{describe_keys(record)}); pass text_key= to name the field."
                        )
                    yield doc, text, True, (i, line_no), len(line)
                    doc += 1
            continue
        # Read in blocks; cut each into pieces at points where tokenization is unchanged.
        with open(path, "rb") as f:
            blocks = hashed(iter(functools.partial(f.read, BATCH_BYTES), b""), path, prints)
            carry, line = b"", 1
            while True:
                block = next(blocks, b"")
                data = carry + block
                start = 0
                while True:
                    end = _cut(data, start, PIECE_BYTES)
                    if end == len(data) and block:
                        break  # the rest waits for the next block
                    piece, first_line = data[start:end], line

                    def where(
                        b: int, f: Path = path, p: bytes = piece, ln: int = first_line
                    ) -> str:
                        return f"{f}:{ln + p[:b].count(NEWLINE)}"

                    # The piece that reaches the end of the file closes the document,
                    # even when it is empty.
                    last = end == len(data)
                    yield doc, decode(piece, errors, where), last, (i, 1), len(piece)
                    line += piece.count(b"\n")
                    start = end
                    if last:
                        break
                carry = data[start:]
                if not block:
                    break
        doc += 1


def _string_pieces(texts: Any) -> Iterator[_Piece]:
    if isinstance(texts, str | bytes) or not isinstance(texts, Iterable):
        raise TypeError(
            f"source must be a path, a list of Paths or an iterable of strings; got "
            f"{type(texts).__name__}."
        )
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"document #{i} of the iterable is a {type(text).__name__}, not str.")
        yield i, text, True, (-1, -1), len(text)


def _encode_pieces(
    writer: Writer,
    tok: Tokenizer,
    pieces: Iterator[_Piece],
    total: int | None,
    progress: bool,
    what: str,
) -> None:
    """Encode pieces in batches and append their documents to `writer`."""
    assert tok.eos_id is not None
    prefix, eos = tok.prefix, [tok.eos_id]
    started = False  # whether the current document has written its prefix
    with progress_bar(total, progress and is_lead(), what) as bar:
        while True:
            batch, size = [], 0
            for piece in pieces:
                batch.append(piece)
                size += piece[4]
                if size >= BATCH_BYTES:
                    break
            if not batch:
                break
            # A document's tokens go to disk piece by piece; an empty one adds nothing.
            for (_, _, last, origin, _), ids in zip(
                batch, tok.encode([p[1] for p in batch]), strict=True
            ):
                if ids and not started:
                    writer.extend(prefix)
                    started = True
                writer.extend(ids)
                if last and started:
                    writer.extend(eos)
                    writer.end_document(origin)
                    started = False
            bar.advance(size)


def tokenize(
    source: Source,
    tokenizer: Any,
    path: str | os.PathLike[str],
    *,
    pattern: str = "**/*",
    text_key: str = "text",
    errors: str = "strict",
    eos_id: int | None = None,
    progress: bool = True,
) -> TokenFile:
    """Tokenize a corpus into a token folder at `path`, or reuse the one already there.

    A document is a file, a record of a `.jsonl` file (its `text_key` field), or one
    string of an iterable. Each becomes the tokenizer's prefix (LLaMA's BOS; nothing
    for GPT-2), its tokens, and the EOS id, as `run_clm.py` separates documents.
    Files are read in blocks and tokenized in pieces of about 64 KiB cut after a
    newline between two non-space characters, where a byte-level BPE's
    pre-tokenizer splits anyway, so memory stays bounded by one block while the
    ids equal those of the whole document.

    The folder at `path` is reused when it was made by the same tokenizer (its
    fingerprint and EOS id) with the same `text_key`, `errors` and `pattern`, from
    the same sources. For files, that compares each file's resolved path and size
    in bytes and, when all of those match, the xxh3-64 hash of its content (taken
    while tokenizing, so reuse reads the files once more but never tokenizes them);
    the modification time is not compared, so a file rewritten with its size and
    time kept is tokenized again and one only touched is not. A list or tuple of
    strings is compared by a SHA-256 of them; a one-shot iterator is tokenized
    every time. Otherwise the folder is replaced, if it is a token folder redcoast
    wrote and holds nothing else; anything else at `path` is refused, never
    deleted. Two processes tokenizing into one path take turns (an OS lock on
    `.<name>.lock` beside it): the second waits, then reuses the first's folder.
    Files inside a token folder (this one included) are never read as text. On
    several processes, process 0 writes and the others open its folder (which must
    be on a filesystem they all see).

    Args:
        source: a file, a folder (every file matching `pattern`, hidden ones and
            token folders skipped, in sorted order; each file once by its real
            path, so a symlink beside its target is read once), a list of `Path`s, or an
            iterable of strings (the documents' text; a list of strings that are
            all paths of existing files is refused: pass them as `Path`s).
        tokenizer: a checkpoint folder, a `tokenizer.json`, or a tokenizer object
            (see `load_tokenizer`).
        path: the token folder to write.
        pattern: which files of a folder, e.g. `"**/*.py"`.
        text_key: the field holding the text in `.jsonl` records.
        errors: `"strict"` (undecodable bytes are an error naming the file and line)
            or `"replace"`.
        eos_id: the id between documents; default: the tokenizer's EOS.
        progress: show the bytes done (a bar in a terminal, else a line every 30 s).

    Returns:
        The `TokenFile`.

    Raises:
        ValueError: a path that does not exist, an empty corpus, invalid UTF-8 or
            JSON (naming the file and line), a tokenizer without an EOS token, a
            list of strings that are paths, or a `path` holding files redcoast did
            not write (naming them).

    Example:
        >>> tokens = rc.text.tokenize("corpus/", "checkpoints/gpt2", "cache/corpus",
        ...                           pattern="**/*.txt")
        >>> rows = rc.text.packed(tokens, 1024)
    """
    tok = load_tokenizer(tokenizer, eos_id=eos_id)
    if tok.eos_id is None:
        raise ValueError(
            f"the tokenizer {tok.name} has no EOS token to separate documents; pass eos_id=."
        )
    out = Path(path)
    files = list_files(source, pattern, output=out)
    meta = {
        "kind": "text",
        "tokenizer": tok.fingerprint(),
        "tokenizer_name": tok.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "files": [str(f) for f in files or []],
        # Files are fingerprinted from the very bytes tokenized, by `fill`.
        "sources": None if files is not None else text_signature(source),
        "options": {"text_key": text_key, "errors": errors, "pattern": pattern},
    }

    what = str(source)[:60]

    def fill(writer: Writer) -> None:
        if files is None:
            _encode_pieces(writer, tok, _string_pieces(source), None, progress, what)
            return
        prints: list[list[Any]] = []
        pieces = _file_pieces(files, errors, text_key, prints)
        total = sum(f.stat().st_size for f in files)
        _encode_pieces(writer, tok, pieces, total, progress, what)
        writer.meta["sources"] = prints

    return build(
        out,
        tok,
        meta,
        mask=False,
        same_sources=same_sources(files, meta["sources"]),
        fill=fill,
        what=what,
    )
