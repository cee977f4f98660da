"""train_step / eval_step / predict_step: accumulation, shard_map vs jit, metrics, bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc


def _mlp(seed: int = 0) -> eqx.nn.MLP:
    return eqx.nn.MLP(6, 4, 16, 2, key=jax.random.key(seed))


def _data(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(n, 6)).astype(np.float32),
        "y": rng.integers(0, 4, n).astype(np.int32),
    }


def loss_fn(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def _place(model, mesh):
    specs = jax.tree.map(lambda _: P(), eqx.filter(model, eqx.is_array))
    return rc.place(model, mesh, specs=specs)


def _global(batch, mesh):
    return jax.device_put(batch, NamedSharding(mesh, P("data")))


def _arrays(model):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-7):
    for x, y in zip(_arrays(a), _arrays(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("n_model", [None, 4], ids=["1-device", "2x4"])
def test_accumulation_4x2_equals_batch_8(n_model):
    mesh = rc.make_mesh(1, devices=jax.devices()[:1]) if n_model is None else rc.make_mesh(n_model)
    opt = optax.sgd(0.5)
    batch = _global(_data(8), mesh)
    out = {}
    for acc in (1, 4):
        model = _place(_mlp(), mesh)
        state = opt.init(eqx.filter(model, eqx.is_inexact_array))
        step = rc.train_step(loss_fn, opt, accumulate_grad_batches=acc, mesh=mesh)
        out[acc] = step(model, state, batch, jax.random.key(0))
    _assert_trees_close(out[1][0], out[4][0])
    for k in ("loss", "grad_norm", "accuracy"):
        np.testing.assert_allclose(out[1][2][k], out[4][2][k], rtol=1e-5)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_shard_map_path_equals_jit_path(accumulate):
    mesh = rc.make_mesh(1)
    opt = optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-2, 1e-3, 4))
    batches = [_global(_data(16, seed=s), mesh) for s in range(3)]
    runs = {}
    for path in ("jit", "shard_map"):
        model = _place(_mlp(), mesh)
        state = opt.init(eqx.filter(model, eqx.is_inexact_array))
        step = rc.train_step(
            loss_fn, opt, accumulate_grad_batches=accumulate, mesh=mesh, data_parallel=path
        )
        history = []
        for i, batch in enumerate(batches):
            model, state, metrics = step(model, state, batch, jax.random.key(i))
            history.append(jax.device_get(metrics))
        runs[path] = (model, history)
    _assert_trees_close(runs["jit"][0], runs["shard_map"][0])
    for a, b in zip(runs["jit"][1], runs["shard_map"][1], strict=True):
        assert a.keys() == b.keys() == {"loss", "grad_norm", "lr", "nonfinite", "accuracy"}
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5)


@pytest.mark.parametrize("path", ["jit", "shard_map"])
def test_updates_per_batch_are_that_many_steps_on_the_batch(path):
    """Three updates on one batch: the model, optimizer state and counter of three steps
    in turn (keys fold_in(key, i)), the metrics their means."""
    mesh = rc.make_mesh(1)
    opt = optax.adamw(1e-2)
    batch = _global(_data(16), mesh)
    key = jax.random.key(3)
    model = _place(_mlp(), mesh)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    one = rc.train_step(loss_fn, opt, mesh=mesh, data_parallel=path)
    losses = []
    for i in range(3):
        model, state, metrics = one(model, state, batch, jax.random.fold_in(key, i))
        losses.append(float(metrics["loss"]))
    repeated = rc.train_step(loss_fn, opt, mesh=mesh, data_parallel=path, updates_per_batch=3)
    fresh = _place(_mlp(), mesh)
    fresh_state = opt.init(eqx.filter(fresh, eqx.is_inexact_array))
    got, got_state, got_metrics = repeated(fresh, fresh_state, batch, key)
    _assert_trees_close(got, model)
    _assert_trees_close(got_state, state)
    assert losses[0] > losses[2]  # the updates follow one another
    np.testing.assert_allclose(got_metrics["loss"], np.mean(losses), rtol=1e-5)
    with pytest.raises(ValueError, match="updates_per_batch must be"):
        rc.train_step(loss_fn, opt, updates_per_batch=0)


def test_metrics_report_lr_from_inject_hyperparams_and_from_schedule():
    mesh = rc.make_mesh(1)
    schedule = optax.linear_schedule(0.1, 0.0, 10)
    batch = _global(_data(16), mesh)
    for opt, kwargs in (
        (optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), {}),
        (optax.adam(schedule), {"schedule": schedule}),
    ):
        model = _place(_mlp(), mesh)
        state = opt.init(eqx.filter(model, eqx.is_inexact_array))
        step = rc.train_step(loss_fn, opt, accumulate_grad_batches=2, mesh=mesh, **kwargs)
        for i in range(3):
            model, state, metrics = step(model, state, batch, jax.random.key(i))
            np.testing.assert_allclose(metrics["lr"], schedule(i), rtol=1e-6)
        assert 0.0 <= float(metrics["accuracy"]) <= 1.0
    # Without either, the learning rate is unknown and left out.
    opt = optax.sgd(0.1)
    model = _place(_mlp(), mesh)
    _, _, metrics = rc.train_step(loss_fn, opt, mesh=mesh)(
        model, opt.init(eqx.filter(model, eqx.is_inexact_array)), batch, jax.random.key(0)
    )
    assert "lr" not in metrics


def test_skip_nonfinite_keeps_model_and_state():
    mesh = rc.make_mesh(1)
    opt = optax.adam(1e-2)

    def bad_loss(model, batch, key):
        return loss_fn(model, batch, key)[0] * jnp.nan

    model = _place(_mlp(), mesh)
    before = _arrays(model)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = rc.train_step(bad_loss, opt, mesh=mesh, skip_nonfinite=True)
    model, state, metrics = step(model, state, _global(_data(8), mesh), jax.random.key(0))
    assert float(metrics["skipped"]) == 1.0
    for a, b in zip(before, _arrays(model), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(optax.tree_utils.tree_get(state, "count")) == 0


def test_loss_fn_returning_non_scalar_is_a_clear_error():
    mesh = rc.make_mesh(1)
    opt = optax.sgd(0.1)
    model = _place(_mlp(), mesh)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    def per_example(model, batch, key):
        return optax.softmax_cross_entropy_with_integer_labels(
            jax.vmap(model)(batch["x"]), batch["y"]
        )

    step = rc.train_step(per_example, opt, mesh=mesh)
    with pytest.raises(
        ValueError, match=r"loss_fn must return a scalar.*shape \(8,\).*'x': \(8, 6\)"
    ):
        step(model, state, _global(_data(8), mesh), jax.random.key(0))

    def reserved(model, batch, key):
        return loss_fn(model, batch, key)[0], {"lr": 1.0}

    with pytest.raises(ValueError, match="reserved name 'lr'"):
        rc.train_step(reserved, opt, mesh=mesh)(
            model, state, _global(_data(8), mesh), jax.random.key(0)
        )


def test_batch_that_does_not_split_into_micro_batches_is_a_clear_error():
    mesh = rc.make_mesh(1)
    opt = optax.sgd(0.1)
    model = _place(_mlp(), mesh)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = rc.train_step(loss_fn, opt, accumulate_grad_batches=4, mesh=mesh)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=4 micro-batches over 8 data"):
        step(model, state, _global(_data(16), mesh), jax.random.key(0))
    ragged = {"x": np.zeros((8, 6), np.float32), "y": np.zeros(4, np.int32)}
    with pytest.raises(ValueError, match=r"share one leading \(batch\) axis.*'y': \(4,\)"):
        rc.train_step(loss_fn, opt, mesh=mesh)(model, state, ragged, jax.random.key(0))


def test_bad_arguments():
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match="accumulate_grad_batches must be >= 1"):
        rc.train_step(loss_fn, opt, accumulate_grad_batches=0)
    with pytest.raises(ValueError, match="needs mesh="):
        rc.train_step(loss_fn, opt, data_parallel="shard_map")
    with pytest.raises(ValueError, match="one model shard; this mesh is 2x4"):
        rc.train_step(loss_fn, opt, data_parallel="shard_map", mesh=rc.make_mesh(4))


class _Dropper(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __call__(self, x, *, key=None):
        return self.dropout(self.linear(x), key=key)


def test_eval_step_weights_out_padding_and_uses_inference_mode():
    mesh = rc.make_mesh(1)
    model = _place(_Dropper(eqx.nn.Linear(6, 4, key=jax.random.key(0)), eqx.nn.Dropout(0.5)), mesh)

    def dropout_loss(model, batch, key):
        keys = jax.random.split(key, batch["x"].shape[0])
        logits = jax.vmap(lambda x, k: model(x, key=k))(batch["x"], keys)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}

    data = _data(16)
    evaluate = rc.eval_step(dropout_loss)
    full = evaluate(model, _global(data, mesh), jax.random.key(0))
    weights = jnp.asarray(np.arange(16) < 10, jnp.float32)
    masked = evaluate(model, _global(data, mesh), jax.random.key(0), weights)
    first10 = {k: v[:10] for k, v in data.items()}
    expected, aux = dropout_loss(eqx.nn.inference_mode(model), first10, jax.random.key(1))
    np.testing.assert_allclose(masked["loss"], expected, rtol=1e-5)
    np.testing.assert_allclose(masked["accuracy"], aux["accuracy"], rtol=1e-6)
    assert float(masked["weight"]) == 10.0 and float(full["weight"]) == 16.0


def test_predict_step_checks_the_batch_axis():
    mesh = rc.make_mesh(1)
    model = _place(_mlp(), mesh)
    batch = _global(_data(8), mesh)
    labels = rc.predict_step(lambda m, b, k: jax.vmap(m)(b["x"]).argmax(-1))(
        model, batch, jax.random.key(0)
    )
    assert labels.shape == (8,)
    with pytest.raises(ValueError, match=r"pred_fn must return .*batch of 8.* it returned \(\)"):
        rc.predict_step(lambda m, b, k: jax.vmap(m)(b["x"]).sum())(model, batch, jax.random.key(0))


def test_second_step_reuses_the_first_steps_program():
    """optax's counters start on one device; the step must not compile again for step 2."""
    mesh = rc.make_mesh(2)
    traces = []

    def counted(model, batch, key):
        traces.append(1)
        return loss_fn(model, batch, key)

    model = _place(_mlp(), mesh)
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    assert any(not isinstance(x.sharding, NamedSharding) for x in jax.tree.leaves(state))
    step = rc.train_step(counted, opt)
    batch = _global(_data(8), mesh)
    for _ in range(3):
        model, state, _ = step(model, state, batch, jax.random.key(0))
    assert len(traces) == 1


def test_lower_gives_the_program_a_call_runs():
    """`train_step(...).lower` compiles the step ahead of time: donated, partitioned, analysable."""
    mesh = rc.make_mesh(2)
    opt = optax.adam(1e-2)
    model = _place(_mlp(), mesh)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = rc.train_step(loss_fn, opt, mesh=mesh)
    batch, key = _global(_data(8), mesh), jax.random.key(0)
    compiled = step.lower(model, state, batch, key).compile().compiled  # type: ignore[attr-defined]
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= sum(x.nbytes for x in _arrays(model))
    assert "all-reduce" in compiled.as_text()
    new_model, _, metrics = step(model, state, batch, key)
    assert np.isfinite(metrics["loss"]) and len(_arrays(new_model)) == 6
