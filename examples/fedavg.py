"""Federated learning: FedAvg (McMahan et al. 2017) over 10 non-IID clients on digits.

The training digits are split as in the paper's pathological non-IID setting: sorted by
label, cut into 20 shards, two shards per client, so most clients see two or three
classes. Each round every client trains a copy of the global model for `local_epochs`
with `rc.batches` and `rc.train_step`, and the server averages the copies weighted by
client size. The model and the three functions are classification.py's: FedAvg changes
the loop, not the task.
"""

import equinox as eqx
import jax
import numpy as np
import optax
from classification import accuracy, cnn, collate_fn, digits, loss_fn, pred_fn

import redcoast as rc


def split_non_iid(examples: list[dict], n_clients: int, seed: int) -> list[list[dict]]:
    """Two label-sorted shards per client."""
    order = np.argsort([e["label"] for e in examples], kind="stable")
    shards = np.array_split(order, 2 * n_clients)
    owner = np.random.default_rng(seed).permutation(2 * n_clients).reshape(n_clients, 2)
    return [[examples[i] for s in pair for i in shards[s]] for pair in owner]


def average(models: list, weights: list[float]) -> eqx.Module:
    """The weighted average of the models' floating-point arrays."""
    params = [eqx.filter(m, eqx.is_inexact_array) for m in models]
    mean = jax.tree.map(lambda *xs: sum(w * x for w, x in zip(weights, xs, strict=True)), *params)
    return eqx.combine(mean, models[0])


def main(
    n_model_shards: int = 1,
    per_device_batch_size: int = 2,
    n_rounds: int = 30,
    local_epochs: int = 2,
    n_clients: int = 10,
    learning_rate: float = 0.05,
    workdir: str | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Run FedAvg and report the global model's test accuracy after the last round.

    Args:
        n_model_shards: devices each model is split over; the rest split the batch.
        per_device_batch_size: images per data-parallel device per local step.
        n_rounds: communication rounds.
        local_epochs: passes each client makes over its own data per round.
        n_clients: clients; each holds two label-sorted shards of the training set.
        learning_rate: clients' SGD (momentum 0.9) learning rate.
        workdir: where metrics.jsonl goes (one line per round).
        seed: initialisation, the split, shuffling and dropout.
    """
    train, test = digits()
    clients = split_non_iid(train, n_clients, seed)
    mesh = rc.make_mesh(n_model_shards)
    batch_size = rc.global_batch_size(mesh, per_device_batch_size)
    key = jax.random.key(seed)
    model = cnn(key)
    example = collate_fn(train[:2])
    model = rc.place(model, mesh, example_call=lambda m: loss_fn(m, example, key))
    optimizer = optax.sgd(learning_rate, momentum=0.9)
    # Not donating: every client starts from the same global model.
    step = eqx.filter_jit(rc.train_step(loss_fn, optimizer, mesh=mesh, jit=False))
    log = rc.jsonl_logger(f"{workdir}/metrics.jsonl") if workdir else lambda *_: None
    n = 0
    for r in range(n_rounds):
        local = []
        for c, data in enumerate(clients):
            m, opt_state = model, optimizer.init(eqx.filter(model, eqx.is_inexact_array))
            for e in range(local_epochs):
                epoch = (r * local_epochs + e) * n_clients + c  # a fresh order each time
                for b in rc.batches(
                    data,
                    collate_fn=collate_fn,
                    mesh=mesh,
                    batch_size=batch_size,
                    seed=seed,
                    epoch=epoch,
                ):
                    m, opt_state, _ = step(m, opt_state, b.arrays, jax.random.fold_in(key, n))
                    n += 1
            local.append(m)
        model = average(local, [len(d) / len(train) for d in clients])
        preds = rc.predict(
            model, test, collate_fn=collate_fn, pred_fn=pred_fn, mesh=mesh, per_device_batch_size=16
        )
        metrics = accuracy(test, preds)
        log(metrics, r + 1)
        print(f"round {r + 1}: test accuracy {metrics['accuracy']:.3f}")
    return {"test_accuracy": metrics["accuracy"]}


if __name__ == "__main__":
    main()
