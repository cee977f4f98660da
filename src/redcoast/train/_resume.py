"""Resuming a run step-exactly: what a checkpoint records of the loop, and reading it back.

A checkpoint of a run holds, beside the model and optimizer state, the epoch and
the position in it, the seed and global batch size, the best metric so far, the
epoch's number of examples and a checksum of their order, what the LoRA adapters
compute beyond their arrays (targets, rank, alpha, dropout), and with a trainable
filter the fingerprint of the frozen arrays. Resuming checks each against the run
at hand, and keeps `metrics.jsonl` up to the checkpoint's step.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh

from .._files import written_whole
from ..checkpoint._io import checkpoint_state, latest_checkpoint, load_checkpoint, save_checkpoint
from ..lora._layers import adapters_differ, adapters_record
from ..parallel._context_parallel import ContextParallel
from ..parallel._parallelism import Parallelism
from .logging import MetricsBuffer, read_jsonl
from .loop import LoopState

__all__ = ["Run", "resume", "saver"]


@dataclasses.dataclass(frozen=True)
class Run:
    """What every part of one `fit` call shares."""

    mesh: Mesh
    size: int  # the global batch of one optimizer step
    seed: int
    key: Any
    root: str | None  # the workdir
    lead: bool  # process 0, which writes
    # epoch -> {"n_examples", "order"}: what a checkpoint records of the epoch's data.
    data: Callable[[int], dict[str, Any]] | None = None
    # With a trainable filter: its mask (checkpoints hold what it selects) and the
    # fingerprint of the frozen arrays, which a checkpoint records and resume checks.
    trainable: Any = None
    frozen: dict[str, Any] | None = None
    # How the placed model's computation is split (FSDP, sequence, context), read once.
    parallelism: Parallelism = dataclasses.field(default_factory=Parallelism)
    # With context_parallel: every sequence split over the data axis, rows whole.
    context: ContextParallel | None = None

    def saved_part(self, model: Any) -> Any:
        """What a checkpoint holds of `model`: its trainable arrays, or all of it."""
        return model if self.trainable is None else eqx.filter(model, self.trainable)

    @property
    def ckpts(self) -> str | None:
        return None if self.root is None else os.path.join(self.root, "ckpts")


def saver(run: Run, buffer: MetricsBuffer) -> Callable[[Path, LoopState], None]:
    """`(path, state) -> None`: a checkpoint that resumes this run step-exactly."""

    def save(path: Path, s: LoopState) -> None:
        loop = {
            "epoch": s.epoch,
            "position": s.position,
            "seed": run.seed,
            "global_batch_size": run.size,
            "best": None if s.best is None else dataclasses.asdict(s.best),
            **({} if run.data is None else run.data(s.epoch)),
            # None without adapters, so a resume tells a run without them from a
            # checkpoint saved before redcoast recorded them (no key at all).
            "lora": adapters_record(s.model),
            **({} if run.frozen is None else {"frozen": run.frozen}),
        }
        save_checkpoint(
            path,
            model=run.saved_part(s.model),
            opt_state=s.opt_state,
            step=s.step,
            loop=loop,
            rng=np.asarray(jax.random.key_data(run.key)),
            metrics=dict(buffer.last),
        )

    return save


def resume(run: Run, state: LoopState) -> tuple[LoopState, dict[str, Any]]:
    """The state of the newest checkpoint of the run, checked against its seed and batch."""
    history: dict[str, Any] = {"train": [], "eval": []}
    assert run.root is not None and run.ckpts is not None
    found = latest_checkpoint(run.ckpts)
    if found is None:
        return state, history
    saved = checkpoint_state(found).get("loop", {})
    # Before the base and the arrays: another rank or other targets would fail
    # there too, with an error that does not say it is the adapters.
    _check_adapters(found, saved, state.model)
    _check_base(found, saved.get("frozen"), run.frozen)
    # Loaded into the shardings of the freshly placed model and optimizer state.
    ckpt = load_checkpoint(found, like=run.saved_part(state.model), opt_state_like=state.opt_state)
    model = ckpt.model
    if run.trainable is not None:
        model = eqx.combine(model, eqx.filter(state.model, run.trainable, inverse=True))
    loop = ckpt.state.get("loop", {})
    if loop.get("seed") != run.seed or loop.get("global_batch_size") != run.size:
        raise ValueError(
            f"cannot resume step-exactly from {found}: it was saved with seed="
            f"{loop.get('seed')} and a global batch of {loop.get('global_batch_size')}, "
            f"this run has seed={run.seed} and a global batch of {run.size}. Use the same "
            "seed and per_device_batch_size x data shards x accumulate_grad_batches, or a "
            "new workdir."
        )
    _check_data(found, loop, run)
    best = state.best
    if best is not None and loop.get("best") and loop["best"]["metric"] == best.metric:
        best = dataclasses.replace(best, **loop["best"])
    history = _restore_history(os.path.join(run.root, "metrics.jsonl"), ckpt.step, run.lead)
    if run.lead:
        print(f"redcoast: resuming from {found} (step {ckpt.step}, epoch {loop['epoch']})")
    resumed = dataclasses.replace(
        state,
        model=model,
        opt_state=ckpt.opt_state,
        step=ckpt.step,
        epoch=int(loop["epoch"]),
        position=int(loop["position"]),
        best=best,
    )
    return resumed, history


def _check_adapters(found: Path, loop: dict[str, Any], model: Any) -> None:
    """Refuse to resume with LoRA adapters that compute otherwise than the saved ones."""
    if "lora" not in loop:  # saved before redcoast recorded the adapters
        return
    differences = adapters_differ(loop["lora"], adapters_record(model))
    if differences:
        raise ValueError(
            f"cannot resume from {found}: the model's LoRA adapters are not the ones it was "
            f"saved with ({'; '.join(differences)}), so the resumed run would compute "
            "another function than the one trained so far. Build the model as the run did "
            "(rc.lora.apply with the same targets, rank, alpha and dropout), or start the "
            "changed run in a new workdir."
        )


def _check_base(found: Path, saved: dict[str, Any] | None, now: dict[str, Any] | None) -> None:
    """Refuse to resume a partly trained run on a frozen base other than its own."""
    if saved == now:
        return
    if saved is None:
        raise ValueError(
            f"cannot resume from {found}: it holds a whole model, saved by a run without "
            "trainable=, and this run trains part of the model. Resume without trainable=, "
            "or start the partial run in a new workdir."
        )
    if now is None:
        raise ValueError(
            f"cannot resume from {found}: it holds only the trainable arrays of a run with "
            "trainable=, on a frozen base of "
            f"{saved['arrays']} arrays ({saved['bytes']} bytes). Pass the same trainable= "
            "and the same base model."
        )
    raise ValueError(
        f"cannot resume from {found}: its trainable arrays were trained on another frozen "
        f"base ({saved['arrays']} arrays, {saved['bytes']} bytes, xxh3_64 "
        f"{saved['xxh3_64']}) than this run's ({now['arrays']} arrays, {now['bytes']} bytes, "
        f"xxh3_64 {now['xxh3_64']}). Pass the base model the run started from (the same "
        "weights, dtypes and trainable=), or a new workdir."
    )


def _check_data(found: Path, loop: dict[str, Any], run: Run) -> None:
    """Refuse to resume on other data: the saved position would point into another order."""
    if "n_examples" not in loop or run.data is None:  # saved before redcoast recorded it
        return
    epoch = int(loop["epoch"])
    now = run.data(epoch)
    if now["n_examples"] != loop["n_examples"]:
        raise ValueError(
            f"cannot resume step-exactly from {found}: epoch {epoch} had "
            f"{loop['n_examples']} training examples when it was saved, and this run's "
            f"train_examples has {now['n_examples']}. The saved position ({loop['position']} "
            "batches into the epoch) would skip or repeat examples. Pass the same "
            "train_examples, or start afresh in a new workdir (or with overwrite=True)."
        )
    if now["order"] != loop["order"]:
        raise ValueError(
            f"cannot resume step-exactly from {found}: epoch {epoch}'s order of its "
            f"{now['n_examples']} examples (seed {run.seed}) is not the saved one (checksum "
            f"{now['order']}, saved {loop['order']}): NumPy shuffles them differently here "
            "(another NumPy version?). Resume with the NumPy that saved the run, or start "
            "afresh in a new workdir."
        )


def _restore_history(path: str, step: int, lead: bool) -> dict[str, list[dict[str, Any]]]:
    """Records of `metrics.jsonl` up to `step`; on process 0, later lines are dropped.

    Lines after the checkpoint were written by the run that was interrupted; the
    resumed run writes those steps again. So is a torn last line (skipped with a
    warning by `read_jsonl`), which the next line must not be appended to.
    """
    history: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    if not os.path.isfile(path):
        return history
    records, unfinished = read_jsonl(path)
    kept = [r for r in records if int(r.get("step", 0)) <= step]
    if lead and (unfinished or len(kept) != len(records)):
        with written_whole(Path(path), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
    for r in kept:
        history["eval" if any(k.startswith("eval_") for k in r) else "train"].append(r)
    return history
