"""The token folder: its files, how redcoast recognises its own, and reading it back checked."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from jaxtyping import Bool, Int, UInt

from ._checksums import CheckedFile, n_chunks

FORMAT = "redcoast-tokens/2"
"""This version's format. Version 1 had no checksums; its folders are rebuilt, not read."""

_FORMATS = "redcoast-tokens/"
"""What every version's `format` starts with: a folder of any version is redcoast's."""

FILES = frozenset(
    {"meta.json", "tokens.bin", "documents.bin", "origins.bin", "mask.bin", "checksums.bin"}
)
"""Every file redcoast writes in a token folder (of any version), and nothing else."""

LEFTOVER = re.compile(r"(?P<name>.+)\.(tmp|old)-[0-9a-f]{8}")
"""The name of a folder being written (`<name>.tmp-<hex>`) or swapped out (`.old-<hex>`)."""


def read_meta(folder: Path) -> dict[str, Any] | None:
    """`folder`'s meta.json when it is a token folder's (any version), else None."""
    try:
        meta = json.loads((folder / "meta.json").read_bytes())
    except (OSError, ValueError):
        return None
    if isinstance(meta, dict) and str(meta.get("format", "")).startswith(_FORMATS):
        return meta
    return None


def foreign_files(folder: Path) -> list[str]:
    """The entries of `folder` that redcoast did not write: all of them, unless its
    meta.json is a token folder's; then any besides the regular files of `FILES`."""
    names = sorted(os.listdir(folder))
    if read_meta(folder) is None:
        return names
    return [n for n in names if n not in FILES or not _regular(folder / n)]


def only_ours(folder: Path) -> bool:
    """`folder` holds nothing but regular files of the names redcoast writes."""
    return all(e.name in FILES and _regular(e) for e in folder.iterdir())


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def is_token_folder(folder: Path) -> bool:
    """`folder` is a token folder, or one a `tokenize` is writing or swapping out.

    A complete folder is known by its meta.json; one being written has none yet, and
    is known by its name (`<name>.tmp-<hex>` or `.old-<hex>`) and by holding nothing
    but files of a token folder.
    """
    if read_meta(folder) is not None:
        return True
    if not LEFTOVER.fullmatch(folder.name) or not folder.is_dir() or folder.is_symlink():
        return False
    return only_ours(folder)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenFile:
    """A tokenized corpus on disk: nothing is read until asked for.

    Rows (`packed`, `padded`) read through `read`, which checks each 1 MiB chunk of
    `tokens.bin` and `mask.bin` against its checksum the first time it is touched
    and never faults on a file truncated while in use. `tokens` and `mask` are the
    raw memory maps, for inspection, without those checks.

    Attributes:
        path: the folder.
        tokens: every token id, documents one after another, `(n_tokens,)`.
        starts: where each document starts in `tokens`, and the end: `(n_documents + 1,)`.
        mask: for instruction data, which tokens the loss counts; `None` for plain text.
        origins: `(n_documents, 2)`: the index into `meta["files"]` and the line each
            document came from (`-1` for documents given as strings).
        meta: what `meta.json` holds (tokenizer fingerprint, dtype, counts, sources,
            checksums).
    """

    path: Path
    tokens: UInt[np.ndarray, " n_tokens"]
    starts: Int[np.ndarray, " n_documents_plus_1"]
    mask: Bool[np.ndarray, " n_tokens"] | None
    origins: Int[np.ndarray, "n_documents 2"]
    meta: Mapping[str, Any]
    _checked: tuple[CheckedFile, CheckedFile | None] = dataclasses.field(repr=False)

    @property
    def n_documents(self) -> int:
        return len(self.starts) - 1

    @property
    def eos_id(self) -> int | None:
        return self.meta["eos_id"]

    def origin(self, document: int) -> str:
        """`file:line` (or `document #i`) of a document, for error messages."""
        f, line = (int(v) for v in self.origins[document])
        if f < 0:
            return f"document #{document}"
        return f"{self.meta['files'][f]}:{line}"

    def origin_of_token(self, position: int) -> str:
        """`file:line` of the document holding token `position`."""
        doc = int(np.searchsorted(self.starts, position, side="right")) - 1
        return self.origin(max(doc, 0))

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens `[start, stop)` and their mask (`None` for plain text), read from disk.

        Each chunk the range touches is checked against its checksum the first time;
        afterwards a read is one `pread` per file.

        Raises:
            ValueError: the bytes differ from those written, or the file was
                truncated while in use (naming the file and the byte range).
        """
        tokens, mask = self._checked
        ids = np.empty(stop - start, self.tokens.dtype)
        tokens.read(start * ids.itemsize, ids)
        if mask is None:
            return ids, None
        return ids, mask.read(start, np.empty(stop - start, np.bool_))

    def __reduce__(self) -> tuple[Any, ...]:
        # A file descriptor means nothing in another process: open the folder afresh.
        return (TokenFile.open, (self.path,))

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TokenFile:
        """Open a folder written by `tokenize` or `tokenize_instructions`.

        The sizes of all files and the checksums of the small ones (`documents.bin`,
        `origins.bin`, `checksums.bin`) are checked here; `tokens.bin` and `mask.bin`
        chunk by chunk as rows read them.

        Raises:
            ValueError: the folder is not a complete token folder of this version (the
                message says what is missing, which size or checksum disagrees, or
                which version wrote it).
        """
        path = Path(path)
        meta_path = path / "meta.json"
        if not meta_path.is_file():
            raise ValueError(
                f"{path} is not a token folder (no meta.json); make one with rc.text.tokenize."
            )
        meta = read_meta(path)
        if meta is None:
            raise ValueError(
                f"{meta_path} is not a redcoast token folder's (no 'format' "
                f"{_FORMATS}...); make one with rc.text.tokenize."
            )
        if meta["format"] != FORMAT:
            raise ValueError(
                f"{path} was written by another version of redcoast (format "
                f"{meta['format']!r}; this one reads {FORMAT!r}). Tokenize again: tokenize "
                "replaces such a folder."
            )
        needed = ("dtype", "n_tokens", "n_documents", "has_mask", "chunk_bytes", "checksums")
        missing = [k for k in needed if k not in meta]
        if missing:
            raise ValueError(
                f"{meta_path} lacks {missing}: the token folder is damaged. Delete it and "
                "tokenize again."
            )
        n, n_docs, chunk = int(meta["n_tokens"]), int(meta["n_documents"]), meta["chunk_bytes"]
        dtype = np.dtype(meta["dtype"])
        expect = {"tokens.bin": n * dtype.itemsize}
        if meta["has_mask"]:
            expect["mask.bin"] = n
        n_sums = sum(n_chunks(size, chunk) for size in expect.values())
        expect |= {"documents.bin": (n_docs + 1) * 8, "origins.bin": n_docs * 8}
        expect["checksums.bin"] = n_sums * 8
        for name, size in expect.items():
            actual = (path / name).stat().st_size if (path / name).is_file() else None
            if actual != size:
                raise ValueError(
                    f"{path / name} holds {actual} bytes where meta.json says {size}: the "
                    "token folder is damaged. Delete it and tokenize again."
                )
        small = {
            name: _read_whole(path / name, meta["checksums"][name])
            for name in ("documents.bin", "origins.bin", "checksums.bin")
        }
        starts = np.frombuffer(small["documents.bin"], np.int64)
        origins = np.frombuffer(small["origins.bin"], np.int32).reshape(n_docs, 2)
        sums = np.frombuffer(small["checksums.bin"], "<u8")
        n_tok = n_chunks(expect["tokens.bin"], chunk)
        tokens = np.memmap(path / "tokens.bin", dtype=dtype, mode="r", shape=(n,))
        checked_tokens = CheckedFile(path / "tokens.bin", expect["tokens.bin"], sums[:n_tok], chunk)
        mask, checked_mask = None, None
        if meta["has_mask"]:
            mask = np.memmap(path / "mask.bin", dtype=np.bool_, mode="r", shape=(n,))
            checked_mask = CheckedFile(path / "mask.bin", n, sums[n_tok:], chunk)
        return cls(path, tokens, starts, mask, origins, meta, (checked_tokens, checked_mask))


def _read_whole(path: Path, digest: str) -> bytes:
    data = path.read_bytes()
    if xxhash.xxh3_64_hexdigest(data) != digest:
        raise ValueError(
            f"{path} does not match its checksum in meta.json: the file changed on disk after "
            f"it was written. Delete {path.parent} and tokenize again."
        )
    return data
