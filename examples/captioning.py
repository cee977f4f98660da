"""Image captioning, the RedCoast paper's Figure 5: a ViT + GPT-2 (`transformers`'
VisionEncoderDecoder) learns to describe drawn scenes, split over `n_model_shards`
devices by redcoast's rules. A scene is two shapes on a 32x32 canvas, "a red circle
left of a blue square"; a fifth of the (colour, shape, relation, colour, shape) kinds
are held out, never seen in training, and captioned by beam search, scored by exact
match and ROUGE-L (Lin 2004). The trained model is written as a `transformers` folder.
"""

import itertools
import tempfile

import jax
import numpy as np
import optax
from jaxtyping import Array, PRNGKeyArray

import redcoast as rc
from redcoast.models import GPT2Config, ViTConfig, generate_seq2seq
from redcoast.models import VisionEncoderDecoder as Captioner
from redcoast.models import VisionEncoderDecoderConfig as CaptionerConfig

COLOURS = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1), "yellow": (1, 1, 0)}
SHAPES, RELATIONS = ("circle", "square", "triangle"), ("above", "left of")
PAD, START, EOS = 0, 1, 2
VOCAB = ["<pad>", "<s>", "</s>", "a", *COLOURS, *SHAPES, "above", "left", "of"]
LENGTH, SIZE = 9, 32  # "a red circle left of a blue square" and EOS
PAIRS = list(itertools.product(COLOURS, SHAPES))
KINDS = [(*a, r, *b) for a, r, b in itertools.product(PAIRS, RELATIONS, PAIRS) if a != b]
CAPTIONS = ["a {} {} {} a {} {}".format(*kind) for kind in KINDS]


def inside(shape: str, dy: np.ndarray, dx: np.ndarray, r: int) -> np.ndarray:
    """The pixels of a shape of radius `r`, from each pixel's offsets to its centre."""
    return {
        "circle": dy**2 + dx**2 <= r**2,
        "square": (abs(dy) <= r) & (abs(dx) <= r),
        "triangle": (abs(dy) <= r) & (2 * abs(dx) <= dy + r),
    }[shape]


def draw(kind: tuple[str, ...], seed: int) -> np.ndarray:
    """The scene: the first shape above or left of the second, both jittered."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:SIZE, :SIZE]
    line, ends = rng.integers(6, 26), (rng.integers(5, 10), rng.integers(22, 27))
    image = np.zeros((3, SIZE, SIZE), np.float32)
    for (colour, shape), along in zip((kind[:2], kind[3:]), ends, strict=True):
        cy, cx = (along, line) if kind[2] == "above" else (line, along)
        dy, dx = y - cy - rng.integers(-1, 2), x - cx - rng.integers(-1, 2)
        image[:, inside(shape, dy, dx, 5)] = np.array(COLOURS[colour], np.float32)[:, None]
    return image + rng.normal(0, 0.05, image.shape).astype(np.float32)


def collate_fn(scenes: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """(kind, seed) pairs -> pixel_values and the caption's token ids (EOS, then padding)."""
    ids = [[VOCAB.index(w) for w in CAPTIONS[k].split()] + [EOS] for k, _ in scenes]
    tokens = np.array([s + [PAD] * (LENGTH - len(s)) for s in ids], np.int32)
    pixels = np.stack([draw(KINDS[k], seed) for k, seed in scenes])
    return {"pixel_values": pixels, "token_ids": tokens}


def loss_fn(model: Captioner, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    ids = batch["token_ids"]
    decoder_input = jax.numpy.concatenate([jax.numpy.full_like(ids[:, :1], START), ids[:, :-1]], 1)
    logits = jax.vmap(model)(batch["pixel_values"], decoder_input)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, ids)
    return (losses * (ids != PAD)).sum() / (ids != PAD).sum()


def pred_fn(model: Captioner, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    return generate_seq2seq(model, batch["pixel_values"], max_new_tokens=LENGTH, num_beams=3)


def to_text(ids: np.ndarray) -> str:
    ids = ids.tolist()
    return " ".join(VOCAB[i] for i in ids[: ids.index(EOS) if EOS in ids else None])


def rouge_l(want: list[str], got: list[str]) -> float:
    # ROUGE-L's F-measure: the longest common subsequence of words over both lengths.
    lcs = np.zeros((len(want) + 1, len(got) + 1), int)
    for (i, w), (j, g) in itertools.product(enumerate(want), enumerate(got)):
        lcs[i + 1, j + 1] = lcs[i, j] + 1 if w == g else max(lcs[i, j + 1], lcs[i + 1, j])
    return 2 * lcs[-1, -1] / (len(want) + len(got)) if got else 0.0


def metrics(scenes: list[tuple[int, int]], texts: list[str]) -> dict[str, float]:
    want = [CAPTIONS[k] for k, _ in scenes]
    rouge = [rouge_l(w.split(), t.split()) for w, t in zip(want, texts, strict=True)]
    return {"rougeL": float(np.mean(rouge)), "exact": float(np.mean(np.equal(want, texts)))}


def main(
    n_model_shards: int = 2,
    per_device_batch_size: int = 16,
    max_steps: int = 600,
    learning_rate: float = 3e-3,
    workdir: str | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Train on drawn scenes, caption held-out kinds with beam search, save for transformers.

    Args:
        n_model_shards: devices each model is split over; the rest split the batch.
        per_device_batch_size: scenes per data-parallel device per step.
        max_steps: optimizer steps; the held-out scenes are captioned halfway and at the end.
        learning_rate: peak AdamW learning rate (warm-up, then cosine decay).
        workdir: where metrics, checkpoints and the transformers folder (`hf/`) go.
        seed: initialisation, data and the held-out split.
    """
    kinds = np.random.default_rng(seed).permutation(len(KINDS))
    held_out, seen = kinds[: len(KINDS) // 5], kinds[len(KINDS) // 5 :]
    test = [(int(k), 10**6 + i) for i, k in enumerate(np.resize(held_out, 128))]

    def train(epoch: int) -> list[tuple[int, int]]:
        draws = np.random.default_rng([seed, epoch]).choice(seen, 4096)
        return [(int(k), epoch * 4096 + i) for i, k in enumerate(draws)]

    vit = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, image_size=SIZE, patch_size=8)  # fmt: skip
    gpt2 = GPT2Config(vocab_size=len(VOCAB), n_positions=16, n_embd=64, n_layer=2, n_head=4,
                      add_cross_attention=True)  # fmt: skip
    config = CaptionerConfig(encoder=vit, decoder=gpt2, decoder_start_token_id=START,
                             eos_token_id=EOS, pad_token_id=PAD)  # fmt: skip
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max_steps // 10, max_steps)
    result = rc.fit(
        Captioner(config, key=jax.random.key(seed)),
        optax.adamw(schedule, weight_decay=0.01),
        train,
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        mesh=rc.make_mesh(n_model_shards),
        per_device_batch_size=per_device_batch_size,
        max_steps=max_steps,
        evaluation=rc.Evaluation(
            test, pred_fn=pred_fn, output_fn=to_text, metric_fn=metrics, every=max_steps // 2
        ),
        workdir=workdir,
        seed=seed,
    )
    folder = f"{workdir or tempfile.mkdtemp()}/hf"
    result.model.to_hf(folder)  # transformers.VisionEncoderDecoderModel.from_pretrained(folder)
    print("saved for transformers in", folder)
    return {k: result.history["eval"][-1][f"eval_{k}"] for k in ("rougeL", "exact")}


if __name__ == "__main__":
    print(main())
