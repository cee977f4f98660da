"""Replacing a checkpoint folder so that a kill at any moment loses nothing.

A save writes `.NAME.tmp-HOST-PID-RAND/`, renames a previous `NAME` to
`.NAME.old-RAND/`, renames the new one to `NAME` and deletes the old one, with
fsyncs between; what a kill leaves behind is undone by the next save into the
same parent folder, and read in the meantime (see `checkpoint.py`).
"""

import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

import jax
import numpy as np

from .._files import replace_folder
from ._format import FORMAT, STATE, CheckpointError

__all__ = [
    "OLD",
    "STALE_SECONDS",
    "agree",
    "is_checkpoint",
    "put_in_place",
    "refusal",
    "resolve",
    "temporary_path",
    "tidy",
]

STALE_SECONDS = 24 * 3600

_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")
OLD = re.compile(r"^\.(?P<name>.+)\.old-[0-9a-f]{8}$")


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's entry to disk (what makes a rename durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds a `state.json` of our format (its tensors are not read)."""
    try:
        return json.loads((folder / STATE).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def refusal(final: Path) -> str | None:
    """Why `final` must not be replaced, or None when it is absent or one of ours."""
    if not final.exists() and not final.is_symlink():
        return None
    if final.is_symlink() or not final.is_dir():
        what = "a symbolic link" if final.is_symlink() else "a file"
    elif is_checkpoint(final):
        return None
    else:
        what = f"a folder without a redcoast {STATE}"
    return (
        f"save_checkpoint: {final} is {what}, not a redcoast checkpoint; nothing was written "
        "or moved. Save to another path, or move it away first."
    )


def agree(error: str | None) -> None:
    """Raise `error` (found on process 0) on every process, so none waits for the others."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flag = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
        if error is None and int(flag):
            error = "save_checkpoint: process 0 refused the path; see its error."
    if error is not None:
        raise CheckpointError(error)


def temporary_path(final: Path) -> Path:
    """Where a save into `final` writes until it is complete: `.NAME.tmp-HOST-PID-RAND`."""
    tag = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return final.with_name(f".{final.name}.tmp-{tag}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tidy(parent: Path) -> None:
    """Undo what killed saves left in `parent` (see `checkpoint.py`); process 0 only."""
    if not parent.is_dir():
        return
    host, now = socket.gethostname(), time.time()
    for child in parent.iterdir():
        tmp, old = _TMP.match(child.name), OLD.match(child.name)
        if tmp is not None and child.is_dir():
            pid = int(tmp["pid"])
            mine = tmp["host"] == host and pid != os.getpid() and not _alive(pid)
            if mine or now - child.stat().st_mtime > STALE_SECONDS:
                shutil.rmtree(child, ignore_errors=True)
        elif old is not None and child.is_dir():
            final = parent / old["name"]
            # With the new checkpoint in place the old one is garbage, even half
            # deleted (a kill during its removal leaves it without state.json).
            if is_checkpoint(final):
                shutil.rmtree(child, ignore_errors=True)
            elif is_checkpoint(child) and not final.exists() and not final.is_symlink():
                child.rename(final)  # the kill came between the two renames of a replace
                _fsync(parent)


def put_in_place(tmp: Path, final: Path) -> None:
    """Rename the complete `tmp` to `final`, keeping the previous one until it is there."""
    _fsync(tmp)
    trash = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    if replace_folder(tmp, final, trash):
        _fsync(final.parent)
        shutil.rmtree(trash)
    _fsync(final.parent)


def resolve(folder: Path) -> Path:
    """`folder`, or the complete `.NAME.old-*` that a save killed between its renames left."""
    if folder.exists() or not folder.parent.is_dir():
        return folder
    for child in sorted(folder.parent.iterdir()):
        old = OLD.match(child.name)
        if old is not None and old["name"] == folder.name and is_checkpoint(child):
            return child
    return folder
