"""Faults and misuse: each case asserts that nothing valid is lost and the error names the cause."""

import dataclasses
import json
import os
import signal
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redcoast as rc


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
    clean = rc.fit(_mlp(), optax.adam(1e-2), _poisoned, n_epochs=1, **kwargs)
    skipped = rc.fit(
        _mlp(), optax.adam(1e-2), _poisoned, n_epochs=2, on_nonfinite="skip", log_every=4, **kwargs
    )
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
