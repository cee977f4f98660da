"""One run per workdir: its files are refused to a fresh run, and one live run holds it.

`claim_workdir` refuses a fresh run where another run left checkpoints, logs or
evaluations (unless it may delete them), but two runs started a second apart
both find it empty, and a run resumed while another still trains resumes that
run's step: either way both write the same `step_*` checkpoints and
`metrics.jsonl`. An OS lock closes that gap. The kernel releases a `flock` when
its process exits, however it exits (SIGKILL and power loss included), so a lock
never outlives its run and a killed run's workdir can be resumed at once; no
stale lock file ever has to be removed by hand.

The lock file stays in the workdir between runs (removing it would let a run
lock a file that another has just unlinked); what it holds — the holder's process
id, host, start time and command — is only read to name the holder in the error
of a run that is turned away. Locks work on local disks and on shared
filesystems that support them (NFS with its lock service, Lustre mounted with
`flock`, GPFS); where the filesystem refuses them, `hold_workdir` warns that it
cannot keep a second run out and goes on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import warnings
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from .data import barrier

LOCK_FILE = ".redcoast.lock"
"""The file in a workdir that its live run holds locked."""

_RUN_FILES = ("ckpts", "metrics.jsonl", "eval")
"""What a run writes in its workdir: checkpoints, `metrics.jsonl` and evaluations."""

# What filesystems without locks answer a flock with.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
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
        who = "a process that has not yet said which (it holds the lock as of now)"
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


def _acquire(workdir: str) -> int | None:
    """Lock `workdir`'s lock file: its descriptor, or None where locks are not supported.

    Raises:
        WorkdirInUseError: another open file description holds the lock.
    """
    os.makedirs(workdir or os.curdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise WorkdirInUseError(_in_use(workdir, path)) from None
    except OSError as err:
        os.close(fd)
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
    text = json.dumps(_me()).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, text, 0)
    return fd


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
def hold_workdir(workdir: str | os.PathLike[str]) -> Iterator[None]:
    """Hold `workdir` for one run: no other process may hold it until the block exits.

    Process 0 creates the workdir if needed and takes an exclusive `flock` on
    `workdir/.redcoast.lock`, before anything in the workdir is read or written;
    the other processes of a multi-process job wait for its verdict and all stop
    together when it is refused. The lock is released when the block exits, by
    return or exception, and by the kernel when the process dies.

    Args:
        workdir: the run's folder.

    Yields:
        Nothing; the workdir is held inside the block.

    Raises:
        WorkdirInUseError: another live run holds the workdir; the message names its
            process id, host, start time and command.
        OSError: process 0 could not create or open the lock file (the other
            processes raise `RuntimeError` with its message).

    Example:
        >>> with hold_workdir("runs/x"):
        ...     ...   # the only live run writing runs/x
    """
    root = os.fspath(workdir)
    fd: int | None = None
    verdict: tuple[int, str] = (_HELD, "")
    failure: BaseException | None = None
    if jax.process_index() == 0:
        try:
            fd = _acquire(root)
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
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing the last descriptor of the file releases the flock


def claim_workdir(workdir: str, *, resume: bool, overwrite: bool, lead: bool) -> None:
    """A workdir belongs to one run: refuse a fresh run where another run left its files.

    Args:
        workdir: the run's folder.
        resume: the run continues the one in `workdir`; its files are its own.
        overwrite: delete another run's checkpoints, logs and evaluations first.
        lead: this is process 0, which deletes; every process must call this.

    Raises:
        ValueError: both `resume` and `overwrite`.
        FileExistsError: a fresh run without `overwrite` where another run left files.
    """
    if resume and overwrite:
        raise ValueError(
            "resume=True continues the run in workdir and overwrite=True deletes it; pass one."
        )
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
