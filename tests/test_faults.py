"""Faults and misuse: each case asserts that nothing valid is lost and the error names the cause.

Checkpoints: a save or a checkpoint is damaged (kill -9 at several points of a real
save in a subprocess, disk full, no permission, flipped bytes, truncation, bad
headers and dtypes) and the last good checkpoint still loads. The loop: the
caller's arrays stay valid, a workdir holds one run, non-finite gradients and
updates never reach a checkpoint, signals and hooks stop a run cleanly.
"""

import dataclasses
import errno
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redcoast as rc
import redcoast.checkpoint as ckpt_module
from redcoast.checkpoint import CheckpointError
from redcoast.checkpoint import step_checkpoint_path as step_path


def tree(step: int) -> dict[str, Any]:
    """A small model whose values say which step saved it."""
    return {
        "w": jnp.full((4, 8), float(step), jnp.float32),
        "b": jnp.arange(8, dtype=jnp.float32) + step,
        "n": jnp.array(step, jnp.int32),
    }


LIKE = tree(0)


def assert_is_step(path: Path, step: int) -> None:
    got = rc.load_checkpoint(path, like=LIKE)
    assert got.step == step
    np.testing.assert_array_equal(np.asarray(got.model["w"]), np.full((4, 8), float(step)))
    assert int(got.model["n"]) == step


def header_of(file: Path) -> tuple[int, dict[str, Any]]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def rewrite_header(file: Path, header: dict[str, Any]) -> None:
    """Replace the header, keeping its length, so only what the test changed differs."""
    raw = file.read_bytes()
    n, _ = header_of(file)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    file.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n :])


# ----------------------------------------------------------------------------- kill -9

CHILD = textwrap.dedent(
    """
    import os, shutil, sys, time
    import jax.numpy as jnp
    import redcoast as rc

    path, point = sys.argv[1], sys.argv[2]
    def tree(step):
        return {"w": jnp.full((4, 8), float(step), jnp.float32),
                "b": jnp.arange(8, dtype=jnp.float32) + step, "n": jnp.array(step, jnp.int32)}
    rc.save_checkpoint(path, model=tree(1), step=1)
    def die(*args, **kwargs):
        os.kill(os.getpid(), 9)
    if point == "loop":
        big = {"w": jnp.ones((512, 1024)), "v": jnp.zeros((512, 1024))}
        print("ready", flush=True)
        while True:
            rc.save_checkpoint(path, model={**tree(1), **big}, step=1)
    calls = {"n": 0}
    real_rename = os.rename
    def second_rename(a, b):
        calls["n"] += 1
        if calls["n"] == 2:
            die()
        real_rename(a, b)
    if point == "write":
        os.fsync = die  # the first fsync comes after the model file's bytes
    elif point == "between-renames":
        os.rename = second_rename
    elif point == "before-delete-old":
        shutil.rmtree = die
    rc.save_checkpoint(path, model=tree(2), step=2)
    print("not killed", flush=True)
    """
)


def run_child(path: Path, point: str) -> subprocess.Popen[str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), point],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("point", ["write", "between-renames", "before-delete-old"])
def test_kill_9_while_replacing_a_checkpoint(tmp_path: Path, point: str) -> None:
    path = tmp_path / "best"
    child = run_child(path, point)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, out
    # Killed before the new one was in place: the old is read (from .best.old-* when
    # the kill came between the renames); after the last rename: the new one.
    want = 2 if point == "before-delete-old" else 1
    assert_is_step(path, want)
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "best")
    assert leftovers, "a killed save leaves its temporary or old folder behind"
    rc.save_checkpoint(path, model=tree(3), step=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
    assert_is_step(path, 3)


def test_kill_9_at_a_random_moment_of_a_save_loop(tmp_path: Path) -> None:
    path = tmp_path / "best"
    child = run_child(path, "loop")
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)
    big = jnp.zeros((512, 1024))
    got = rc.load_checkpoint(path, like={**LIKE, "w": big, "v": big})
    assert got.step == 1 and float(got.model["w"].sum()) == 512 * 1024
    rc.save_checkpoint(path, model=tree(3), step=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


# ----------------------------------------------------------------------------- failed writes


class Full:
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, handle: Any, room: int) -> None:
        self.handle, self.room = handle, room

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= size
        return self.handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def __enter__(self) -> "Full":
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


def test_disk_full_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = rc.save_checkpoint(tmp_path / "c", model=tree(1), step=1)

    def full_disk(file: Any, mode: str = "r", **kwargs: Any) -> Full:
        return Full(open(file, mode, **kwargs), 200)

    monkeypatch.setattr(ckpt_module, "open", full_disk, raising=False)
    with pytest.raises(OSError, match=r"No space left on device.*\.c\.tmp-") as err:
        rc.save_checkpoint(path, model=tree(2), step=2)
    assert err.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert_is_step(path, 1)


def test_read_only_folder_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # We may run as root, for whom chmod does not stop writes: refuse the open instead.
    path = rc.save_checkpoint(tmp_path / "c", model=tree(1), step=1)

    def refuse(file: Any, mode: str = "r", **kwargs: Any) -> Any:
        if "w" in mode:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return open(file, mode, **kwargs)

    monkeypatch.setattr(ckpt_module, "open", refuse, raising=False)
    with pytest.raises(PermissionError, match=r"Permission denied.*model\.safetensors"):
        rc.save_checkpoint(path, model=tree(2), step=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert_is_step(path, 1)


# ----------------------------------------------------------------------------- damaged files


def test_flipped_byte_in_tensor_data(tmp_path: Path) -> None:
    path = rc.save_checkpoint(step_path(tmp_path, 1), model=tree(1), step=1)
    file = path / "model.safetensors"
    n, header = header_of(file)
    raw = bytearray(file.read_bytes())
    raw[8 + n + header["w"]["data_offsets"][0] + 5] ^= 0x40
    file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: 'w' fails its checksum"):
        rc.load_checkpoint(path, like=LIKE)
    unchecked = rc.load_checkpoint(path, like=LIKE, verify=False)
    assert not np.array_equal(np.asarray(unchecked.model["w"]), np.ones((4, 8)))
    assert rc.latest_checkpoint(tmp_path) == path  # structure only: the bytes are not read
    with pytest.warns(UserWarning, match=r"skipping .*step_00000001: .*'w' fails its checksum"):
        assert rc.latest_checkpoint(tmp_path, verify=True) is None


def test_truncated_file(tmp_path: Path) -> None:
    path = rc.save_checkpoint(tmp_path / "c", model=tree(1), step=1)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated; '\w' ends at"):
        rc.load_checkpoint(path, like=LIKE)


def test_header_offsets_disagreeing_with_shape(tmp_path: Path) -> None:
    path = rc.save_checkpoint(tmp_path / "c", model=tree(1), step=1)
    file = path / "model.safetensors"
    _, header = header_of(file)
    header["w"]["dtype"] = "F16"  # 4 x 8 halves need 64 bytes, the offsets span 128
    rewrite_header(file, header)
    with pytest.raises(CheckpointError, match=r"'w' is damaged: data_offsets .* span 128 bytes"):
        rc.load_checkpoint(path, like=LIKE)


def test_header_offsets_overlapping(tmp_path: Path) -> None:
    path = rc.save_checkpoint(tmp_path / "c", model=tree(1), step=1)
    file = path / "model.safetensors"
    _, header = header_of(file)
    begin, end = header["w"]["data_offsets"]
    header["w"]["data_offsets"] = [begin - 4, end - 4]
    rewrite_header(file, header)
    with pytest.raises(CheckpointError, match=r"'w' starts at byte .* overlap or leave a gap"):
        rc.load_checkpoint(path, like=LIKE)


def test_float_saved_int_expected_is_an_error_not_a_cast(tmp_path: Path) -> None:
    path = rc.save_checkpoint(tmp_path / "c", model=tree(1), step=1)
    ints = {**LIKE, "w": jnp.zeros((4, 8), jnp.int32)}
    with pytest.raises(CheckpointError, match=r"'w' is stored as float32, `like` has int32"):
        rc.load_checkpoint(path, like=ints)
    halves = {**LIKE, "w": jnp.zeros((4, 8), jnp.bfloat16)}
    with pytest.raises(CheckpointError, match=r"'w' is stored as float32, `like` has bfloat16"):
        rc.load_checkpoint(path, like=halves)
    cast = rc.load_checkpoint(path, like=halves, dtype=jnp.bfloat16)
    assert cast.model["w"].dtype == jnp.bfloat16 and float(cast.model["w"][0, 0]) == 1.0


# ----------------------------------------------------------------------------- leftovers and resume


def test_a_half_deleted_old_copy_is_removed_by_the_next_save(tmp_path: Path) -> None:
    # A kill while the replaced checkpoint was being deleted: the new one is in place,
    # the old one has lost its state.json and some files.
    path = tmp_path / "best"
    rc.save_checkpoint(path, model=tree(1), step=1)
    half = tmp_path / ".best.old-0123abcd"
    shutil.copytree(path, half)
    (half / "state.json").unlink()
    rc.save_checkpoint(path, model=tree(2), step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
    assert_is_step(path, 2)


def test_half_written_temp_folder_is_ignored_then_removed(tmp_path: Path) -> None:
    good = rc.save_checkpoint(step_path(tmp_path, 1), model=tree(1), step=1)
    host = socket.gethostname()
    dead = tmp_path / f".step_00000002.tmp-{host}-{2**22 + 1}-0123abcd"  # above pid_max
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\x10\x00\x00")
    live = tmp_path / f".step_00000003.tmp-{host}-{os.getppid()}-0123abcd"
    live.mkdir()
    assert rc.latest_checkpoint(tmp_path) == good
    rc.save_checkpoint(step_path(tmp_path, 4), model=tree(4), step=4)
    assert not dead.exists(), "a dead process's temporary folder is removed"
    assert live.exists(), "a live process may still be writing its temporary folder"
    assert_is_step(good, 1)


def test_kill_between_renames_state_on_disk(tmp_path: Path) -> None:
    path = rc.save_checkpoint(step_path(tmp_path, 5), model=tree(5), step=5)
    old = tmp_path / ".step_00000005.old-0123abcd"
    path.rename(old)  # what a save replacing step 5 leaves if killed between its renames
    assert_is_step(path, 5)
    assert rc.latest_checkpoint(tmp_path) == old
    rc.save_checkpoint(tmp_path / "best", model=tree(6), step=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step_00000005"]
    assert_is_step(path, 5)


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda p: (p / "state.json").unlink(), r"state\.json: missing"),
        (lambda p: (p / "state.json").write_text("{"), r"state\.json: not valid JSON"),
        (lambda p: (p / "model.safetensors").unlink(), r"model\.safetensors: missing"),
        (
            lambda p: (p / "model.safetensors").write_bytes(
                (p / "model.safetensors").read_bytes()[:100]
            ),
            r"model\.safetensors: truncated",
        ),
    ],
    ids=["no-state", "bad-state", "missing-file", "truncated-file"],
)
def test_damaged_newest_step_falls_back_to_the_previous(
    tmp_path: Path, damage: Any, why: str
) -> None:
    rc.save_checkpoint(step_path(tmp_path, 1), model=tree(1), step=1)
    newest = rc.save_checkpoint(step_path(tmp_path, 2), model=tree(2), step=2)
    damage(newest)
    with pytest.warns(UserWarning, match=rf"skipping .*step_00000002: .*{why}"):
        found = rc.latest_checkpoint(tmp_path)
    assert found == step_path(tmp_path, 1)
    assert_is_step(found, 1)


def test_save_onto_a_user_file_or_folder_moves_nothing(tmp_path: Path) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    with pytest.raises(CheckpointError, match=r"notes\.txt is a file, not a redcoast checkpoint"):
        rc.save_checkpoint(file, model=tree(1), step=1)
    assert file.read_text() == "mine"
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "x.csv").write_text("1,2")
    with pytest.raises(CheckpointError, match=r"data is a folder without a redcoast state\.json"):
        rc.save_checkpoint(folder, model=tree(1), step=1)
    assert (folder / "x.csv").read_text() == "1,2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


# ============================================================================= the loop


def _toy(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    return [{"x": a, "y": int(a[0] > 0)} for a in x]


def _collate(examples):
    return {
        "x": np.stack([e["x"] for e in examples]),
        "y": np.array([e["y"] for e in examples], np.int32),
    }


def _loss(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"] % 2).mean()


def _mlp(seed=0):
    return eqx.nn.MLP(6, 2, 16, 1, key=jax.random.key(seed))


def _arrays(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


FIT = dict(collate_fn=_collate, loss_fn=_loss, per_device_batch_size=1, progress=False)


# ----------------------------------------------------------------------------- the caller's arrays


def test_fit_leaves_the_callers_model_and_opt_state_usable():
    mesh = rc.make_mesh(1)
    model = rc.place(_mlp(), mesh)
    assert rc.place(model, mesh) is model  # already there: nothing moves
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    before = _arrays(model)
    first = rc.fit(model, optimizer, _toy(32), max_steps=3, opt_state=opt_state, **FIT)
    # The arrays given are neither deleted nor changed; a second fit can start from them.
    for a, b in zip(_arrays(model), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(opt_state[0].count) == 0
    second = rc.fit(model, optax.sgd(1e-2), _toy(32), max_steps=3, **FIT)
    assert first.step == second.step == 3
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(_arrays(first.model), _arrays(second.model), strict=True)
    )


# ----------------------------------------------------------------------------- one run per workdir


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_fresh_run_in_a_used_workdir_stops_and_loses_nothing(tmp_path):
    keep = rc.Checkpointing(every=2, keep_last_n=2)
    rc.fit(
        _mlp(), optax.adam(1e-2), _toy(64), max_steps=8, workdir=tmp_path, checkpointing=keep, **FIT
    )
    assert _names(tmp_path / "ckpts") == ["step_00000006", "step_00000008"]
    metrics = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match=r"already holds a run.*resume=True.*overwrite=True"):
        rc.fit(
            _mlp(1),
            optax.adam(1e-2),
            _toy(64),
            max_steps=4,
            workdir=tmp_path,
            checkpointing=keep,
            **FIT,
        )
    assert _names(tmp_path / "ckpts") == ["step_00000006", "step_00000008"]
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    with pytest.raises(ValueError, match="pass one"):
        rc.fit(
            _mlp(),
            optax.adam(1e-2),
            _toy(64),
            max_steps=4,
            workdir=tmp_path,
            resume=True,
            overwrite=True,
            **FIT,
        )
    # Asked to, a new run replaces the old one whole: its pruning sees only its own.
    rc.fit(
        _mlp(1),
        optax.adam(1e-2),
        _toy(64),
        max_steps=4,
        workdir=tmp_path,
        checkpointing=keep,
        overwrite=True,
        **FIT,
    )
    assert _names(tmp_path / "ckpts") == ["step_00000002", "step_00000004"]
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert max(steps) == 4
    # And resuming picks up this run, not the one before.
    resumed = rc.fit(
        _mlp(1), optax.adam(1e-2), _toy(64), max_steps=4, workdir=tmp_path, resume=True, **FIT
    )
    assert resumed.step == 4


# ----------------------------------------------------------------------------- non-finite values


def _poisoned(epoch):
    # Epoch 0 is clean (steps 1-4 at a global batch of 8); every example of epoch 1 is marked.
    return [{"x": e["x"], "y": e["y"] + 2 * epoch} for e in _toy(32)]


def _nan_grad_loss(model, batch, key):
    """A finite loss whose gradient is NaN on marked batches: d sqrt(u)/du at u = 0 is inf,
    times du/dparams = 0."""
    poison = (batch["y"] >= 2).any().astype(jnp.float32)
    s = sum(jnp.sum(p) for p in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    return _loss(model, batch, key) + jnp.sqrt(s - s + 1.0 - poison)


def test_nan_gradients_under_a_finite_loss_raise_naming_the_step_or_are_skipped():
    kwargs = {**FIT, "loss_fn": _nan_grad_loss}
    with pytest.raises(FloatingPointError, match=r"step 5 \(epoch 1\): the gradient norm is nan"):
        rc.fit(_mlp(), optax.adam(1e-2), _poisoned, n_epochs=2, **kwargs)
    # Both runs compile the same step (the skip's select changes XLA's fusions, which may
    # round differently), so the skipped steps must leave the arrays bit for bit.
    skip = {**kwargs, "on_nonfinite": "skip", "log_every": 4}
    clean = rc.fit(_mlp(), optax.adam(1e-2), _poisoned, n_epochs=1, **skip)
    skipped = rc.fit(_mlp(), optax.adam(1e-2), _poisoned, n_epochs=2, **skip)
    assert skipped.history["train"][-1]["skipped"] == 4
    for a, b in zip(_arrays(clean.model), _arrays(skipped.model), strict=True):
        np.testing.assert_array_equal(a, b)
    # The optimizer state is untouched too: adam's count stopped at the clean steps.
    assert int(skipped.opt_state[0].count) == 4


def test_a_nonfinite_update_is_caught_before_it_is_saved(tmp_path):
    # Finite loss and gradients, but the learning rate turns infinite at the 5th update.
    optimizer = optax.sgd(lambda count: jnp.where(count >= 4, jnp.inf, 1e-2))
    with pytest.raises(
        FloatingPointError, match=r"step 5 \(epoch 0\): an updated parameter is not finite"
    ):
        rc.fit(
            _mlp(),
            optimizer,
            _toy(64),
            max_steps=8,
            workdir=tmp_path,
            checkpointing=rc.Checkpointing(every=1),
            **FIT,
        )
    # Every checkpoint written holds finite parameters; step 5 was never saved.
    assert _names(tmp_path / "ckpts") == [f"step_{s:08d}" for s in range(1, 5)]
    latest = rc.load_checkpoint(rc.latest_checkpoint(tmp_path / "ckpts"), like=_mlp())
    assert all(np.isfinite(a).all() for a in _arrays(latest.model))


# ----------------------------------------------------------------------------- stops and hooks


def test_a_signal_stops_fit_which_saves_returns_and_restores_the_handler(tmp_path):
    before = signal.getsignal(signal.SIGINT)

    def interrupt(state):
        if state.step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    result = rc.fit(
        _mlp(),
        optax.adam(1e-2),
        _toy(64),
        max_steps=8,
        workdir=tmp_path,
        hooks=[rc.every(1, interrupt)],
        **FIT,
    )
    assert result.stopped_by == "SIGINT received" and result.step == 3
    assert rc.latest_checkpoint(tmp_path / "ckpts") == tmp_path / "ckpts" / "step_00000003"
    assert signal.getsignal(signal.SIGINT) is before


def test_hooks_run_when_due_and_may_stop_the_run(tmp_path):
    seen = []
    rc.fit(
        _mlp(),
        optax.adam(1e-2),
        _toy(64),
        max_steps=7,
        hooks=[rc.every(3, lambda s: seen.append((s.step, s.epoch, s.position, s.last)))],
        **FIT,
    )
    assert seen == [(3, 0, 3, False), (6, 0, 6, False), (7, 0, 7, True)]
    # A hook of any schedule: here after each epoch's last step (8 steps an epoch).
    ends = []
    rc.fit(
        _mlp(),
        optax.adam(1e-2),
        _toy(64),
        n_epochs=2,
        hooks=[rc.Hook(lambda s: ends.append(s.step), when=lambda s: s.epoch_end)],
        **FIT,
    )
    assert ends == [8, 16]
    assert rc.global_batch_size(rc.make_mesh(2), 3, 2) == 3 * 4 * 2

    def early_stop(state):
        if float(state.metrics["loss"]) < 10.0:
            return dataclasses.replace(state, stop="loss below 10")
        return None

    result = rc.fit(
        _mlp(),
        optax.adam(1e-2),
        _toy(64),
        max_steps=7,
        workdir=tmp_path,
        hooks=[rc.every(2, early_stop, at_last=False)],
        **FIT,
    )
    assert result.stopped_by == "loss below 10" and result.step == 2
    assert rc.latest_checkpoint(tmp_path / "ckpts") == tmp_path / "ckpts" / "step_00000002"
    with pytest.raises(ValueError, match="every: n must be a positive int"):
        rc.every(0, print)
