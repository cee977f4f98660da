"""Train a small GPT with `rc.fit`, stop, and resume it on another mesh or process count.

`train(workdir, kind, layout, steps, resume)` runs `fit` on the mesh `layout` names
(`"1"`: one device; `"8x1"`, `"4x2"`, `"2x4"`: data x model over 8 devices) with
the same global batch of 8 rows everywhere, for one of the kinds of run resuming
must carry over: `"full"` (AdamW on every weight, dropout on), `"lora"`
(adapters only, `trainable=`), `"fsdp"` (weights split over the data axis too) and
`"accumulate"` (two micro-batches a step). Run as a script (alone, or under
`redcoast launch` for several processes) it does the same and process 0 writes
`OUT/params.npz` and `OUT/losses.json`:

    python resume_across.py WORKDIR OUT KIND LAYOUT STEPS [--resume]
"""

import json
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

import redcoast as rc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import TinyGPT

SEQ, ROWS = 16, 8  # tokens per row; rows per optimizer step, on every layout


def examples() -> list[np.ndarray]:
    """Counting sequences `(a + b * i) % 64`, 48 of them: six steps an epoch."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 48), rng.integers(1, 8, 48)
    return [((a[k] + b[k] * np.arange(SEQ + 1)) % 64).astype(np.int32) for k in range(48)]


def collate_fn(rows: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {"ids": np.stack(rows)}


def loss_fn(model: TinyGPT, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    ids = batch["ids"]
    logits = jax.vmap(lambda x, k: model(x, key=k))(ids[:, :-1], jax.random.split(key, len(ids)))
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def mesh_of(layout: str) -> jax.sharding.Mesh:
    if layout == "1":
        return rc.make_mesh(1, devices=jax.devices()[:1])
    n_data, n_model = (int(n) for n in layout.split("x"))
    mesh = rc.make_mesh(n_model)
    assert dict(mesh.shape) == {"data": n_data, "model": n_model}, mesh.shape
    return mesh


def train(workdir: Path, kind: str, layout: str, steps: int, *, resume: bool = False) -> Any:
    """`fit` of the kind of run on the layout, up to `steps` steps (resuming when asked)."""
    mesh = mesh_of(layout)
    model = TinyGPT(dropout=0.1, key=jax.random.key(0))
    options: dict[str, Any] = {}
    if kind == "lora":
        model = rc.lora.apply(model, ["query_proj", "value_proj"], rank=4, key=jax.random.key(1))
        options["trainable"] = rc.lora.trainable(model)
    accumulate = 2 if kind == "accumulate" else 1
    return rc.fit(
        model,
        optax.adamw(3e-3, eps=1e-5),
        examples(),
        collate_fn=collate_fn,
        loss_fn=loss_fn,
        mesh=mesh,
        per_device_batch_size=ROWS // accumulate // int(mesh.shape["data"]),
        accumulate_grad_batches=accumulate,
        fsdp=kind == "fsdp",
        max_steps=steps,
        workdir=workdir,
        resume=resume,
        checkpointing=rc.Checkpointing(every=2),
        log_every=1,
        progress=False,
        **options,
    )


def losses(workdir: Path) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def params(model: Any) -> list[np.ndarray]:
    """Every array of the model, gathered to the host (every process must call this)."""
    from jax.experimental import multihost_utils

    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in leaves]


def main() -> None:
    workdir, out, kind, layout, steps = sys.argv[1:6]
    result = train(Path(workdir), kind, layout, int(steps), resume="--resume" in sys.argv)
    arrays = params(result.model)
    if jax.process_index() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        np.savez(Path(out) / "params.npz", *arrays)
        (Path(out) / "losses.json").write_text(json.dumps(losses(Path(workdir))))


if __name__ == "__main__":
    main()
