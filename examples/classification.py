"""Image classification: a small CNN on scikit-learn's handwritten digits.

The 1,797 8x8 digit images ship with scikit-learn; a stratified 80/20 split gives
1,437 training and 360 test images. `rc.fit` trains with data parallelism over every
device (and tensor parallelism with `n_model_shards > 1`), evaluating test accuracy
after each epoch through `pred_fn`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Int, PRNGKeyArray
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import redcoast as rc


def digits(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Train and test examples `{"image": (1, 8, 8) float32 in [0, 1], "label": int}`."""
    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None]
    examples = [{"image": x, "label": int(y)} for x, y in zip(images, data.target, strict=True)]
    train, test = train_test_split(examples, test_size=0.2, random_state=seed, stratify=data.target)
    return train, test


def cnn(key: PRNGKeyArray) -> eqx.nn.Sequential:
    """Two 3x3 convolutions, a 2x2 max-pool and a two-layer classifier head."""
    k = jax.random.split(key, 4)
    return eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(1, 32, 3, padding=1, key=k[0]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Conv2d(32, 64, 3, padding=1, key=k[1]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.MaxPool2d(2, 2),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Dropout(0.25),
            eqx.nn.Linear(64 * 4 * 4, 128, key=k[2]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Dropout(0.25),
            eqx.nn.Linear(128, 10, key=k[3]),
        ]
    )


def collate_fn(examples: list[dict]) -> dict[str, np.ndarray]:
    return {
        "image": np.stack([e["image"] for e in examples]),
        "label": np.array([e["label"] for e in examples], np.int32),
    }


def loss_fn(model: eqx.Module, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    keys = jax.random.split(key, len(batch["label"]))  # one dropout key per example
    logits = jax.vmap(lambda x, k: model(x, key=k))(batch["image"], keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def pred_fn(model: eqx.Module, batch: dict[str, Array], key: PRNGKeyArray) -> Int[Array, " b"]:
    return jax.vmap(model)(batch["image"]).argmax(-1)


def accuracy(examples: list[dict], preds: list[np.ndarray]) -> dict[str, float]:
    return {
        "accuracy": float(np.mean([e["label"] == p for e, p in zip(examples, preds, strict=True)]))
    }


def main(
    n_model_shards: int = 1,
    per_device_batch_size: int = 8,
    n_epochs: int = 30,
    learning_rate: float = 2e-3,
    workdir: str | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Train the CNN and report test accuracy after the last epoch.

    Args:
        n_model_shards: devices each model is split over; the rest split the batch.
        per_device_batch_size: images per data-parallel device per step.
        n_epochs: passes over the training images.
        learning_rate: peak AdamW learning rate (cosine decay to zero).
        workdir: where metrics.jsonl and evaluation outputs go.
        seed: initialisation, shuffling and dropout.
    """
    train, test = digits()
    mesh = rc.make_mesh(n_model_shards)
    steps = n_epochs * (len(train) // rc.global_batch_size(mesh, per_device_batch_size))
    optimizer = optax.adamw(optax.cosine_decay_schedule(learning_rate, steps))
    result = rc.fit(
        cnn(jax.random.key(seed)),
        optimizer,
        train,
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        mesh=mesh,
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        evaluation=rc.Evaluation(test, pred_fn=pred_fn, metric_fn=accuracy),
        workdir=workdir,
        seed=seed,
    )
    final = result.history["eval"][-1]
    return {"test_accuracy": final["eval_accuracy"], "test_loss": final["eval_loss"]}


if __name__ == "__main__":
    print(main())
