"""Text to image: a diffusion transformer (DiT, Peebles & Xie 2023) conditioned by
adaptive LayerNorm on its prompt draws the captioning example's scenes ("red circle above
blue square"), split over `n_model_shards` devices by redcoast's rules, with colour-shape
pairs it never saw: three, no two sharing a colour or a shape, are held out of training.
Each word says which shape it describes ("red" of the first shape is another word than of
the second); the DiT reads their mean (adaLN) and each word, in its attention beside the
patches (`prompt_tokens`). It learns the standard noise-prediction loss (Ho et al.
2020); `pred_fn` samples held-out prompts with DDIM (Song et al. 2021). A linear
classifier of single real shapes names each half of a sample: the quality figure is the
fraction with both shapes' colour, shape and place right.
"""

import itertools
import struct
import tempfile
import zlib
from pathlib import Path

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
RELATIONS = {"above": ("top", "bottom"), "left of": ("left", "right")}
PAIRS = list(itertools.product(COLOURS, SHAPES))
KINDS = [(*a, r, *b) for a, r, b in itertools.product(PAIRS, RELATIONS, PAIRS) if a != b]
SCENES = [[(c, s, RELATIONS[r][0]), (d, t, RELATIONS[r][1])] for c, s, r, d, t in KINDS]
WORDS = ["<pad>", *RELATIONS, *(f"{w}{i}" for i in (1, 2) for w in (*COLOURS, *SHAPES))]
PROMPTS = [[WORDS.index(w) for w in (f"{c}1", f"{s}1", r, f"{d}2", f"{t}2")]
           for c, s, r, d, t in KINDS]  # fmt: skip
SHAPES_ALONE = list(itertools.product(COLOURS, SHAPES, PLACES))  # what the classifier names
SIZE = 16
Y, X = np.mgrid[:SIZE, :SIZE] - (SIZE - 1) / 2
HALF = {place: (Y * dy > 0) | (X * dx > 0) for place, (dy, dx) in PLACES.items()}


def draw(shapes: list[tuple[str, str, str]], seed: int) -> np.ndarray:
    """Shapes of radius 3 at their places on a black canvas, pixels in [-1, 1], and noise."""
    image = -np.ones((3, SIZE, SIZE), np.float32)
    for colour, shape, place in shapes:
        y, x = np.mgrid[:SIZE, :SIZE] - np.add(PLACES[place], SIZE // 2)[:, None, None]
        image[:, inside(shape, y, x, 3)] = 2 * np.array(COLOURS[colour])[:, None] - 1
    return image + np.random.default_rng(seed).normal(0, 0.05, image.shape).astype(np.float32)


def collate_fn(scenes: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """(kind, seed) pairs -> the images and their prompts' word ids."""
    images = np.stack([draw(SCENES[k], seed) for k, seed in scenes])
    return {"images": images, "prompts": np.array([PROMPTS[k] for k, _ in scenes], np.int32)}


def loss_fn(model: DiT, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    return noise_prediction_loss(model, batch["images"], batch["prompts"], key)


def pred_fn(model: DiT, batch: dict[str, Array], key: PRNGKeyArray) -> Array:
    return ddim_sample(model, batch["prompts"], key, steps=50)


def classifier(seed: int, n: int = 2520) -> np.ndarray:
    """Ridge regression from a real shape alone, noised, to its (colour, shape, place)."""
    kinds = np.arange(n) % len(SHAPES_ALONE)
    images = np.stack([draw([SHAPES_ALONE[k]], 2 * 10**6 + i) for i, k in enumerate(kinds)])
    noise = np.random.default_rng(seed).normal(0, 0.3, images.shape)
    x = rearrange(images + noise, "b c h w -> b (c h w)")
    return np.linalg.solve(x.T @ x + np.eye(x.shape[1]), x.T @ np.eye(len(SHAPES_ALONE))[kinds])


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
    learning_rate: float = 6e-3,
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
    colours = np.random.default_rng(seed).permutation(list(COLOURS))
    held_out = set(zip(colours.tolist(), SHAPES, strict=False))  # three: shapes are fewer
    unseen = [k for k, kind in enumerate(KINDS) if {kind[:2], kind[3:]} & held_out]
    seen = sorted(set(range(len(KINDS))) - set(unseen))
    test = [(unseen[i % len(unseen)], 10**6 + i) for i in range(96)]
    judge, folder = classifier(seed), Path(workdir or tempfile.mkdtemp())

    def train(epoch: int) -> list[tuple[int, int]]:
        draws = np.random.default_rng([seed, epoch]).choice(seen, 4096)
        return [(int(p), epoch * 4096 + i) for i, p in enumerate(draws)]

    def recognised(scenes: list[tuple[int, int]], images: list[np.ndarray]) -> dict[str, float]:
        wanted = [shape for k, _ in scenes for shape in SCENES[k]]  # each half alone
        alone = np.stack([np.where(HALF[w[2]], images[i // 2], -1) for i, w in enumerate(wanted)])
        said = (rearrange(alone, "b c h w -> b (c h w)") @ judge).argmax(-1)
        match = np.array([SHAPES_ALONE[int(k)] for k in said]) == np.array(wanted)
        write_png(folder / "samples.png", np.stack(images))
        each = dict(zip(("colour", "shape", "place"), match.mean(0).tolist(), strict=True))
        return {"recognised": float(match.reshape(-1, 6).all(1).mean()), **each}

    config = DiTConfig(image_size=SIZE, patch_size=4, hidden_size=128, num_layers=4,
                       num_heads=4, vocab_size=len(WORDS), timesteps=200,
                       prompt_tokens=True)  # fmt: skip
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max_steps // 10, max_steps)
    result = rc.fit(DiT(config, key=jax.random.key(seed)), optax.adamw(schedule, weight_decay=0.01),
                    train, collate_fn=collate_fn, loss_fn=loss_fn, max_steps=max_steps,
                    mesh=rc.make_mesh(n_model_shards), per_device_batch_size=per_device_batch_size,
                    evaluation=rc.Evaluation(test, pred_fn=pred_fn, output_fn=np.asarray,
                                             metric_fn=recognised, every=max_steps),
                    workdir=workdir, seed=seed)  # fmt: skip
    print("samples of the held-out prompts in", folder / "samples.png")
    final = result.history["eval"][-1]
    return {k: final[f"eval_{k}"] for k in ("recognised", "colour", "shape", "place")}


if __name__ == "__main__":
    print(main())
