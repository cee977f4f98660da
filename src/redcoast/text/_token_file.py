"""The token folder: its files, written under a temporary name and renamed when complete."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from array import array
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import Bool, Int, UInt

from ._tokenizer import Tokenizer

FORMAT = "redcoast-tokens/1"


@dataclasses.dataclass(frozen=True, eq=False)
class TokenFile:
    """A tokenized corpus on disk, memory-mapped: nothing is read until it is indexed.

    Attributes:
        path: the folder.
        tokens: every token id, documents one after another, `(n_tokens,)`.
        starts: where each document starts in `tokens`, and the end: `(n_documents + 1,)`.
        mask: for instruction data, which tokens the loss counts; `None` for plain text.
        origins: `(n_documents, 2)`: the index into `meta["files"]` and the line each
            document came from (`-1` for documents given as strings).
        meta: what `meta.json` holds (tokenizer fingerprint, dtype, counts, sources).
    """

    path: Path
    tokens: UInt[np.ndarray, " n_tokens"]
    starts: Int[np.ndarray, " n_documents_plus_1"]
    mask: Bool[np.ndarray, " n_tokens"] | None
    origins: Int[np.ndarray, "n_documents 2"]
    meta: Mapping[str, Any]

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

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TokenFile:
        """Open a folder written by `tokenize` or `tokenize_instructions`.

        Raises:
            ValueError: the folder is not a complete token folder (the message says
                what is missing or which size disagrees).
        """
        path = Path(path)
        meta_path = path / "meta.json"
        if not meta_path.is_file():
            raise ValueError(
                f"{path} is not a token folder (no meta.json); make one with rc.text.tokenize."
            )
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path} has format {meta.get('format')!r}, not {FORMAT!r}.")
        n, n_docs = int(meta["n_tokens"]), int(meta["n_documents"])
        dtype = np.dtype(meta["dtype"])
        expect = {
            "tokens.bin": n * dtype.itemsize,
            "documents.bin": (n_docs + 1) * 8,
            "origins.bin": n_docs * 8,
        }
        if meta["has_mask"]:
            expect["mask.bin"] = n
        for name, size in expect.items():
            actual = (path / name).stat().st_size if (path / name).is_file() else None
            if actual != size:
                raise ValueError(
                    f"{path / name} holds {actual} bytes where meta.json says {size}: the "
                    "token folder is damaged. Delete it and tokenize again."
                )
        tokens = np.memmap(path / "tokens.bin", dtype=dtype, mode="r", shape=(n,))
        starts = np.fromfile(path / "documents.bin", dtype=np.int64)
        mask = (
            np.memmap(path / "mask.bin", dtype=np.bool_, mode="r", shape=(n,))
            if meta["has_mask"]
            else None
        )
        origins = np.fromfile(path / "origins.bin", dtype=np.int32).reshape(n_docs, 2)
        return cls(path, tokens, starts, mask, origins, meta)


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class Writer:
    """Appends documents to a temporary token folder; `finish` renames it into place."""

    def __init__(self, path: Path, tok: Tokenizer, *, mask: bool, meta: dict[str, Any]):
        self.path, self.tok = path, tok
        self.tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        self.tmp.mkdir(parents=True)
        self.dtype = _token_dtype(tok.vocab_size)
        self.files = {"tokens": open(self.tmp / "tokens.bin", "wb")}  # noqa: SIM115
        if mask:
            self.files["mask"] = open(self.tmp / "mask.bin", "wb")  # noqa: SIM115
        self.starts, self.origins = array("q", [0]), array("i")
        self.n, self.max_id, self.meta = 0, -1, meta

    def extend(self, ids: Sequence[int], mask: Any = None) -> None:
        """Append tokens to the current document (a long one arrives piece by piece)."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size == 0:
            return
        self.max_id = max(self.max_id, int(arr.max()))
        arr.astype(self.dtype).tofile(self.files["tokens"])
        if mask is not None:
            np.asarray(mask, dtype=np.bool_).tofile(self.files["mask"])
        self.n += arr.size

    def end_document(self, origin: tuple[int, int]) -> None:
        """Close the current document, unless it holds no token."""
        if self.n > self.starts[-1]:
            self.starts.append(self.n)
            self.origins.extend(origin)

    def add(self, ids: Sequence[int], origin: tuple[int, int], mask: Any = None) -> None:
        """Append one whole document."""
        self.extend(ids, mask)
        self.end_document(origin)

    def finish(self, what: str) -> TokenFile:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        if self.n == 0:
            raise ValueError(
                f"{what} holds no text: nothing to tokenize. Check the path, the file "
                "pattern and the record fields."
            )
        np.asarray(self.starts, np.int64).tofile(self.tmp / "documents.bin")
        np.asarray(self.origins, np.int32).tofile(self.tmp / "origins.bin")
        meta = {
            **self.meta,
            "format": FORMAT,
            "dtype": self.dtype.name,
            "n_tokens": self.n,
            "n_documents": len(self.starts) - 1,
            "max_id": self.max_id,
            "has_mask": "mask" in self.files,
        }
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        _replace_folder(self.tmp, self.path)
        return TokenFile.open(self.path)

    def abort(self) -> None:
        for f in self.files.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _replace_folder(new: Path, path: Path) -> None:
    """Rename `new` to `path`; an older token folder there is swapped out, then deleted."""
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
    os.replace(new, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_target(path: Path) -> None:
    """Refuse to replace anything at `path` that is not a token folder; clear leftovers.

    Folders `<name>.tmp-*` and `<name>.old-*` are what an interrupted write left; only
    one process writes a token folder, so none of them is in use.
    """
    for leftover in [
        *path.parent.glob(f"{path.name}.tmp-*"),
        *path.parent.glob(f"{path.name}.old-*"),
    ]:
        shutil.rmtree(leftover, ignore_errors=True)
    if path.exists() and not (path / "meta.json").is_file():
        if path.is_file() or any(path.iterdir()):
            raise ValueError(
                f"{path} exists and is not a token folder; give a new path (tokenize "
                "writes a folder there) or remove it."
            )
        path.rmdir()


def reusable(path: Path, meta: Mapping[str, Any]) -> TokenFile | None:
    """The token folder at `path` when it was made from the same sources and tokenizer."""
    if not (path / "meta.json").is_file():
        return None
    try:
        found = TokenFile.open(path)
    except (ValueError, OSError, json.JSONDecodeError):
        return None
    keys = ("kind", "tokenizer", "sources", "options")
    if meta["sources"] is None or any(found.meta.get(k) != meta[k] for k in keys):
        return None
    return found


def is_lead() -> bool:
    return jax.process_index() == 0


def on_lead(make: Callable[[], TokenFile], path: Path) -> TokenFile:
    """Run `make` on process 0; the others wait for its verdict and open its folder."""
    if jax.process_count() == 1:
        return make()
    error = None
    if is_lead():
        try:
            make()
        except Exception as err:  # every process must learn of it, not hang
            error = err
    ok = multihost_utils.broadcast_one_to_all(np.array(error is None))
    if error is not None:
        raise error
    if not bool(ok):
        raise RuntimeError(f"process 0 failed to tokenize into {path}; see its error.")
    return TokenFile.open(path)
