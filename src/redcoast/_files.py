"""Writing a file or a folder whole: under a temporary name beside it, renamed into
place when complete.

A reader never sees half of one, and an error leaves the target as it was: the
temporary file is removed, a folder being replaced is put back. A temporary name is
new (a random tag, created exclusively), so it is never a user's file.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["check_output_file", "replace_folder", "with_path", "written_whole"]


def with_path(err: OSError, path: Path) -> OSError:
    """The same error (same errno, so the same subclass) naming the file it happened to."""
    if err.filename is not None:
        return err
    return OSError(err.errno, err.strerror or os.strerror(err.errno or 0), str(path))


def check_output_file(path: Path, what: str) -> None:
    """Raise a `ValueError` naming `what` unless a file can be written at `path` once its
    missing folders are made: checked before the work whose result it will hold."""
    if path.is_dir():
        raise ValueError(
            f"{what} {path} is a folder; pass the path of the file to write, in it or elsewhere."
        )
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(
            f"{what} {path} cannot be written: {folder} is a file, not a folder. Pass a "
            "path in a folder."
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(
            f"{what} {path} cannot be written: no permission to write in {folder}. Pass a "
            "path in a folder you can write to."
        )


@contextlib.contextmanager
def written_whole(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """A new file that becomes `path` when the block ends without an error, on disk
    (fsynced) before the rename. On any error it is removed and `path` is left as it
    was; an `OSError` that names no file is raised naming `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        # 0o666: the umask decides, as for any file the user's programs make.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        with open(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, OSError) and err.filename is None:
            raise with_path(err, path) from err
        raise


def replace_folder(new: Path, path: Path, old: Path) -> bool:
    """Rename the complete folder `new` to `path`. A folder already at `path` is first
    renamed to `old`, and put back when the second rename fails; returns whether there
    was one (the caller deletes `old`)."""
    if not path.exists():
        new.rename(path)
        return False
    path.rename(old)
    try:
        new.rename(path)
    except BaseException:
        old.rename(path)
        raise
    return True
