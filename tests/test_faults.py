"""Faults and misuse: each case asserts that nothing valid is lost and the error names the cause.

Checkpoints: a save or a checkpoint is damaged (kill -9 at several points of a real
save in a subprocess, disk full, no permission, flipped bytes, truncation, bad
headers and dtypes) and the last good checkpoint still loads. The loop: the
caller's arrays stay valid, a workdir holds one run and one live process, non-finite
gradients and updates never reach a checkpoint, signals and hooks stop a run
cleanly, a torn log line or other data never spoil a resume. Models, configs and
`redcoast plan`: wrong values, files and ids are errors naming the field, file or
argument, never silent wrong results.
"""

import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import stat
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
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

import redcoast as rc
import redcoast.checkpoint._format as ckpt_format
from redcoast._files import written_whole
from redcoast.checkpoint._io import CheckpointError
from redcoast.checkpoint._io import step_checkpoint_path as step_path
from redcoast.cli import main as cli_main
from redcoast.plan import planner
from redcoast.plan.planner import parse_bytes
from redcoast.train._resume import _restore_history
from redcoast.train.data import order_fingerprint


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

    monkeypatch.setattr(ckpt_format, "open", full_disk, raising=False)
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

    monkeypatch.setattr(ckpt_format, "open", refuse, raising=False)
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


def _train(workdir: Path | None, steps: int, *, n: int = 64, init: int = 0, **kw: Any) -> Any:
    """`fit` of the toy MLP (initialised from seed `init`) on `n` examples for `steps` steps;
    `kw` overrides FIT's options."""
    optimizer = kw.pop("optimizer", optax.adam(1e-2))
    options = {**FIT, "max_steps": steps, "workdir": workdir, **kw}
    return rc.fit(_mlp(init), optimizer, _toy(n), **options)


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


def _deleted(tree: Any) -> list[bool]:
    return [x.is_deleted() for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_a_handed_over_model_survives_a_first_step_that_fails():
    """donate=True and a loss_fn that raises at step 1: the caller's arrays are intact."""

    def broken(model, batch, key):
        raise ValueError("the user's loss is broken")

    model, before = _mlp(), _arrays(_mlp())
    for mesh in (rc.make_mesh(1), rc.make_mesh(2)):  # one shard: placed as a copy
        with pytest.raises(ValueError, match="the user's loss is broken"):
            rc.fit(model, optax.adam(1e-2), _toy(32), max_steps=3, mesh=mesh, donate=True,
                   **{**FIT, "loss_fn": broken})  # fmt: skip
        assert not any(_deleted(model))
        for a, b in zip(_arrays(model), before, strict=True):
            np.testing.assert_array_equal(a, b)


def test_an_error_after_the_hand_over_carries_the_runs_last_state(tmp_path):
    """A collate_fn failing at step 4 of a donate=True run: the state of step 3 is in it."""
    calls = {"n": 0}

    def collate(examples):
        calls["n"] += 1
        if calls["n"] == 4:  # the first batch is collated once, for step 1
            raise OSError("the data server went away")
        return _collate(examples)

    model = _mlp()
    reference = rc.fit(_mlp(), optax.adam(1e-2), _toy(32), max_steps=3, **FIT)
    with pytest.raises(OSError, match="the data server went away") as err:
        rc.fit(model, optax.adam(1e-2), _toy(32), max_steps=6, donate=True,
               **{**FIT, "collate_fn": collate})  # fmt: skip
    assert all(_deleted(model))  # handed over, as asked
    state = err.value.loop_state  # type: ignore[attr-defined]
    assert state.step == 3 and not any(_deleted((state.model, state.opt_state)))
    for a, b in zip(_arrays(state.model), _arrays(reference.model), strict=True):
        np.testing.assert_array_equal(a, b)
    assert "loop_state.model" in err.value.__notes__[0]
    assert "after step 3" in err.value.__notes__[0]


def test_fit_refused_for_its_options_touches_no_disk(tmp_path):
    workdir = tmp_path / "run"
    for bad, message in (
        ({"max_steps": 0}, "max_steps must be a positive int"),
        ({"log_every": 0}, "log_every must be a positive int"),
        ({"resume": True, "overwrite": True}, "pass one"),
        ({"per_device_batch_size": 0}, "per_device_batch_size must be a positive int"),
    ):
        with pytest.raises(ValueError, match=message):
            _train(workdir, 2, **bad)
        assert not workdir.exists(), bad


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


# ============================================================================= one run per workdir


def _held_message(pid: int) -> str:
    return rf"is in use by another live run: process {pid} on host {socket.gethostname()}"


def test_a_workdir_held_by_a_live_fit_turns_a_second_fit_away(tmp_path):
    refused: list[str] = []

    def second_run(state):
        # Another fit on the same workdir while this one trains, fresh and resuming.
        for resume in (False, True):
            with pytest.raises(rc.WorkdirInUseError, match=_held_message(os.getpid())) as err:
                _train(tmp_path, 2, init=1, resume=resume)
            refused.append(str(err.value))

    at_3 = rc.Hook(second_run, when=lambda s: s.step == 3)
    first = _train(tmp_path, 6, checkpointing=rc.Checkpointing(every=2), hooks=[at_3])
    assert len(refused) == 2 and "(this very process)" in refused[0]
    # The first run lost nothing: its checkpoints and log are its own.
    assert first.step == 6
    assert _names(tmp_path / "ckpts") == ["step_00000002", "step_00000004", "step_00000006"]
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == sorted(set(steps)) and max(steps) == 6
    # The lock went with the run; its file is nobody's run files, nor a stale one a lock.
    assert (tmp_path / ".redcoast.lock").is_file()
    assert _train(tmp_path, 6, resume=True).step == 6
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / ".redcoast.lock").write_text('{"pid": 1, "host": "elsewhere"}')
    assert _train(fresh, 1).step == 1


def test_fit_that_raises_releases_its_workdir(tmp_path):
    _train(tmp_path, 2)
    with pytest.raises(ValueError, match=r"seed=0 .* this run has seed=1"):
        _train(tmp_path, 4, resume=True, seed=1)
    assert _train(tmp_path, 4, resume=True).step == 4


HOLDER = textwrap.dedent(
    """
    import sys, time
    from redcoast.train.workdir import hold_workdir
    with hold_workdir(sys.argv[1]):
        print("held", flush=True)
        time.sleep(600)
    """
)


def test_a_killed_holder_leaves_its_workdir_free_at_once(tmp_path):
    _train(tmp_path, 2)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        for resume in (False, True):
            with pytest.raises(rc.WorkdirInUseError, match=_held_message(holder.pid)) as err:
                _train(tmp_path, 4, resume=resume)
            assert f"-c {tmp_path}" in str(err.value)  # the holder's command line
    finally:
        holder.kill()
        holder.communicate(timeout=60)
    assert holder.returncode == -signal.SIGKILL
    # No stale lock: the kernel released it with the process.
    assert _train(tmp_path, 4, resume=True).step == 4


def test_a_filesystem_without_locks_is_named_and_the_run_goes_on(tmp_path, monkeypatch):
    def refuse(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr("redcoast.train.workdir.fcntl.flock", refuse)
    with pytest.warns(UserWarning, match=r"does not support file locks .*cannot stop a second"):
        result = _train(tmp_path, 2)
    assert result.step == 2 and rc.latest_checkpoint(tmp_path / "ckpts") is not None


def test_removing_the_lock_file_lets_no_second_run_in(tmp_path):
    """The lock is on the workdir folder: deleting `.redcoast.lock` mid-run changes nothing."""
    refused: list[str] = []

    def meddle(state):
        (tmp_path / ".redcoast.lock").unlink()
        for resume in (False, True):
            with pytest.raises(rc.WorkdirInUseError, match="is in use by another live run"):
                _train(tmp_path, 10, resume=resume)
            refused.append("refused")

    first = _train(
        tmp_path,
        10,
        checkpointing=rc.Checkpointing(every=2),
        log_every=1,
        hooks=[rc.Hook(meddle, when=lambda s: s.step == 6)],
    )
    assert refused == ["refused", "refused"] and first.step == 10
    assert _names(tmp_path / "ckpts") == [f"step_{i:08d}" for i in (2, 4, 6, 8, 10)]
    assert _train_steps(tmp_path) == list(range(1, 11))  # each step logged once


def test_a_workdir_replaced_under_a_live_run_stops_it_with_its_state(tmp_path):
    workdir = tmp_path / "run"

    def replace(state):
        os.rename(workdir, tmp_path / "moved")
        workdir.mkdir()

    with pytest.raises(
        rc.WorkdirInUseError, match=r"no longer this run's: .* (is gone|was replaced)"
    ) as err:
        _train(
            workdir,
            10,
            checkpointing=rc.Checkpointing(every=2),
            hooks=[rc.Hook(replace, when=lambda s: s.step == 3)],
        )
    assert err.value.loop_state.step == 4  # type: ignore[attr-defined]
    assert not (workdir / "ckpts").exists()  # nothing written into the new folder
    assert _names(tmp_path / "moved" / "ckpts") == ["step_00000002"]


def test_where_folders_cannot_be_locked_the_lock_file_is_held(tmp_path, monkeypatch):
    """NFS emulates flock with byte-range locks, which a folder (opened read-only) refuses."""
    real = fcntl.flock

    def files_only(fd: int, operation: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        real(fd, operation)

    monkeypatch.setattr("redcoast.train.workdir.fcntl.flock", files_only)
    refused = []

    def second_run(state):
        with pytest.raises(rc.WorkdirInUseError, match=_held_message(os.getpid())):
            _train(tmp_path, 2, resume=True)
        refused.append(True)

    assert _train(tmp_path, 4, hooks=[rc.Hook(second_run, lambda s: s.step == 2)]).step == 4
    assert refused == [True]


WORKER = Path(__file__).parent / "scripts" / "train_resume.py"


def _start(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _pid(out: str) -> int:
    return int(out.splitlines()[0].removeprefix("pid "))


def _train_steps(workdir: Path) -> list[int]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def _checkpoints_load(workdir: Path) -> list[int]:
    """The steps of the workdir's checkpoints, each loaded with its checksums verified."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        from train_resume import DropoutMLP
    finally:
        sys.path.remove(str(WORKER.parent))
    like = DropoutMLP(jax.random.key(1))
    return [rc.load_checkpoint(p, like=like).step for p in sorted(workdir.glob("ckpts/step_*"))]


@pytest.mark.slow
def test_two_runs_started_together_on_one_workdir(tmp_path):
    workdir, ready = tmp_path / "run", tmp_path / "ready"
    ready.mkdir()
    runs = [_start(workdir, tmp_path / f"out{i}.npz", "--together", ready, 2) for i in (0, 1)]
    done = [p.communicate(timeout=300) for p in runs]
    assert sorted(p.returncode for p in runs) == [0, 1], done
    won = next(i for i, p in enumerate(runs) if p.returncode == 0)
    out, err = done[1 - won]
    assert re.search(r"WorkdirInUseError: .*" + _held_message(_pid(done[won][0])), err), err
    assert _pid(out) == runs[1 - won].pid
    # The winner's run is whole: ten steps logged once each, its checkpoints verified.
    assert _train_steps(workdir) == list(range(1, 11))
    assert _checkpoints_load(workdir) == [8, 10]
    assert int(np.load(tmp_path / f"out{won}.npz")["step"]) == 10
    assert not (tmp_path / f"out{1 - won}.npz").exists()


@pytest.mark.slow
def test_resuming_a_workdir_whose_run_still_trains_waits_for_its_end(tmp_path):
    workdir = tmp_path / "run"
    holder = _start(workdir, tmp_path / "unused.npz", "--pause-at", 5)
    try:
        paused = Path(f"{workdir}.paused")
        for _ in range(3000):
            if paused.exists() or holder.poll() is not None:
                break
            time.sleep(0.1)
        assert paused.exists(), holder.communicate(timeout=10)
        second = _start(workdir, tmp_path / "second.npz", "--resume")
        out, err = second.communicate(timeout=300)
        assert second.returncode == 1 and re.search(_held_message(holder.pid), err), err
        assert "resuming from" not in out
    finally:
        holder.kill()
        holder.communicate(timeout=60)
    # Killed, the holder frees the workdir at once; the resumed run continues its step 4.
    third = _start(workdir, tmp_path / "final.npz", "--resume")
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0, err
    assert f"resuming from {workdir / 'ckpts' / 'step_00000004'}" in out
    assert _train_steps(workdir) == list(range(1, 11))
    assert _checkpoints_load(workdir) == [8, 10]


# ============================================================================= simulated devices

LAGGING = Path(__file__).parent / "scripts" / "lagging_device.py"


def _lagging(lag: float, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # nothing but the script's
    command = [sys.executable, str(LAGGING), str(lag), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_simulated_devices_are_patient_at_collectives():
    """rc.simulate_devices raises XLA:CPU's collective timeout, with a flag this JAX knows
    (an unknown XLA flag would end the process at start)."""
    done = _lagging(1, "--simulate")
    assert done.returncode == 0 and "sum 28.0" in done.stdout, done.stderr[-3000:]
    assert rc.simulate_devices.__module__ == "redcoast.distributed._simulated"
    assert "xla_cpu_collective_call_terminate_timeout_seconds=600" in os.environ["XLA_FLAGS"]


@pytest.mark.slow
@pytest.mark.parametrize("simulate", [True, False])
def test_a_device_starved_for_a_minute_aborts_only_without_simulate_devices(simulate):
    """One device thread 65 s late at a collective (a loaded machine): XLA's default ends
    the process (20 s to its warning, 40 s more); with rc.simulate_devices it waits."""
    done = _lagging(65, *(["--simulate"] if simulate else []))
    if simulate:
        assert done.returncode == 0 and "sum 28.0" in done.stdout, done.stderr[-3000:]
    else:
        assert done.returncode == -signal.SIGABRT, done.stdout
        assert "Termination timeout" in done.stderr


# ============================================================================= the log, resumed


def test_a_torn_last_line_of_metrics_jsonl_is_skipped_on_resume(tmp_path):
    _train(tmp_path, 4, log_every=1, checkpointing=rc.Checkpointing(every=2))
    log = tmp_path / "metrics.jsonl"
    whole = log.read_text()
    log.write_text(whole + '{"step": 5, "epoch": 0, "loss": 0.6')  # power lost mid-write
    with pytest.warns(UserWarning, match=r"metrics\.jsonl: line 5 is not complete JSON"):
        result = _train(tmp_path, 6, log_every=1, resume=True)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert log.read_text().startswith(whole)
    assert [r["step"] for r in result.history["train"]] == [1, 2, 3, 4, 5, 6]


def test_a_damaged_line_inside_metrics_jsonl_is_named(tmp_path):
    _train(tmp_path, 4, log_every=1)
    log = tmp_path / "metrics.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join([lines[0], "garbage\n", *lines[1:]]))
    with pytest.raises(ValueError, match=rf"{re.escape(str(log))}: line 2 of \d+ is not a JSON"):
        _train(tmp_path, 6, resume=True)


def test_jsonl_lines_go_out_whole_in_one_write(tmp_path, monkeypatch):
    from redcoast.train import logging as rc_logging

    writes: list[bytes] = []
    real = os.write

    def spy(fd: int, data: bytes) -> int:
        writes.append(bytes(data))
        return real(fd, data)

    log = rc.jsonl_logger(tmp_path / "m.jsonl")
    monkeypatch.setattr(rc_logging.os, "write", spy)
    log({f"metric_{i}": float(i) for i in range(5000)}, 7)  # a line of ~90 kB
    assert len(writes) == 1 and writes[0].endswith(b"\n")
    assert json.loads(writes[0])["step"] == 7
    monkeypatch.setattr(rc_logging.os, "write", lambda fd, data: real(fd, data[:10]))
    with pytest.raises(OSError, match=r"wrote 10 of \d+ bytes.*m\.jsonl"):
        log({"loss": 1.0}, 8)


def test_rewriting_metrics_jsonl_on_resume_leaves_no_temporary_file(tmp_path, monkeypatch):
    log = tmp_path / "metrics.jsonl"
    torn = '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n{"step": 3'
    log.write_text(torn)
    (tmp_path / "metrics.jsonl.tmp").write_text("a user's file")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with (
        pytest.warns(UserWarning, match="line 3 is not complete JSON"),
        pytest.raises(OSError, match=rf"No space left on device: '{re.escape(str(log))}'"),
    ):
        _restore_history(str(log), 2, lead=True)
    monkeypatch.undo()
    assert log.read_text() == torn
    with pytest.warns(UserWarning, match="line 3 is not complete JSON"):
        assert len(_restore_history(str(log), 1, lead=True)["train"]) == 1
    assert log.read_text() == '{"step": 1, "loss": 1.0}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "metrics.jsonl.tmp"]
    assert (tmp_path / "metrics.jsonl.tmp").read_text() == "a user's file"


def test_a_file_written_whole_leaves_nothing_behind_on_any_error(tmp_path):
    path = tmp_path / "out.json"
    with written_whole(path, "w") as f:
        f.write("first")
    with pytest.raises(RuntimeError, match="stopped"), written_whole(path, "w") as f:
        f.write("half")
        raise RuntimeError("stopped")
    full = rf"No space left on device: '{re.escape(str(path))}'"
    with pytest.raises(OSError, match=full), written_whole(path, "w"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert path.read_text() == "first"
    # A user's folder where the file would go: the rename fails, the folder stays as it was.
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "mine.txt").write_text("mine")
    with pytest.raises(IsADirectoryError), written_whole(folder, "w") as f:
        f.write("new")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["mine.txt", "out.json", "results"]


def test_aux_metrics_named_like_the_loops_own_are_refused_with_the_list():
    for name in ("step", "epoch", "examples_per_s"):

        def loss_fn(model, batch, key, name=name):
            return _loss(model, batch, key), {name: jnp.float32(1.0)}

        with pytest.raises(ValueError, match=rf"reserved name '{name}'.*Reserved: loss, grad_norm"):
            _train(None, 1, loss_fn=loss_fn)


# ============================================================================= the data, resumed


def test_resuming_on_other_data_is_refused_naming_the_lengths(tmp_path):
    _train(tmp_path, 3, checkpointing=rc.Checkpointing(every=3))
    state_file = tmp_path / "ckpts" / "step_00000003" / "state.json"
    loop = json.loads(state_file.read_text())["loop"]
    assert loop["n_examples"] == 64
    assert loop["order"] == order_fingerprint(64, seed=0, epoch=0)
    before = (tmp_path / "metrics.jsonl").read_text()
    # 40 examples make 5 batches: the saved position would skip to the next epoch.
    with pytest.raises(ValueError, match=r"epoch 0 had 64 training examples .* has 40"):
        _train(tmp_path, 6, n=40, resume=True)
    state = json.loads(state_file.read_text())
    state["loop"]["order"] = "0123456789abcdef"  # what another NumPy's shuffle would give
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"order of its 64 examples .* is not the saved one"):
        _train(tmp_path, 6, resume=True)
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert _names(tmp_path / "ckpts") == ["step_00000003"]


def test_resuming_with_another_optimizer_names_the_optimizer(tmp_path):
    _train(tmp_path, 2)
    with pytest.raises(
        CheckpointError, match=r"optimizer arrays do not match `opt_state_like`"
    ) as e:
        _train(tmp_path, 4, resume=True, optimizer=optax.lion(1e-3))
    assert "another optimizer" in str(e.value) and "architecture" not in str(e.value)


def test_a_fractional_step_is_refused_not_rounded(tmp_path):
    # The test-time type checker answers first; redcoast's own check is underneath it.
    with pytest.raises(TypeError, match=r"(?s)'step'.*2\.5"):
        rc.save_checkpoint(tmp_path / "c", model=tree(1), step=2.5)  # type: ignore[arg-type]
    unchecked = getattr(rc.save_checkpoint, "__wrapped__", rc.save_checkpoint)
    with pytest.raises(TypeError, match=r"step must be an int.*got 2\.5 \(float\)"):
        unchecked(tmp_path / "c", model=tree(1), step=2.5)
    with pytest.raises(ValueError, match=r"step must be >= 0, got -1"):
        rc.save_checkpoint(tmp_path / "c", model=tree(1), step=-1)
    assert not list(tmp_path.iterdir())


# ============================================================================= batches and metrics


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        (np.array(["a", "b"]), "<U1"),
        (np.array(["2024-01-01", "2024-01-02"], "M8[D]"), "datetime64"),
    ],
    ids=["strings", "datetimes"],
)
def test_a_batch_of_strings_or_datetimes_names_the_key(values, dtype):
    def collate(examples):
        return {**_collate(examples), "when": np.resize(values, len(examples))}

    with pytest.raises(ValueError, match=rf"returned arrays JAX cannot hold: \{{'when': '{dtype}"):
        _train(None, 1, collate_fn=collate)


def test_metric_fn_returning_text_names_the_metric():
    evaluation = rc.Evaluation(
        _toy(8),
        pred_fn=lambda m, b, k: jax.vmap(m)(b["x"]).argmax(-1),
        metric_fn=lambda examples, outputs: {"acc": 0.5, "verdict": "good"},
    )
    with pytest.raises(TypeError, match=r"metric_fn must return numbers; 'verdict' is 'good'"):
        _train(None, 1, evaluation=evaluation)


# ============================================================================= models and configs

GPT2_CONFIG = rc.models.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 saved as transformers saves it."""
    folder = tmp_path_factory.mktemp("gpt2")
    rc.models.GPT2(GPT2_CONFIG, key=jax.random.key(0)).to_hf(folder)
    return folder


def _copy_with_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    values = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**values, **changes}))
    return dst


BAD_CONFIGS = [
    ({"n_layer": "2"}, TypeError, r"GPT2Config: n_layer must be an int, got '2' \(str\)"),
    ({"n_head": 4.0}, TypeError, r"GPT2Config: n_head must be an int, got 4\.0"),
    ({"n_head": 0}, ValueError, r"GPT2Config: n_head must be at least 1, got 0"),
    ({"n_layer": 0}, ValueError, r"GPT2Config: n_layer must be at least 1, got 0"),
    ({"n_head": 3}, ValueError, r"n_embd=32 is not a multiple of n_head=3 .*1, 2, 4, 8, 16, 32"),
    ({"layer_norm_epsilon": "1e-5"}, TypeError, r"layer_norm_epsilon must be a number"),
    ({"tie_word_embeddings": 1}, TypeError, r"tie_word_embeddings must be true or false"),
]


def _as_users_run_it(cls: type, **values: Any) -> Any:
    """`cls(**values)` without the test-time type checker (jaxtyping + beartype) that wraps
    `__init__` here, so redcoast's own checks answer, as in a user's program."""
    config = object.__new__(cls)
    getattr(cls.__init__, "__wrapped__", cls.__init__)(config, **values)
    return config


@pytest.mark.parametrize(("change", "kind", "message"), BAD_CONFIGS)
def test_config_values_of_the_wrong_type_or_zero_name_the_field(
    gpt2_folder: Path, tmp_path: Path, change: dict[str, Any], kind: type, message: str
) -> None:
    ((field, value),) = change.items()
    folder = _copy_with_config(gpt2_folder, tmp_path / "m", **change)
    # Here the test-time type checker may answer first, naming the field as well.
    either = message if kind is ValueError else rf"(?s){field}.*{re.escape(repr(value))}"
    with pytest.raises(kind, match=either):
        rc.models.from_hf(folder)
    with pytest.raises(kind, match=message):
        _as_users_run_it(rc.models.GPT2Config, **{**dataclasses.asdict(GPT2_CONFIG), **change})
    # redcoast plan reads the same config.json, and says so before compiling.
    result = CliRunner().invoke(cli_main, ["plan", str(folder / "config.json")])
    assert result.exit_code != 0 and re.search(either, result.output), result.output
    assert "Traceback" not in result.output


def test_heads_that_do_not_divide_are_refused_in_every_architecture() -> None:
    with pytest.raises(ValueError, match=r"OPTConfig: hidden_size=32 is not a multiple of"):
        rc.models.OPTConfig(hidden_size=32, num_attention_heads=3)
    with pytest.raises(ValueError, match=r"BARTConfig: d_model=32 .* decoder_attention_heads=5"):
        rc.models.BARTConfig(d_model=32, encoder_attention_heads=4, decoder_attention_heads=5)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 .* num_key_value_heads=3"):
        rc.models.LlamaConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"T5Config: num_layers must be at least 1"):
        rc.models.T5Config(num_layers=0)
    # T5's heads have d_kv features each: any count is fine.
    assert rc.models.T5Config(d_model=32, num_heads=3).num_heads == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"model_type": "gpt2",\n  "n_layer": 2,,}', r"config\.json is not valid JSON: .* line 2"),
        ('[{"model_type": "gpt2"}]', r"config\.json holds a JSON list, not the object"),
    ],
    ids=["malformed", "list"],
)
def test_a_malformed_config_json_names_the_file(
    gpt2_folder: Path, tmp_path: Path, text: str, message: str
) -> None:
    folder = tmp_path / "m"
    shutil.copytree(gpt2_folder, folder)
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(folder)) + ".*" + message):
        rc.models.from_hf(folder)
    result = CliRunner().invoke(cli_main, ["plan", str(folder / "config.json")])
    assert (
        result.exit_code != 0
        and re.search(message, result.output)
        and "Traceback" not in result.output
    )


def test_a_truncated_safetensors_file_names_the_file(gpt2_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(gpt2_folder, folder)
    file = folder / "model.safetensors"
    for keep in (file.stat().st_size - 100, 5):  # the data cut, the header cut
        file.write_bytes((gpt2_folder / "model.safetensors").read_bytes()[:keep])
        with pytest.raises(
            ValueError, match=rf"{re.escape(str(file))} is not a complete safetensors"
        ):
            rc.models.from_hf(folder)


def test_an_integer_tensor_for_a_float_weight_names_the_tensor(
    gpt2_folder: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "m"
    shutil.copytree(gpt2_folder, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["transformer.h.1.ln_2.weight"] = tensors["transformer.h.1.ln_2.weight"].astype(np.int32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"'transformer\.h\.1\.ln_2\.weight' .* is int32, but GPT2's"
    ):
        rc.models.from_hf(folder)


def test_generate_refuses_ids_that_would_wrap_and_empty_prompts() -> None:
    model = rc.models.GPT2(GPT2_CONFIG, key=jax.random.key(0))
    wrapped = np.array([[2**32 + 5, 1]])  # int64; JAX would make it 5, a valid id
    with pytest.raises(ValueError, match=r"prompt_ids \(int64\) has values in \[1, 4294967301\]"):
        rc.models.generate(model, wrapped, max_new_tokens=2)
    ok = rc.models.generate(model, np.array([[5, 1]]), max_new_tokens=2)  # int64 in range
    assert ok.shape == (1, 2)
    with pytest.raises(ValueError, match=r"prompt_lengths \(int64\) has values"):
        rc.models.generate(
            model, np.array([[5, 1]]), max_new_tokens=2, prompt_lengths=np.array([2**32 + 1])
        )
    with pytest.raises(ValueError, match=r"prompt_ids has shape \(2, 0\): prompts of no tokens"):
        rc.models.generate(model, np.zeros((2, 0), np.int32), max_new_tokens=2)
    t5 = rc.models.T5(
        rc.models.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4),
        key=jax.random.key(0),
    )
    with pytest.raises(ValueError, match=r"input_ids \(int64\) has values in \[1, 4294967301\]"):
        rc.models.generate_seq2seq(t5, wrapped, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"attention_mask \(int64\) has values"):
        rc.models.generate_seq2seq(t5, np.array([[5, 1]]), attention_mask=wrapped, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids has shape \(2, 0\): sources of no tokens"):
        rc.models.generate_seq2seq(t5, np.zeros((2, 0), np.int32), max_new_tokens=2)


# ============================================================================= redcoast plan


def test_plan_refuses_a_bare_number_of_bytes_and_an_unwritable_json_before_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"device memory '40' has no unit; write 40GB, 40GiB"):
        rc.memory_plan("gpt2", devices=8, device_memory="40")
    assert parse_bytes("40GB") == 40 * 10**9 and parse_bytes("40B") == 40
    assert parse_bytes(40) == 40  # an int is bytes already, in Python

    def compile_nothing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("planned (compiled) before checking the options")

    monkeypatch.setattr(planner, "memory_plan", compile_nothing)
    for target, message in [
        (tmp_path, r"is a folder; name a file in it"),
        (tmp_path / "missing" / "plan.json", r"folder .*missing does not exist"),
    ]:
        result = CliRunner().invoke(cli_main, ["plan", "gpt2", "--json", str(target)])
        assert result.exit_code == 2 and re.search(message, " ".join(result.output.split()))
        assert "--json" in result.output
    assert not (tmp_path / "missing").exists()
