"""Differential privacy: DP-SGD (Abadi et al. 2016) on digits, with the privacy spent.

Every step clips each example's gradient to L2 norm `clip_norm`, sums, adds Gaussian
noise of standard deviation `noise_multiplier * clip_norm` and divides by the batch
size: `optax.contrib.differentially_private_aggregate`, applied in `loss_fn` to the
per-example gradients (`jax.vmap` of `jax.grad`). `loss_fn` returns the cross-entropy
as its value and the private gradient as its gradient, so `rc.fit` and any optax
optimizer take the private step unchanged. The privacy spent, (epsilon, delta), comes
from the PRV accountant (Gopi et al. 2021) for the sampled Gaussian mechanism with
sampling rate batch / dataset size; batches are shuffled, not Poisson-sampled, the usual
approximation. The model and the other functions are classification.py's.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from classification import accuracy, cnn, collate_fn, digits, pred_fn
from jaxtyping import Array, PRNGKeyArray
from prv_accountant.dpsgd import DPSGDAccountant

import redcoast as rc

CLIP_NORM, NOISE_MULTIPLIER, DELTA = 1.0, 1.0, 1e-5


def loss_fn(model: eqx.Module, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def example_loss(p: eqx.Module, image: Array, label: Array, k: PRNGKeyArray) -> Array:
        logits = eqx.combine(p, static)(image, key=k)
        return optax.softmax_cross_entropy_with_integer_labels(logits, label)

    k_dropout, k_noise = jax.random.split(key)
    keys = jax.random.split(k_dropout, len(batch["label"]))
    losses, grads = jax.vmap(jax.value_and_grad(example_loss), in_axes=(None, 0, 0, 0))(
        params, batch["image"], batch["label"], keys
    )
    private = optax.contrib.differentially_private_aggregate(CLIP_NORM, NOISE_MULTIPLIER, k_noise)
    grad, _ = private.update(grads, private.init(params))
    # Value: the mean cross-entropy. Gradient with respect to params: `grad`.
    surrogate = sum(
        jnp.vdot(jax.lax.stop_gradient(g), p - jax.lax.stop_gradient(p))
        for g, p in zip(jax.tree.leaves(grad), jax.tree.leaves(params), strict=True)
    )
    return jax.lax.stop_gradient(losses.mean()) + surrogate


def epsilon(sampling_rate: float, steps: int) -> float:
    """The privacy spent by `steps` DP-SGD steps at `DELTA` (upper bound of the estimate)."""
    accountant = DPSGDAccountant(
        noise_multiplier=NOISE_MULTIPLIER,
        sampling_probability=sampling_rate,
        eps_error=0.01,
        max_steps=steps,
    )
    return accountant.compute_epsilon(delta=DELTA, num_steps=steps)[2]


def main(
    n_model_shards: int = 1,
    per_device_batch_size: int = 8,
    n_epochs: int = 30,
    learning_rate: float = 0.1,
    workdir: str | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Train privately; report test accuracy and the (epsilon, delta) spent.

    Args:
        n_model_shards: devices each model is split over; the rest split the batch.
        per_device_batch_size: images per data-parallel device per step.
        n_epochs: passes over the training images (more steps spend more privacy).
        learning_rate: peak SGD learning rate (momentum 0.9, cosine decay to zero).
        workdir: where metrics.jsonl and evaluation outputs go.
        seed: initialisation, shuffling, dropout and the privacy noise.
    """
    train, test = digits()
    mesh = rc.make_mesh(n_model_shards)
    batch_size = rc.global_batch_size(mesh, per_device_batch_size)
    steps = n_epochs * (len(train) // batch_size)
    result = rc.fit(
        cnn(jax.random.key(seed)),
        optax.sgd(optax.cosine_decay_schedule(learning_rate, steps), momentum=0.9),
        train,
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        mesh=mesh,
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        workdir=workdir,
        seed=seed,
    )
    # Evaluated once, at the end: the eval loss would run loss_fn's per-example gradients.
    preds = rc.predict(
        result.model,
        test,
        collate_fn=collate_fn,
        pred_fn=pred_fn,
        mesh=mesh,
        per_device_batch_size=16,
    )
    eps = epsilon(batch_size / len(train), result.step)
    print(f"privacy spent: epsilon {eps:.2f} at delta {DELTA:g} over {result.step} steps")
    return {"test_accuracy": accuracy(test, preds)["accuracy"], "epsilon": eps, "delta": DELTA}


if __name__ == "__main__":
    main()
