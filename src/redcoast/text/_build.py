"""Building a token folder: one writer at a time, under a temporary name, replacing only ours.

A folder is written as `<name>.tmp-<hex>` and renamed into place when complete, so
an interrupted run never leaves one that looks finished. Only a folder redcoast
wrote is ever replaced (known by its meta.json and by holding nothing else); any
other is refused by name. Writers of one path take turns on an OS lock, a `flock`
on `.<name>.lock` beside it: the second waits, then finds the first's folder and
reuses it, and leftovers of interrupted runs are cleared only by the lock's holder,
so no live temporary folder is ever deleted. The kernel releases the lock when its
process exits, however it exits; the holder deletes the lock file when done, and
one left by a killed holder is simply locked and deleted by the next.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import uuid
import warnings
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import xxhash
from jax.experimental import multihost_utils

from .._files import replace_folder
from ._checksums import CHUNK_BYTES, ChunkedWriter
from ._token_file import FORMAT, LEFTOVER, TokenFile, foreign_files, only_ours
from ._tokenizer import Tokenizer

# What filesystems without locks answer a flock with.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class Writer:
    """Appends documents to a temporary token folder; `finish` renames it into place."""

    def __init__(self, path: Path, tok: Tokenizer, *, mask: bool, meta: dict[str, Any]):
        self.path, self.tok = path, tok
        self.tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        self.tmp.mkdir(parents=True)
        self.dtype = _token_dtype(tok.vocab_size)
        self.files: dict[str, ChunkedWriter] = {}
        try:
            for name in ("tokens", "mask") if mask else ("tokens",):
                self.files[name] = ChunkedWriter(self.tmp / f"{name}.bin")
        except BaseException:
            self.abort()
            raise
        self.starts, self.origins = array("q", [0]), array("i")
        self.n, self.max_id, self.meta = 0, -1, meta

    def extend(self, ids: Sequence[int], mask: Any = None) -> None:
        """Append tokens to the current document (a long one arrives piece by piece)."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size == 0:
            return
        self.max_id = max(self.max_id, int(arr.max()))
        self.files["tokens"].write(arr.astype(self.dtype).tobytes())
        if mask is not None:
            self.files["mask"].write(np.asarray(mask, dtype=np.bool_).tobytes())
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
        sums = [self.files[k].close(sync=True) for k in ("tokens", "mask") if k in self.files]
        if self.n == 0:
            raise ValueError(
                f"{what} holds no text: nothing to tokenize. Check the path, the file "
                "pattern and the record fields."
            )
        checksums = {
            "documents.bin": _write_small(self.tmp / "documents.bin", self.starts),
            "origins.bin": _write_small(self.tmp / "origins.bin", self.origins),
            "checksums.bin": _write_small(
                self.tmp / "checksums.bin", np.concatenate(sums).astype("<u8")
            ),
        }
        meta = {
            **self.meta,
            "format": FORMAT,
            "dtype": self.dtype.name,
            "n_tokens": self.n,
            "n_documents": len(self.starts) - 1,
            "max_id": self.max_id,
            "has_mask": "mask" in self.files,
            "chunk_bytes": CHUNK_BYTES,
            "checksums": checksums,
        }
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        _replace_folder(self.tmp, self.path)
        return TokenFile.open(self.path)

    def abort(self) -> None:
        """Delete the temporary folder; the error that stopped the write is the one raised."""
        for f in self.files.values():
            # Closing flushes what is buffered, which fails again on a full disk.
            with contextlib.suppress(OSError):
                f.close(sync=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _write_small(path: Path, values: Any) -> str:
    """Write a small file whole; its xxh3-64, checked whenever the folder is opened."""
    data = np.asarray(values).tobytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return xxhash.xxh3_64_hexdigest(data)


def _replace_folder(new: Path, path: Path) -> None:
    """Rename `new` to `path`; a token folder there is swapped out (put back if the
    rename fails), then deleted."""
    _refuse_foreign(path)  # files may have been put there while this one was written
    old = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:8]}")
    if not replace_folder(new, path, old):
        return
    if only_ours(old):
        shutil.rmtree(old, ignore_errors=True)
    else:  # a file put there between the check and the swap: kept, not deleted
        warnings.warn(
            f"{path} was replaced, and the folder it was is kept as {old}: files redcoast "
            f"did not write ({', '.join(foreign_files(old))}) appeared in it meanwhile.",
            stacklevel=2,
        )


def _refuse_foreign(path: Path) -> None:
    """Raise unless `path` is free, an empty folder, or a token folder holding nothing else."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        kind = "a symbolic link" if path.is_symlink() else "a file"
        raise ValueError(
            f"{path} is {kind}, not a token folder; give a new path (tokenize writes a "
            "folder there)."
        )
    if not path.is_dir():
        return
    foreign = foreign_files(path)
    if not foreign:
        return
    shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
    why = (
        "its meta.json is not a token folder's"
        if "meta.json" in foreign
        else "besides a token folder"
    )
    raise ValueError(
        f"{path} holds files redcoast did not write ({why}): {shown}. tokenize replaces "
        "only a token folder it wrote itself, so it would delete them; give a new path "
        "(tokenize writes a folder there), or move those files out."
    )


def _clear_leftovers(path: Path) -> None:
    """Delete the `<name>.tmp-*` and `.old-*` folders that interrupted writes left.

    Only the lock's holder calls this, so none of them is being written; a folder of
    such a name that holds anything else is not ours and stays.
    """
    if not path.parent.is_dir():
        return
    for entry in path.parent.iterdir():
        found = LEFTOVER.fullmatch(entry.name)
        if found is None or found["name"] != path.name:
            continue
        if entry.is_dir() and not entry.is_symlink() and only_ours(entry):
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold `.<name>.lock` beside `path`: one writer of the folder at a time; others wait.

    The holder deletes the lock file before it lets go, so none is left beside the
    folder; a waiter that then gets the lock of a deleted file tries again on the
    file now at that name, so two writers never hold locks on different files.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.parent / f".{path.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            os.close(fd)
            if err.errno not in _NO_LOCKS:
                raise
            warnings.warn(
                f"the filesystem of {path.parent} does not support file locks ({err}); "
                f"redcoast cannot keep two processes from writing {path} at once. Make "
                "sure only one tokenizes into it at a time.",
                stacklevel=3,
            )
            yield
            return
        if _same_file(fd, lock):
            break
        os.close(fd)  # a holder deleted it meanwhile: lock the one there now
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)  # closing the descriptor releases the flock


def _same_file(fd: int, path: Path) -> bool:
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (found.st_dev, found.st_ino)


def _reusable(
    path: Path, meta: Mapping[str, Any], same_sources: Callable[[Any], bool]
) -> TokenFile | None:
    """The token folder at `path` when it was made by the same tokenizer and options from
    the same sources (`same_sources` judges the stored ones)."""
    if not (path / "meta.json").is_file():
        return None
    try:
        found = TokenFile.open(path)
    except (ValueError, OSError, KeyError, TypeError):
        return None  # damaged or of another version: rebuilt
    keys = ("kind", "tokenizer", "options")
    if any(found.meta.get(k) != meta[k] for k in keys):
        return None
    return found if same_sources(found.meta.get("sources")) else None


def build(
    path: Path,
    tok: Tokenizer,
    meta: dict[str, Any],
    *,
    mask: bool,
    same_sources: Callable[[Any], bool],
    fill: Callable[[Writer], None],
    what: str,
) -> TokenFile:
    """The token folder at `path`: reused when `_reusable`, else written by `fill`.

    On several processes, process 0 builds and the others open its folder. The
    builder holds the folder's lock from the last check for reuse until the rename,
    so a second writer waits and then reuses this one's folder.
    """

    def make() -> TokenFile:
        found = _reusable(path, meta, same_sources)  # no lock needed to read a folder
        if found is not None:
            return found
        with _locked(path):
            found = _reusable(path, meta, same_sources)  # another writer may have finished
            if found is not None:
                return found
            _clear_leftovers(path)
            _refuse_foreign(path)
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
            writer = Writer(path, tok, mask=mask, meta=meta)
            try:
                fill(writer)
                return writer.finish(what)
            except BaseException:
                writer.abort()
                raise

    return _on_lead(make, path)


def is_lead() -> bool:
    return jax.process_index() == 0


def _on_lead(make: Callable[[], TokenFile], path: Path) -> TokenFile:
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
