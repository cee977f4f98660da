"""Text to image: a diffusion transformer (DiT, Peebles & Xie 2023) conditioned by
adaptive LayerNorm on its prompt learns to draw "a red circle", split over
`n_model_shards` devices by redcoast's rules, and draws colour-shape pairs it never saw.

A scene is one of the captioning example's shapes, drawn by its code, at the centre of
a 16x16 canvas in one of seven colours; three (colour, shape) pairs, no two sharing a
colour or a shape, are held out of training. The DiT learns the standard noise-prediction
loss (Ho et al. 2020); `pred_fn` samples the held-out prompts with DDIM (Song et al.
2021). A classifier trained on real scenes of all 21 pairs names each sample's colour and
shape: the fraction matching the prompt is the quality figure. Samples: `samples.png`.
"""

import itertools
import struct
import tempfile
import zlib
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
from captioning import SHAPES, inside
from einops import rearrange
from jaxtyping import Array, PRNGKeyArray

import redcoast as rc
from redcoast.models import DiT, DiTConfig, ddim_sample, noise_prediction_loss

COLOURS = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1), "yellow": (1, 1, 0),
           "cyan": (0, 1, 1), "magenta": (1, 0, 1), "white": (1, 1, 1)}  # fmt: skip
PAIRS = list(itertools.product(COLOURS, SHAPES))
WORDS = ["<pad>", *COLOURS, *SHAPES]
SIZE = 16


def draw(pair: int, seed: int) -> np.ndarray:
    """One shape of radius 4 at the centre of a black canvas, pixels in [-1, 1], and noise."""
    colour, shape = PAIRS[pair]
    y, x = np.mgrid[:SIZE, :SIZE] - SIZE // 2
    image = -np.ones((3, SIZE, SIZE), np.float32)
    image[:, inside(shape, y, x, 4)] = 2 * np.array(COLOURS[colour])[:, None] - 1
    return image + np.random.default_rng(seed).normal(0, 0.05, image.shape).astype(np.float32)


def collate_fn(scenes: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """(pair, seed) pairs -> the images and their prompts' word ids ("red circle")."""
    prompts = [[WORDS.index(w) for w in PAIRS[p]] for p, _ in scenes]
    images = np.stack([draw(p, seed) for p, seed in scenes])
    return {"images": images, "prompts": np.array(prompts, np.int32)}


def loss_fn(model: DiT, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    return noise_prediction_loss(model, batch["images"], batch["prompts"], key)


def pred_fn(model: DiT, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    return ddim_sample(model, batch["prompts"], key, steps=50)


def classifier(seed: int, n: int = 1260, steps: int = 200) -> eqx.nn.MLP:
    """An MLP naming the pair of a real scene, trained on real scenes of all pairs, noised."""
    batch = collate_fn([(i % len(PAIRS), 2 * 10**6 + i) for i in range(n)])
    noise = np.random.default_rng(seed).normal(0, 0.3, batch["images"].shape)
    x, y = rearrange(batch["images"] + noise, "b c h w -> b (c h w)"), np.arange(n) % len(PAIRS)
    mlp = eqx.nn.MLP(x.shape[1], len(PAIRS), 128, 1, key=jax.random.key(seed))
    opt = optax.adam(1e-3)

    @eqx.filter_jit
    def step(mlp: eqx.nn.MLP, state: optax.OptState) -> tuple[eqx.nn.MLP, optax.OptState]:
        grads = eqx.filter_grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(
            jax.vmap(m)(x), y).mean())(mlp)  # fmt: skip
        updates, state = opt.update(grads, state)
        return eqx.apply_updates(mlp, updates), state

    state = opt.init(eqx.filter(mlp, eqx.is_array))
    for _ in range(steps):
        mlp, state = step(mlp, state)
    return mlp


def write_png(path: Path, images: np.ndarray, columns: int = 12, scale: int = 4) -> None:
    """Images ([-1, 1], channels first) as a grid in an 8-bit RGB PNG (zlib and no more)."""
    framed = np.pad(images[: len(images) // columns * columns], ((0, 0), (0, 0), (1, 1), (1, 1)))
    grid = rearrange(framed, "(r k) c h w -> (r h) (k w) c", k=columns)
    rgb = (np.clip(grid, -1, 1) * 127.5 + 127.5).astype(np.uint8).repeat(scale, 0).repeat(scale, 1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">2I5B", rgb.shape[1], rgb.shape[0], 8, 2, 0, 0, 0)  # 8-bit RGB
    raw = zlib.compress(b"".join(b"\0" + row.tobytes() for row in rgb))
    parts = [chunk(b"IHDR", header), chunk(b"IDAT", raw), chunk(b"IEND", b"")]
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"".join(parts))


def main(
    n_model_shards: int = 2,
    per_device_batch_size: int = 8,
    max_steps: int = 1200,
    learning_rate: float = 3e-3,
    workdir: str | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Train the DiT, sample held-out prompts with DDIM, name the samples with a classifier.

    Args:
        n_model_shards: devices each model is split over; the rest split the batch.
        per_device_batch_size: scenes per data-parallel device per step.
        max_steps: optimizer steps; the held-out prompts are sampled at the end.
        learning_rate: peak AdamW learning rate (warm-up, then cosine decay).
        workdir: where metrics, checkpoints and `samples.png` go.
        seed: initialisation, data and the held-out pairs.
    """
    colours = np.random.default_rng(seed).permutation(len(COLOURS))[: len(SHAPES)]
    held_out = [PAIRS.index((list(COLOURS)[c], s)) for c, s in zip(colours, SHAPES, strict=True)]
    seen = [p for p in range(len(PAIRS)) if p not in held_out]
    test = [(held_out[i % len(held_out)], 10**6 + i) for i in range(96)]
    judge, folder = classifier(seed), Path(workdir or tempfile.mkdtemp())

    def train(epoch: int) -> list[tuple[int, int]]:
        draws = np.random.default_rng([seed, epoch]).choice(seen, 4096)
        return [(int(p), epoch * 4096 + i) for i, p in enumerate(draws)]

    def recognised(scenes: list[tuple[int, int]], images: list[np.ndarray]) -> dict[str, float]:
        said = jax.vmap(judge)(rearrange(np.stack(images), "b c h w -> b (c h w)")).argmax(-1)
        match = np.array([PAIRS[int(p)] for p in said]) == np.array([PAIRS[p] for p, _ in scenes])
        write_png(folder / "samples.png", np.stack(images))
        return {"recognised": float(match.all(1).mean()), "colour": float(match[:, 0].mean()),
                "shape": float(match[:, 1].mean())}  # fmt: skip

    config = DiTConfig(image_size=SIZE, patch_size=4, hidden_size=96, num_layers=3,
                       num_heads=4, vocab_size=len(WORDS), timesteps=200)  # fmt: skip
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max_steps // 10, max_steps)
    result = rc.fit(DiT(config, key=jax.random.key(seed)), optax.adamw(schedule, weight_decay=0.01),
                    train, collate_fn=collate_fn, loss_fn=loss_fn,
                    mesh=rc.make_mesh(n_model_shards), per_device_batch_size=per_device_batch_size,
                    max_steps=max_steps,
                    evaluation=rc.Evaluation(test, pred_fn=pred_fn, output_fn=np.asarray,
                                             metric_fn=recognised, every=max_steps),
                    workdir=workdir, seed=seed)  # fmt: skip
    print("samples of the held-out prompts in", folder / "samples.png")
    final = result.history["eval"][-1]
    return {k: final[f"eval_{k}"] for k in ("recognised", "colour", "shape")}


if __name__ == "__main__":
    print(main())
