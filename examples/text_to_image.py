"""Text to image: a diffusion transformer (DiT, Peebles & Xie 2023) conditioned by
adaptive LayerNorm on its prompt learns to draw "red circle top", split over
`n_model_shards` devices by redcoast's rules, and draws colour-shape pairs it never saw.

A scene is one of the captioning example's shapes in one of seven colours at the top,
bottom, left or right of a 16x16 canvas; three (colour, shape) pairs, no two sharing a
colour or a shape, are held out of training at every place. The DiT learns the standard
noise-prediction loss (Ho et al. 2020); `pred_fn` samples the held-out prompts with DDIM
(Song et al. 2021); a classifier trained on real scenes of all 84 kinds names each
sample's colour, shape and place (the quality figure: all three right). `samples.png`.
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
PLACES = {"top": (-4, 0), "bottom": (4, 0), "left": (0, -4), "right": (0, 4)}
KINDS = list(itertools.product(COLOURS, SHAPES, PLACES))  # ("red", "circle", "top"), ...
WORDS = ["<pad>", *COLOURS, *SHAPES, *PLACES]
SIZE = 16


def draw(kind: int, seed: int) -> np.ndarray:
    """One shape of radius 3 at its place on a black canvas, pixels in [-1, 1], and noise."""
    colour, shape, place = KINDS[kind]
    y, x = np.mgrid[:SIZE, :SIZE] - np.add(PLACES[place], SIZE // 2)[:, None, None]
    image = -np.ones((3, SIZE, SIZE), np.float32)
    image[:, inside(shape, y, x, 3)] = 2 * np.array(COLOURS[colour])[:, None] - 1
    return image + np.random.default_rng(seed).normal(0, 0.05, image.shape).astype(np.float32)


def collate_fn(scenes: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """(kind, seed) pairs -> the images and their prompts' word ids ("red circle top")."""
    prompts = [[WORDS.index(w) for w in KINDS[k]] for k, _ in scenes]
    images = np.stack([draw(k, seed) for k, seed in scenes])
    return {"images": images, "prompts": np.array(prompts, np.int32)}


def loss_fn(model: DiT, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    return noise_prediction_loss(model, batch["images"], batch["prompts"], key)


def pred_fn(model: DiT, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    return ddim_sample(model, batch["prompts"], key, steps=50)


def classifier(seed: int, n: int = 2520, steps: int = 200) -> eqx.nn.MLP:
    """An MLP naming the kind of a real scene, trained on real scenes of all kinds, noised."""
    batch = collate_fn([(i % len(KINDS), 2 * 10**6 + i) for i in range(n)])
    noise = np.random.default_rng(seed).normal(0, 0.3, batch["images"].shape)
    x, y = rearrange(batch["images"] + noise, "b c h w -> b (c h w)"), np.arange(n) % len(KINDS)
    mlp = eqx.nn.MLP(x.shape[1], len(KINDS), 128, 1, key=jax.random.key(seed))
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

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    header = struct.pack(">2I5B", rgb.shape[1], rgb.shape[0], 8, 2, 0, 0, 0)  # 8-bit RGB
    raw = zlib.compress(b"".join(b"\0" + row.tobytes() for row in rgb))
    parts = [chunk(b"IHDR", header), chunk(b"IDAT", raw), chunk(b"IEND", b"")]
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"".join(parts))


def main(
    n_model_shards: int = 2,
    per_device_batch_size: int = 8,
    max_steps: int = 3000,
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
    held_out = {(list(COLOURS)[c], s) for c, s in zip(colours, SHAPES, strict=True)}
    unseen = [k for k, (colour, shape, _) in enumerate(KINDS) if (colour, shape) in held_out]
    seen = sorted(set(range(len(KINDS))) - set(unseen))
    test = [(unseen[i % len(unseen)], 10**6 + i) for i in range(96)]
    judge, folder = classifier(seed), Path(workdir or tempfile.mkdtemp())

    def train(epoch: int) -> list[tuple[int, int]]:
        draws = np.random.default_rng([seed, epoch]).choice(seen, 4096)
        return [(int(p), epoch * 4096 + i) for i, p in enumerate(draws)]

    def recognised(scenes: list[tuple[int, int]], images: list[np.ndarray]) -> dict[str, float]:
        said = jax.vmap(judge)(rearrange(np.stack(images), "b c h w -> b (c h w)")).argmax(-1)
        match = np.array([KINDS[int(k)] for k in said]) == np.array([KINDS[k] for k, _ in scenes])
        write_png(folder / "samples.png", np.stack(images))
        each = dict(zip(("colour", "shape", "place"), match.mean(0).tolist(), strict=True))
        return {"recognised": float(match.all(1).mean()), **each}

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
    return {k: final[f"eval_{k}"] for k in ("recognised", "colour", "shape", "place")}


if __name__ == "__main__":
    print(main())
