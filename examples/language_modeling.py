"""Causal language modelling, byte level, on Python's own documentation, tensor parallel.

The text is `pydoc_data.topics` (shipped with CPython, ~465k characters). A small
LLaMA from the zoo is split over `n_model_shards` devices by redcoast's rules and the
batch over the rest. Reports validation loss in nats per byte against a unigram
baseline, and prints a sampled continuation of a prompt.
"""

import math
from pydoc_data.topics import topics

import jax
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import redcoast as rc
from redcoast.models import Llama, LlamaConfig, generate

SEQ = 128


def load_windows(seq: int = SEQ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Non-overlapping windows of `seq + 1` bytes; the last 5% of the text is validation."""
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = np.frombuffer(text, dtype=np.uint8)
    split = int(len(data) * 0.95)

    def cut(a: np.ndarray) -> list[np.ndarray]:
        return [a[i : i + seq + 1] for i in range(0, len(a) - seq - 1, seq)]

    return cut(data[:split]), cut(data[split:])


def collate_fn(examples: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {"ids": np.stack(examples).astype(np.int32)}


def token_losses(model: Llama, ids: Int[Array, "batch seq1"]) -> Float[Array, "batch seq"]:
    logits = jax.vmap(model)(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])


def loss_fn(model: Llama, batch: dict[str, Array], key: PRNGKeyArray) -> tuple[Array, dict]:
    losses = token_losses(model, batch["ids"])
    return losses.mean(), {"tokens": float(losses.size)}  # the tokens predicted, for tokens/s


def versus_baseline(nats: float, baseline: float) -> str:
    """`12% below it` (better than the baseline), or `2% above it` (worse)."""
    below = 1 - nats / baseline
    return f"{abs(100 * below):.0f}% {'below' if below >= 0 else 'above'} it"


def pred_fn(model: Llama, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    return token_losses(model, batch["ids"]).mean(axis=1)  # nats per byte, per example


def unigram_nats(train: list[np.ndarray], val: list[np.ndarray]) -> float:
    """Cross-entropy of the validation bytes under the training bytes' frequencies."""
    counts = np.bincount(np.concatenate(train), minlength=256) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.concatenate([v[1:] for v in val])].mean())


def main(
    n_model_shards: int = 2,
    per_device_batch_size: int = 4,
    max_steps: int = 300,
    learning_rate: float = 3e-3,
    workdir: str | None = None,
    resume: bool = False,
    seed: int = 0,
) -> dict[str, float]:
    """Train, evaluate against the unigram baseline, and print a sample.

    Args:
        n_model_shards: devices each model is split over; the rest split the batch.
        per_device_batch_size: windows of 128 bytes per data-parallel device per step.
        max_steps: optimizer steps.
        learning_rate: peak AdamW learning rate (warm-up, then cosine decay).
        workdir: where metrics.jsonl and checkpoints go.
        resume: continue the run in `workdir` from its newest checkpoint (after a stop).
        seed: initialisation and shuffling.
    """
    train, val = load_windows()
    mesh = rc.make_mesh(n_model_shards)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = Llama(config, key=jax.random.key(seed))
    example = collate_fn(train[:2])
    plan = rc.sharding_plan(
        model, n_model_shards, example_call=lambda m: loss_fn(m, example, jax.random.key(0))
    )
    report = str(plan).splitlines()
    n_split = sum(any(e is not None for e in leaf.spec) for leaf in plan.leaves)
    print(report[0], f"{n_split} of {len(plan.leaves)} arrays split", sep="\n  ")
    print("  " + next(line for line in report if line.startswith("bytes per device")))
    model = rc.place(model, mesh, specs=plan.specs)
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max_steps // 10, max_steps)
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.01)
    result = rc.fit(
        model,
        optimizer,
        train,
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        mesh=mesh,
        per_device_batch_size=per_device_batch_size,
        max_steps=max_steps,
        workdir=workdir,
        resume=resume,
        seed=seed,
    )
    if result.stopped_by is not None:  # SIGTERM or Ctrl-C: a checkpoint was saved
        return {"stopped_after_step": result.step}
    how = dict(collate_fn=collate_fn, mesh=mesh, per_device_batch_size=4 * per_device_batch_size)
    losses = rc.predict(result.model, val, pred_fn=pred_fn, **how)
    val_nats = float(np.mean([float(x) for x in losses]))
    baseline = unigram_nats(train, val)
    print(
        f"validation: {val_nats:.3f} nats/byte ({val_nats / math.log(2):.2f} bits); unigram "
        f"baseline {baseline:.3f}; {versus_baseline(val_nats, baseline)}"
    )
    prompt = b"The for statement"
    ids = np.frombuffer(prompt, np.uint8).astype(np.int32)[None]
    new = generate(result.model, ids, max_new_tokens=160, temperature=0.7, key=jax.random.key(seed))
    text = (prompt + bytes(np.asarray(new[0], np.uint8))).decode("utf-8", errors="replace")
    print("sample:", repr(text))
    return {
        "val_nats_per_byte": val_nats,
        "unigram_nats_per_byte": baseline,
        "below_unigram": 1 - val_nats / baseline,
        **rc.median_speed(result.history["train"]),  # tokens_per_s, step_s (and mfu)
    }


if __name__ == "__main__":
    main()
