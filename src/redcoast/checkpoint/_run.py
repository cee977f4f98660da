"""A run's checkpoint folder: when `fit` saves, `step_*` names, the newest whole one, pruning."""

import dataclasses
import os
import shutil
import warnings
from pathlib import Path

from .._checks import check_positive
from ._durable import OLD, is_checkpoint
from ._format import CheckpointError, read_group, read_state, verify_groups

__all__ = [
    "STEP_PREFIX",
    "Checkpointing",
    "latest_checkpoint",
    "prune_checkpoints",
    "step_checkpoint_path",
]

STEP_PREFIX = "step_"


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """When `fit` writes `workdir/ckpts/step_XXXXXXXX` checkpoints, and how many it keeps.

    Attributes:
        every: save every this many steps.
        last: save after the last step (and when a signal stops the run).
        keep_last_n: keep only the newest this many `step_*` checkpoints of the run.

    Example:
        >>> rc.fit(..., workdir="runs/x", checkpointing=rc.Checkpointing(every=500, keep_last_n=3))
    """

    every: int | None = None
    last: bool = True
    keep_last_n: int | None = None

    def __post_init__(self) -> None:
        check_positive("Checkpointing.every", self.every)
        check_positive("Checkpointing.keep_last_n", self.keep_last_n)


def step_checkpoint_path(folder: str | os.PathLike[str], step: int) -> Path:
    """Where a run keeps its checkpoint of `step`: `folder/step_00000100`.

    Args:
        folder: the run's checkpoint folder (`fit` uses `workdir/ckpts`).
        step: the optimizer step.

    Returns:
        The path; zero-padded so that names sort by step.

    Example:
        >>> step_checkpoint_path("runs/x/ckpts", 100)
        PosixPath('runs/x/ckpts/step_00000100')
    """
    return Path(folder) / f"{STEP_PREFIX}{int(step):08d}"


def _step_folders(folder: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """`step_*` folders in `folder` (or the `.step_*.old-*` a killed replace left), oldest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = {}
    for child in root.iterdir():
        old = OLD.match(child.name)
        name = child.name if old is None else old["name"]
        digits = name[len(STEP_PREFIX) :]
        if not (name.startswith(STEP_PREFIX) and digits.isdigit() and child.is_dir()):
            continue
        if old is None or (not (root / name).exists() and is_checkpoint(child)):
            found[int(digits)] = child
    return sorted(found.items())


def _validate(folder: Path, verify: bool) -> None:
    """Raise `CheckpointError` unless every file `state.json` names is whole (and, with
    `verify`, matches its checksums)."""
    state = read_state(folder)
    groups = {group: read_group(folder, names) for group, names in state["files"].items()}
    if verify:
        verify_groups(state, groups)


def latest_checkpoint(folder: str | os.PathLike[str], *, verify: bool = False) -> Path | None:
    """The newest undamaged training checkpoint in a run's checkpoint folder.

    Only `step_*` folders count: a best-metric checkpoint (`best/`) is never
    "latest", so resuming never rolls training back to an older best. Newer folders
    that are damaged (state.json missing or unreadable, a file missing, truncated or
    with a bad header) are skipped with a warning naming each and why. Tensors are
    not read unless `verify=True`: `load_checkpoint` checks them anyway.

    Args:
        folder: the run's checkpoint folder (`fit` uses `workdir/ckpts`).
        verify: also check every tensor's checksum (a full read of each candidate).

    Returns:
        The folder of the highest step that passed, or None when there is none.

    Example:
        >>> ckpt = load_checkpoint(latest_checkpoint("runs/x/ckpts"), like=model)
    """
    for _, path in reversed(_step_folders(folder)):
        try:
            _validate(path, verify)
        except CheckpointError as err:
            warnings.warn(f"latest_checkpoint: skipping {path}: {err}", stacklevel=2)
            continue
        return path
    return None


def prune_checkpoints(folder: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the newest `keep` `step_*` checkpoints (call on process 0 only).

    Args:
        folder: the run's checkpoint folder.
        keep: how many of the newest to keep (at least 1).

    Returns:
        The folders deleted.

    Example:
        >>> prune_checkpoints("runs/x/ckpts", keep=3)
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}.")
    complete = [path for _, path in _step_folders(folder) if is_checkpoint(path)]
    old = complete[:-keep]
    for path in old:
        shutil.rmtree(path)
    return old
