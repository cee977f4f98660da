"""One run per workdir: its files are refused to a fresh run, and one live run holds it.

`claim_workdir` refuses a fresh run where another run left checkpoints, logs or
evaluations (unless it may delete them), but two runs started a second apart
both find it empty, and a run resumed while another still trains resumes that
run's step: either way both write the same `step_*` checkpoints and
`metrics.jsonl`. An OS lock closes that gap. The kernel releases a `flock` when
its process exits, however it exits (SIGKILL and power loss included), so a lock
never outlives its run and a killed run's workdir can be resumed at once; no
stale lock file ever has to be removed by hand.

The lock is held on the workdir folder itself, which a user does not delete
while the run trains without deleting the run; `.redcoast.lock` beside the run's
files only says who holds it (process id, host, start time, command), for the
error of a run that is turned away, so removing it changes nothing. Where a
filesystem cannot lock a folder (NFS emulates `flock` with byte-range locks,
which a folder cannot take), the lock is held on `.redcoast.lock` itself. Before
each checkpoint, `fit` checks that the path still names what it holds locked
(`WorkdirLock.check`): a workdir (or lock file) deleted or replaced under a
live run stops that run, with its model in the error, before it writes into
another run's folder. Locks work on local disks and on shared filesystems that
support them (NFS with its lock service, Lustre mounted with `flock`, GPFS);
where the filesystem refuses them, `hold_workdir` warns that it cannot keep a
second run out and goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..distributed._host import barrier

LOCK_FILE = ".redcoast.lock"
"""The file in a workdir that says which live run holds it (and is locked itself where a
filesystem cannot lock the folder)."""

_RUN_FILES = ("ckpts", "metrics.jsonl", "eval")
"""What a run writes in its workdir: checkpoints, `metrics.jsonl` and evaluations."""

# What filesystems without locks answer a flock with.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
# What a filesystem that locks files but not folders answers a folder's flock with.
_NO_FOLDER_LOCKS = {errno.EBADF, errno.EISDIR, errno.EINVAL, *_NO_LOCKS}
# Process 0's verdict, broadcast as a kind and a message in this many bytes of UTF-8.
_VERDICT_BYTES = 4096
_HELD, _IN_USE, _FAILED = 0, 1, 2


class WorkdirInUseError(RuntimeError):
    """Another live run holds the workdir; the message names its process and host."""


def _holder(path: str) -> dict[str, object]:
    """What the live holder of `path` wrote about itself, or `{}` if it has not yet."""
    # The holder writes this just after its flock succeeds; a reader that lost the
    # race to it may find the file empty, or a dead earlier holder's text, for a moment.
    for _ in range(40):
        try:
            with open(path) as f:
                found = json.loads(f.read() or "{}")
        except (OSError, ValueError):
            found = {}
        if isinstance(found, dict) and found.get("pid") and not _dead_here(found):
            return found
        time.sleep(0.05)
    return {}


def _dead_here(holder: dict[str, object]) -> bool:
    """The holder is a process of this host that no longer exists (a stale description)."""
    if holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _in_use(workdir: str, path: str) -> str:
    holder = _holder(path)
    if holder:
        mine = (holder.get("pid"), holder.get("host")) == (os.getpid(), socket.gethostname())
        this = " (this very process)" if mine else ""
        who = (
            f"process {holder.get('pid')} on host {holder.get('host')}{this}, running "
            f"since {holder.get('since')}: {holder.get('command')}"
        )
    else:
        who = (
            f"a process that has not said which ({path} holds no live holder's "
            "description; it holds the lock as of now)"
        )
    return (
        f"workdir {workdir} is in use by another live run: {who}. Two runs in one "
        "workdir would overwrite each other's checkpoints and logs. Wait for that run "
        "to end, or stop it (the workdir is free the moment it exits, even by kill -9) "
        "and then pass resume=True to continue it; or give this run another workdir."
    )


def _me() -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv])[:500],
    }


@dataclasses.dataclass(frozen=True)
class WorkdirLock:
    """What process 0 holds locked for a run: the workdir folder, or its lock file.

    Attributes:
        workdir: the run's folder.
        path: what is locked: `workdir` itself, or `workdir/.redcoast.lock` where the
            filesystem cannot lock a folder.
        fd: the open descriptor that holds the `flock`.
    """

    workdir: str
    path: str
    fd: int

    def moved(self) -> str | None:
        """Why `path` no longer names the locked file or folder, or None while it does."""
        try:
            now = os.stat(self.path)
        except OSError as err:
            return f"{self.path} is gone ({err.strerror})"
        held = os.fstat(self.fd)
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return f"{self.path} was replaced by another file or folder"
        return None


def _flock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _lock_one(path: str, flags: int) -> int:
    """An open descriptor of `path` holding its exclusive flock; OSError from `flock`."""
    fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
    try:
        _flock(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _acquire(workdir: str) -> WorkdirLock | None:
    """Lock `workdir` (or its lock file): the held lock, or None where locks are not supported.

    Raises:
        WorkdirInUseError: another open file description holds the lock.
    """
    root = workdir or os.curdir
    os.makedirs(root, exist_ok=True)
    note = os.path.join(root, LOCK_FILE)
    try:
        try:
            held = WorkdirLock(root, root, _lock_one(root, os.O_RDONLY))
        except OSError as err:
            if isinstance(err, BlockingIOError) or err.errno not in _NO_FOLDER_LOCKS:
                raise
            # The filesystem locks files only: the lock file is what is held.
            held = WorkdirLock(root, note, _lock_one(note, os.O_RDWR | os.O_CREAT))
    except BlockingIOError:
        raise WorkdirInUseError(_in_use(workdir, note)) from None
    except OSError as err:
        if err.errno not in _NO_LOCKS:
            raise
        warnings.warn(
            f"the filesystem of workdir {workdir} does not support file locks ({err}); "
            "redcoast cannot stop a second run from using this workdir at the same time, "
            "which would overwrite this run's checkpoints and logs. Make sure no other run "
            "uses it, or put the workdir where locks work (a local disk; NFS with its lock "
            "service; Lustre mounted with -o flock).",
            stacklevel=4,
        )
        return None
    _describe(note, held.fd if held.path == note else None)
    return held


def _describe(note: str, fd: int | None) -> None:
    """Write who holds the workdir into its lock file, for a run that is turned away.

    `fd` is the lock file's held descriptor when the file is what is locked: where
    `flock` is emulated by POSIX locks (NFS), closing any other descriptor of the
    file would drop the lock.
    """
    own = fd is None
    if fd is None:
        fd = os.open(note, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)
    finally:
        if own:
            os.close(fd)


def _agree(verdict: tuple[int, str]) -> tuple[int, str]:
    """Process 0's `(kind, message)` on every process: the others wait for its verdict."""
    if jax.process_count() == 1:
        return verdict
    kind, message = verdict
    raw = np.zeros(_VERDICT_BYTES, np.uint8)
    data = message.encode()[: _VERDICT_BYTES - 1]
    raw[0] = kind
    raw[1 : 1 + len(data)] = np.frombuffer(data, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(raw))
    return int(got[0]), bytes(got[1:]).rstrip(b"\0").decode(errors="replace")


@contextlib.contextmanager
def hold_workdir(workdir: str | os.PathLike[str]) -> Iterator[Callable[[], None]]:
    """Hold `workdir` for one run: no other process may hold it until the block exits.

    Process 0 creates the workdir if needed and takes an exclusive `flock` on the
    folder (on `workdir/.redcoast.lock` where the filesystem cannot lock a
    folder), before anything in the workdir is read or written; the other
    processes of a multi-process job wait for its verdict and all stop together
    when it is refused. The lock is released when the block exits, by return or
    exception, and by the kernel when the process dies.

    Args:
        workdir: the run's folder.

    Yields:
        `check()`, to call on every process before writing into the workdir: it
        raises `WorkdirInUseError` on all of them when the workdir (or the lock
        file that is held) was deleted or replaced since it was locked.

    Raises:
        WorkdirInUseError: another live run holds the workdir; the message names its
            process id, host, start time and command.
        OSError: process 0 could not create or open the lock file (the other
            processes raise `RuntimeError` with its message).

    Example:
        >>> with hold_workdir("runs/x") as check:
        ...     check()   # still the only live run writing runs/x
    """
    root = os.fspath(workdir)
    held: WorkdirLock | None = None
    verdict: tuple[int, str] = (_HELD, "")
    failure: BaseException | None = None
    if jax.process_index() == 0:
        try:
            held = _acquire(root)
        except WorkdirInUseError as err:
            verdict = (_IN_USE, str(err))
        except BaseException as err:  # the others must still hear a verdict
            failure = err
            verdict = (
                _FAILED,
                f"process 0 could not lock {os.path.join(root, LOCK_FILE)}: {err!r}",
            )
    kind, message = _agree(verdict)
    if failure is not None:
        raise failure
    if kind == _IN_USE:
        raise WorkdirInUseError(message)
    if kind == _FAILED:
        raise RuntimeError(message)

    def check() -> None:
        why = None if held is None else held.moved()
        kind, message = _agree((_HELD, "") if why is None else (_IN_USE, why))
        if kind == _IN_USE:
            raise WorkdirInUseError(
                f"workdir {root} is no longer this run's: {message} while the run trained, "
                "so another run may hold it now, and this run writes no checkpoint there. "
                "Its last state is in this error (`loop_state`, when it comes out of fit): "
                "save it elsewhere, or start again in another workdir."
            )

    try:
        yield check
    finally:
        if held is not None:
            os.close(held.fd)  # closing the last descriptor releases the flock


def claim_workdir(workdir: str, *, resume: bool, overwrite: bool, lead: bool) -> None:
    """A workdir belongs to one run: refuse a fresh run where another run left its files.

    Args:
        workdir: the run's folder.
        resume: the run continues the one in `workdir`; its files are its own.
        overwrite: delete another run's checkpoints, logs and evaluations first.
        lead: this is process 0, which deletes; every process must call this.

    Raises:
        FileExistsError: a fresh run without `overwrite` where another run left files.
    """
    found = [
        name
        for name in _RUN_FILES
        if os.path.isfile(os.path.join(workdir, name))
        or (os.path.isdir(os.path.join(workdir, name)) and os.listdir(os.path.join(workdir, name)))
    ]
    if resume or not found:
        return
    if not overwrite:
        raise FileExistsError(
            f"workdir {workdir} already holds a run ({', '.join(found)}). Pass resume=True to "
            "continue that run, overwrite=True to delete its checkpoints and logs and start "
            "afresh, or a new or empty workdir."
        )
    if lead:
        for name in found:
            path = os.path.join(workdir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    barrier("redcoast-claim-workdir")
