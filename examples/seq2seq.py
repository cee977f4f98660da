"""Sequence to sequence: a T5 learns to spell numbers out in words, tensor parallel.

The supervision is generated: a number below a million (its digits) and its English
words, e.g. `40718 -> "forty thousand seven hundred eighteen"`. A small T5 v1.1 from
the zoo, built from scratch, is split over `n_model_shards` devices by redcoast's rules
and the batch over the rest. Held-out numbers are decoded with beam search, scored
with ROUGE (the `rouge-score` package), and the checkpoint with the best ROUGE-L kept.
"""

import jax
import numpy as np
import optax
from jaxtyping import Array, PRNGKeyArray
from rouge_score import rouge_scorer

import redcoast as rc
from redcoast.models import T5, T5Config, generate_seq2seq

ONES = (  # noqa: SIM905 (a list literal of 20 words would take 20 lines)
    "zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen"
).split()
TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
PAD, EOS = 0, 1  # T5's: padding is also the decoder's start token
VOCAB = ["<pad>", "</s>", *"0123456789", *ONES, *TENS[2:], "hundred", "thousand"]
IDS = {token: i for i, token in enumerate(VOCAB)}
SRC_LEN, TGT_LEN = 7, 11  # six digits, ten words, and EOS


def words(n: int) -> str:
    """English words for `0 <= n < 1_000_000`."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else " " + ONES[n % 10])
    if n < 1000:
        return ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + words(n % 100))
    return words(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + words(n % 1000))


def encode(tokens: list[str], length: int) -> np.ndarray:
    ids = [IDS[t] for t in tokens] + [EOS]
    return np.array(ids + [PAD] * (length - len(ids)), np.int32)


def collate_fn(numbers: list[int]) -> dict[str, np.ndarray]:
    src = np.stack([encode(list(str(n)), SRC_LEN) for n in numbers])
    tgt = np.stack([encode(words(n).split(), TGT_LEN) for n in numbers])
    # Teacher forcing: the decoder reads the start token (PAD) and the target shifted
    # right; the padding after the target's EOS is not learned.
    decoder_input = np.concatenate([np.full_like(tgt[:, :1], PAD), tgt[:, :-1]], axis=1)
    return {"src": src, "mask": src != PAD, "tgt": tgt, "dec": decoder_input}


def loss_fn(model: T5, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    logits = jax.vmap(lambda s, a, d: model(s, d, attention_mask=a))(
        batch["src"], batch["mask"], batch["dec"]
    )
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt"])
    weight = batch["tgt"] != PAD
    return (losses * weight).sum() / weight.sum()


def pred_fn(model: T5, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    return generate_seq2seq(
        model, batch["src"], attention_mask=batch["mask"], max_new_tokens=TGT_LEN, num_beams=4
    )


def to_text(ids: np.ndarray) -> str:
    ids = ids.tolist()
    return " ".join(VOCAB[i] for i in ids[: ids.index(EOS) if EOS in ids else None])


def rouge(numbers: list[int], texts: list[str]) -> dict[str, float]:
    scorer = rouge_scorer.RougeScorer(["rouge2", "rougeL"])
    scores = [scorer.score(words(n), t) for n, t in zip(numbers, texts, strict=True)]
    out = {k: float(np.mean([s[k].fmeasure for s in scores])) for k in ("rouge2", "rougeL")}
    exact = [words(n) == t for n, t in zip(numbers, texts, strict=True)]
    return {**out, "exact": float(np.mean(exact))}


def main(
    n_model_shards: int = 2,
    per_device_batch_size: int = 32,
    max_steps: int = 600,
    eval_every: int = 200,
    learning_rate: float = 3e-3,
    workdir: str | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Train, decode held-out numbers with beam search, and report ROUGE.

    Args:
        n_model_shards: devices each model is split over; the rest split the batch.
        per_device_batch_size: numbers per data-parallel device per step.
        max_steps: optimizer steps (a fresh sample of numbers for each epoch).
        eval_every: decode and score the held-out numbers every this many steps.
        learning_rate: peak AdamW learning rate (warm-up, then cosine decay).
        workdir: where metrics.jsonl, evaluations and the best checkpoint go.
        seed: initialisation, data and shuffling.
    """
    test = [int(n) for n in np.random.default_rng(seed).choice(1_000_000, 256, replace=False)]
    held_out = set(test)

    def train(epoch: int) -> list[int]:
        draw = np.random.default_rng([seed, epoch]).integers(0, 1_000_000, 20_000)
        return [int(n) for n in draw if int(n) not in held_out]

    config = T5Config(
        vocab_size=64,  # the 42 tokens, padded to split evenly
        d_model=128,
        d_kv=32,
        d_ff=256,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
    )
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max_steps // 10, max_steps)
    result = rc.fit(
        T5(config, key=jax.random.key(seed)),
        optax.adamw(schedule, weight_decay=0.01),
        train,
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        mesh=rc.make_mesh(n_model_shards),
        per_device_batch_size=per_device_batch_size,
        max_steps=max_steps,
        evaluation=rc.Evaluation(
            test,
            pred_fn=pred_fn,
            output_fn=to_text,
            metric_fn=rouge,
            every=eval_every,
            save_best=("rougeL", "max"),
        ),
        workdir=workdir,
        seed=seed,
    )
    print("best evaluation:", result.history["best"])
    final = result.history["eval"][-1]
    return {k: final[f"eval_{k}"] for k in ("rougeL", "rouge2", "exact")}


if __name__ == "__main__":
    print(main())
