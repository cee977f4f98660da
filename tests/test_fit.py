"""fit / predict end to end: digits accuracy, schedules, order, layouts, bad input, logging."""

import json
import sys
import time
import types

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits
from tiny import TinyGPT

import redcoast as rc
from redcoast.train.data import epoch_order


def collate_fn(examples):
    return {
        "x": np.stack([e["x"] for e in examples]),
        "y": np.array([e["y"] for e in examples], np.int32),
    }


def loss_fn(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def pred_fn(model, batch, key):
    return jax.vmap(model)(batch["x"]).argmax(-1)


def accuracy(examples, preds):
    return {"accuracy": float(np.mean([e["y"] == p for e, p in zip(examples, preds, strict=True)]))}


def _toy(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    return [{"x": a, "y": int(a[0] > 0)} for a in x]


def _mlp(seed=0):
    return eqx.nn.MLP(6, 2, 16, 1, key=jax.random.key(seed))


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_digits_mlp_reaches_95_percent_through_fit_and_predict(tmp_path):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    examples = [{"x": x[i], "y": int(digits.target[i])} for i in order]
    train, test = examples[:1400], examples[1400:]
    start = time.perf_counter()
    result = rc.fit(
        eqx.nn.MLP(64, 10, 128, 2, key=jax.random.key(0)),
        optax.adam(3e-3),
        train,
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        mesh=rc.make_mesh(1),
        per_device_batch_size=4,
        n_epochs=8,
        evaluation=rc.Evaluation(
            test, pred_fn=pred_fn, output_fn=int, metric_fn=accuracy, save_best=("accuracy", "max")
        ),
        workdir=tmp_path,
    )
    preds = rc.predict(
        result.model,
        test,
        collate_fn=collate_fn,
        pred_fn=pred_fn,
        output_fn=int,
        per_device_batch_size=16,
    )
    elapsed = time.perf_counter() - start
    acc = np.mean([e["y"] == p for e, p in zip(test, preds, strict=True)])
    print(f"digits: test accuracy {acc:.4f} in {elapsed:.1f}s")
    assert acc >= 0.95
    assert result.step == 8 * (1400 // 32)
    # One evaluation per epoch, its outputs the same predictions predict() makes.
    assert len(result.history["eval"]) == 8
    last = json.loads((tmp_path / "eval" / f"step_{result.step:08d}.json").read_text())
    assert last["outputs"] == preds
    assert last["metrics"]["accuracy"] == pytest.approx(acc)
    # The best evaluation is the highest eval accuracy, and its checkpoint holds it.
    evals = result.history["eval"]
    top = max(evals, key=lambda r: r["eval_accuracy"])
    assert result.history["best"] == {
        "metric": "accuracy",
        "mode": "max",
        "value": top["eval_accuracy"],
        "step": min(r["step"] for r in evals if r["eval_accuracy"] == top["eval_accuracy"]),
    }
    best = rc.load_checkpoint(tmp_path / "ckpts" / "best", like=result.model)
    assert best.step == result.history["best"]["step"]
    best_preds = rc.predict(
        best.model,
        test,
        collate_fn=collate_fn,
        pred_fn=pred_fn,
        output_fn=int,
        per_device_batch_size=16,
    )
    assert accuracy(test, best_preds)["accuracy"] == pytest.approx(top["eval_accuracy"])
    # save_last: the final state is a checkpoint too, and resuming from it is a no-op.
    assert rc.latest_checkpoint(tmp_path / "ckpts").name == f"step_{result.step:08d}"
    lines = _read_jsonl(tmp_path / "metrics.jsonl")
    train_lines = [r for r in lines if "loss" in r]
    assert {"step", "epoch", "loss", "grad_norm", "accuracy", "examples_per_s"} <= set(
        train_lines[0]
    )
    assert [r["step"] for r in train_lines][:3] == [10, 20, 30]
    assert sum("eval_accuracy" in r for r in lines) == 8
    assert set(result.history["timing"]) == {"data_s", "step_call_s", "other_s"}


def test_lr_in_metrics_jsonl_follows_the_schedule_at_optimizer_steps(tmp_path):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.1, 3, 12)
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    seen = []
    result = rc.fit(
        _mlp(),
        opt,
        _toy(64),
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        per_device_batch_size=1,
        accumulate_grad_batches=2,
        max_steps=9,
        log_every=1,
        workdir=tmp_path,
        loggers=[lambda metrics, step: seen.append(step)],
        progress=False,
    )
    lines = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines] == list(range(1, 10)) == seen
    # Step s (1-based) is the s-th update, which optax computed with schedule(s - 1).
    np.testing.assert_allclose(
        [r["lr"] for r in lines], [schedule(s - 1) for s in range(1, 10)], rtol=1e-6
    )
    assert int(result.opt_state.count) == 9
    assert lines[-1]["examples_per_s"] == pytest.approx(lines[-1]["steps_per_s"] * 16)


def test_predict_keeps_input_order_when_the_size_does_not_divide_the_batch():
    examples = [{"x": np.full(6, i, np.float32), "y": i} for i in range(37)]

    def echo(model, batch, key):
        return {"id": batch["y"], "first": batch["x"][:, 0]}

    outs = rc.predict(
        _mlp(), examples, collate_fn=collate_fn, pred_fn=echo, per_device_batch_size=2
    )
    assert len(outs) == 37
    assert [int(o["id"]) for o in outs] == list(range(37))
    assert [float(o["first"]) for o in outs] == list(range(37))
    ids = rc.predict(
        _mlp(),
        examples,
        collate_fn=collate_fn,
        pred_fn=echo,
        output_fn=lambda o: int(o["id"]),
        mesh=rc.make_mesh(2),
        per_device_batch_size=3,
    )
    assert ids == list(range(37))


@pytest.mark.slow
def test_dropout_losses_agree_on_one_device_8x1_and_2x4():
    data = [np.random.default_rng(i).integers(0, 64, 16).astype(np.int32) for i in range(48)]

    def lm_collate(examples):
        return {"ids": np.stack(examples)}

    def lm_loss(model, batch, key):
        keys = jax.random.split(key, batch["ids"].shape[0])
        logits = jax.vmap(lambda ids, k: model(ids, key=k))(batch["ids"], keys)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1], batch["ids"][:, 1:]
        ).mean()

    meshes = {
        "1": rc.make_mesh(1, devices=jax.devices()[:1]),
        "8x1": rc.make_mesh(1),
        "2x4": rc.make_mesh(4),
    }
    losses = {}
    for name, mesh in meshes.items():
        model = TinyGPT(
            vocab=64, hidden=32, layers=1, heads=4, max_len=16, dropout=0.2, key=jax.random.key(0)
        )
        result = rc.fit(
            model,
            optax.adam(3e-3),
            data,
            collate_fn=lm_collate,
            loss_fn=lm_loss,
            mesh=mesh,
            per_device_batch_size=8 // rc.parallel.mesh.mesh_shape(mesh)[0],
            max_steps=5,
            log_every=1,
            progress=False,
        )
        losses[name] = [r["loss"] for r in result.history["train"]]
        if name == "2x4":
            # fit split the unsharded model itself by tracing loss_fn.
            specs = [
                x.sharding.spec for x in jax.tree.leaves(eqx.filter(result.model, eqx.is_array))
            ]
            assert any("model" in tuple(s) for s in specs)
    assert len(losses["1"]) == 5
    np.testing.assert_allclose(losses["8x1"], losses["1"], rtol=1e-5)
    np.testing.assert_allclose(losses["2x4"], losses["1"], rtol=1e-5)


def _poisoned(epoch):
    # Epoch 0 is clean; every example of epoch 1 makes the loss NaN.
    return [{"x": a["x"], "y": a["y"] + 2 * epoch} for a in _toy(32)]


def nan_loss(model, batch, key):
    loss, aux = loss_fn(model, {**batch, "y": batch["y"] % 2}, key)
    return jnp.where((batch["y"] >= 2).any(), jnp.nan, loss), aux


def test_nonfinite_loss_raises_naming_the_step_or_is_skipped():
    kwargs = dict(collate_fn=collate_fn, loss_fn=nan_loss, per_device_batch_size=1, progress=False)
    # 32 examples, global batch 8: steps 1-4 are epoch 0, step 5 is the first NaN.
    with pytest.raises(FloatingPointError, match=r"step 5 \(epoch 1\): the loss is nan"):
        rc.fit(_mlp(), optax.adam(1e-2), _poisoned, n_epochs=3, **kwargs)
    one = rc.fit(_mlp(), optax.adam(1e-2), _poisoned, n_epochs=1, **kwargs)
    two = rc.fit(
        _mlp(), optax.adam(1e-2), _poisoned, n_epochs=2, on_nonfinite="skip", log_every=4, **kwargs
    )
    assert two.step == 8 and two.history["train"][-1]["skipped"] == 4
    for a, b in zip(
        jax.tree.leaves(eqx.filter(one.model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(two.model, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_train_examples_may_depend_on_the_epoch_and_are_shuffled_per_epoch():
    seen = []

    def record(model, batch, key):
        return loss_fn(model, batch, key)

    def per_epoch(epoch):
        return [{"x": np.full(6, 100 * epoch + i, np.float32), "y": 0} for i in range(16)]

    def spy(examples):
        seen.append([int(e["x"][0]) for e in examples])
        return collate_fn(examples)

    rc.fit(
        _mlp(),
        optax.sgd(0.0),
        per_epoch,
        collate_fn=spy,
        loss_fn=record,
        per_device_batch_size=1,
        n_epochs=2,
        progress=False,
    )
    assert seen[0] == [int(i) for i in epoch_order(16, seed=0, epoch=0)[:8]]
    assert seen[2] == [100 + int(i) for i in epoch_order(16, seed=0, epoch=1)[:8]]


def test_bad_input_gives_clear_errors():
    kwargs = dict(
        collate_fn=collate_fn, loss_fn=loss_fn, per_device_batch_size=1, n_epochs=1, progress=False
    )
    with pytest.raises(ValueError, match="train_examples \\(epoch 0\\) is empty"):
        rc.fit(_mlp(), optax.sgd(0.1), [], **kwargs)
    with pytest.raises(ValueError, match="5 examples in epoch 0, fewer than one global batch of 8"):
        rc.fit(_mlp(), optax.sgd(0.1), _toy(5), **kwargs)
    with pytest.raises(TypeError, match=r"collate_fn \(<lambda>\) must return a dict"):
        rc.fit(_mlp(), optax.sgd(0.1), _toy(8), **{**kwargs, "collate_fn": lambda exs: exs})
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar.*shape \(8,\)"):
        rc.fit(
            _mlp(),
            optax.sgd(0.1),
            _toy(8),
            **{**kwargs, "loss_fn": lambda m, b, k: jax.vmap(m)(b["x"])[:, 0]},
        )
    with pytest.raises(ValueError, match="needs n_epochs or max_steps"):
        rc.fit(_mlp(), optax.sgd(0.1), _toy(8), **{**kwargs, "n_epochs": None})
    with pytest.raises(ValueError, match="output_fn and metric_fn work on predictions"):
        rc.Evaluation(_toy(4), metric_fn=accuracy)
    with pytest.raises(ValueError, match=r"Evaluation\.examples is empty"):
        rc.Evaluation([])
    with pytest.raises(KeyError, match=r"save_best names the metric 'f1'.*\['accuracy', 'loss'\]"):
        rc.fit(
            _mlp(),
            optax.sgd(0.1),
            _toy(8),
            evaluation=rc.Evaluation(
                _toy(4), pred_fn=pred_fn, metric_fn=accuracy, save_best=("f1", "max")
            ),
            **kwargs,
        )
    with pytest.raises(ValueError, match="examples is empty"):
        rc.predict(_mlp(), [], collate_fn=collate_fn, pred_fn=pred_fn, per_device_batch_size=1)


def test_best_metric_selection():
    best = rc.BestMetric("loss", "min")
    best, improved = best.update({"loss": 2.0}, step=1)
    assert improved and best.value == 2.0 and best.step == 1
    for value, expected in ((3.0, False), (2.0, False), (float("nan"), False), (1.5, True)):
        best, improved = best.update({"loss": value}, step=2)
        assert improved is expected
    assert best.value == 1.5
    top = rc.BestMetric("accuracy", "max")
    top, _ = top.update({"accuracy": 0.5}, step=1)
    top, improved = top.update({"accuracy": 0.7}, step=2)
    assert improved and top.step == 2
    # A ValueError, or the test-time type checker's TypeError first; both name the value.
    with pytest.raises((ValueError, TypeError), match="'lowest'"):
        rc.BestMetric("loss", "lowest")  # type: ignore[arg-type]


def test_eval_every_and_final_evaluation(tmp_path):
    result = rc.fit(
        _mlp(),
        optax.adam(1e-2),
        _toy(64),
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        per_device_batch_size=1,
        max_steps=7,
        evaluation=rc.Evaluation(_toy(13, seed=1), every=3),
        progress=False,
        workdir=tmp_path,
    )
    assert [r["step"] for r in result.history["eval"]] == [3, 6, 7]
    # The padded last eval batch is weighted out: eval_loss is the mean over 13 examples.
    expected = np.mean(
        [float(loss_fn(result.model, collate_fn([e]), None)[0]) for e in _toy(13, seed=1)]
    )
    assert result.history["eval"][-1]["eval_loss"] == pytest.approx(expected, rel=1e-5)
    saved = json.loads((tmp_path / "eval" / "step_00000007.json").read_text())
    assert saved["outputs"] is None and "loss" in saved["metrics"]


def test_logger_sinks(tmp_path, monkeypatch):
    tb = rc.tensorboard_logger(tmp_path / "tb")
    tb({"loss": 0.5, "note": "text"}, 1)
    tb.close()  # type: ignore[attr-defined]
    assert list((tmp_path / "tb").iterdir())

    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append((metrics, step))

        def finish(self):
            calls.append("finish")

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: Run()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = rc.wandb_logger(project="x")
    log({"loss": 1.0}, 3)
    log.close()  # type: ignore[attr-defined]
    assert calls == [({"loss": 1.0}, 3), "finish"]
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'redcoast\[wandb\]'"):
        rc.wandb_logger()

    path = tmp_path / "m.jsonl"
    rc.jsonl_logger(path)({"loss": float("nan")}, 2)
    assert _read_jsonl(path) == [{"step": 2, "loss": "nan"}]


def test_fit_ends_with_one_line_on_the_run(capsys):
    kwargs = dict(collate_fn=collate_fn, loss_fn=loss_fn, per_device_batch_size=4, max_steps=3)
    rc.fit(_mlp(), optax.adam(1e-2), _toy(64), log_every=1, **kwargs)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("redcoast: 3 steps in ") and ": loss " in line and "grad_norm" in line
    rc.fit(_mlp(), optax.adam(1e-2), _toy(64), progress=False, **kwargs)
    assert "redcoast:" not in capsys.readouterr().out


def test_fit_through_shard_map_equals_fit_through_jit():
    mesh = rc.make_mesh(1)
    opt = optax.adamw(1e-2)
    runs = {
        path: rc.fit(
            _mlp(),
            opt,
            _toy(256),
            collate_fn=collate_fn,
            loss_fn=loss_fn,
            mesh=mesh,
            per_device_batch_size=4,
            max_steps=6,
            accumulate_grad_batches=2,
            log_every=1,
            progress=False,
            data_parallel=path,
        )
        for path in ("jit", "shard_map")
    }
    losses = {path: [h["loss"] for h in r.history["train"]] for path, r in runs.items()}
    assert len(losses["jit"]) == 6
    np.testing.assert_allclose(losses["shard_map"], losses["jit"], rtol=1e-5)
    chex.assert_trees_all_close(
        eqx.filter(runs["shard_map"].model, eqx.is_array),
        eqx.filter(runs["jit"].model, eqx.is_array),
        rtol=1e-5,
        atol=1e-7,
    )
    with pytest.raises(ValueError, match="use one or the other"):
        rc.fit(
            _mlp(),
            opt,
            _toy(64),
            collate_fn=collate_fn,
            loss_fn=loss_fn,
            mesh=mesh,
            per_device_batch_size=4,
            max_steps=1,
            fsdp=True,
            data_parallel="shard_map",
        )
