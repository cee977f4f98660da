"""Sequence parallelism beside tensor parallelism alone: speed, traffic and activations.

On 8 simulated CPU devices at meshes (data x model) 4x2 and 2x4, bench_peer's GPT
(vocabulary 1024, hidden 256, 4 layers, 8 heads, 128 tokens, 32 sequences of real
text, AdamW) and a LLaMA of the same size (SwiGLU, RMSNorm, rotary positions,
scanned layers) are stepped by `rc.train_step` without and with
`sequence_parallel=True`. For each: steps/s (paired medians over repeats in
rotating order), the compiled step's temporary bytes per device, and its
model-axis collectives from the HLO (`tests/hlo.py`):

- "result MB": the bytes of every collective's result, summed (bench_comm's figure);
- "ring MB": what each device sends in a ring, `2 (n-1)/n` of an all-reduce's
  result and `(n-1)/n` of an all-gather's, the figure link time follows.

XLA:CPU has no reduce-scatter pass (GPU's `ReduceScatterCreator`): where the
partitioner scatters a partial sum it emits an all-reduce and a slice, which the
table counts as the all-reduce it is. So on this backend the split adds its
all-gathers to tensor parallelism's all-reduces; on GPU the all-reduces become
reduce-scatters of half their ring bytes.

Targets (issue 25): steps/s with the split >= 0.95 x without; model-axis bytes
<= 1.02 x without.

Run: python scripts/bench_seq_parallel.py   (writes bench-results/bench_seq_parallel.json)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", 8)

import redcoast as rc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # hlo.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_peer.py
from bench_peer import D, H, L, S, V, paired, text_ids, zoo_loss
from hlo import collectives

LR = 1e-3


def models() -> dict[str, eqx.Module]:
    gpt = rc.models.GPT2Config(vocab_size=V, n_positions=S, n_embd=D, n_layer=L, n_head=H)
    llama = rc.models.LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=4 * D,
        num_hidden_layers=L,
        num_attention_heads=H,
        max_position_embeddings=S,
    )
    return {
        "GPT": rc.models.GPT2(gpt, key=jax.random.key(0)),
        "LLaMA (scanned)": rc.models.Llama(llama, scan_layers=True, key=jax.random.key(0)),
    }


def ring_bytes(op: str, nbytes: int, n: int) -> float:
    share = (n - 1) / n
    return {"all-reduce": 2 * share, "all-gather": share, "reduce-scatter": n - 1}.get(op, 1.0) * (
        nbytes
    )


def row(model: eqx.Module, mesh: Any, ids: np.ndarray, split: bool) -> tuple[dict, Any]:
    """The compiled step's figures, and a runner for `paired`."""
    n_model = mesh.shape["model"]
    batch = {"ids": jax.device_put(ids, NamedSharding(mesh, P("data")))}
    # A copy per row: each row's step donates its own arrays.
    model = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
    placed = rc.place(model, mesh, example_call=lambda m: zoo_loss(m, batch, None))
    opt = optax.adamw(LR)
    state = (placed, opt.init(eqx.filter(placed, eqx.is_inexact_array)))
    step: Any = rc.train_step(zoo_loss, opt, mesh=mesh, sequence_parallel=split)
    key = jax.random.key(0)
    compiled = step.lower(*state, batch, key).compile().compiled
    found = [c for c in collectives(compiled.as_text(), mesh) if c.axis == "model"]
    ops: dict[str, int] = {}
    for c in found:
        ops[c.op] = ops.get(c.op, 0) + 1
    figures = {
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "result_bytes": sum(c.nbytes for c in found),
        "ring_bytes": sum(ring_bytes(c.op, c.nbytes, n_model) for c in found),
        "ops": ops,
    }
    holder = {"state": state}

    def run(n: int) -> float:
        loss = None
        for _ in range(n):
            m, s, metrics = step(*holder["state"], batch, key)
            holder["state"] = (m, s)
            loss = metrics["loss"]
        return float(loss)

    return figures, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per timed run")
    parser.add_argument("--reps", type=int, default=7, help="paired repeats")
    parser.add_argument("--meshes", default="4x2,2x4", help="data x model meshes")
    parser.add_argument("--out", default="bench-results/bench_seq_parallel.json")
    args = parser.parse_args()
    ids = text_ids()
    results = []
    print(
        "| model | mesh | steps/s TP | steps/s TP + SP | ratio | temp MB TP | temp MB TP + SP "
        "| model-axis result MB TP / TP + SP | ring MB TP / TP + SP | collectives TP + SP |"
    )
    print("|" + "---|" * 10)
    for name, model in models().items():
        for shape in args.meshes.split(","):
            n_model = int(shape.split("x")[1])
            mesh = rc.make_mesh(n_model)
            tp, run_tp = row(model, mesh, ids, False)
            sp, run_sp = row(model, mesh, ids, True)
            timing = paired({"tp": run_tp, "sp": run_sp}, args.steps, args.reps, "tp")
            rate = timing["steps_per_s"]
            ratio = 1 / timing["ratio"]["sp"]  # paired median of sp / tp
            mb = 1e6
            print(
                f"| {name} | {shape} | {rate['tp']:.2f} | {rate['sp']:.2f} | {ratio:.2f} "
                f"| {tp['temp_bytes'] / mb:.1f} | {sp['temp_bytes'] / mb:.1f} "
                f"| {tp['result_bytes'] / mb:.2f} / {sp['result_bytes'] / mb:.2f} "
                f"| {tp['ring_bytes'] / mb:.2f} / {sp['ring_bytes'] / mb:.2f} "
                f"| {', '.join(f'{v} {k}' for k, v in sorted(sp['ops'].items()))} |",
                flush=True,
            )
            results.append(
                {
                    "model": name,
                    "mesh": shape,
                    "tp": tp,
                    "tp_sp": sp,
                    "steps_per_s": rate,
                    "sp_over_tp_steps_per_s": ratio,
                    "losses": timing["last_loss"],
                }
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
