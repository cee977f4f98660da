"""Sequence parallelism beside tensor parallelism alone: speed, traffic and activations.

On 8 simulated CPU devices at meshes (data x model) 4x2 and 2x4, bench_peer's GPT
(vocabulary 1024, hidden 256, 4 layers, 8 heads, 128 tokens, 32 sequences of real
text, AdamW) and a LLaMA of the same size (SwiGLU, RMSNorm, rotary positions,
scanned layers) are stepped by `rc.train_step` three ways: tensor
parallelism alone ("TP"), with `sequence_parallel=True` ("SP", each gathered input
gathered again in the backward pass) and with
`sequence_parallel=rc.SequenceParallel.of(model, keep_gathered=True)` ("SP keep",
each gathered input kept). For each: steps/s (paired medians over repeats in
rotating order), the compiled step's temporary bytes per device, and its
model-axis collectives from the HLO (`tests/hlo.py`), as the bytes each device
sends in a ring: `2 (n-1)/n` of an all-reduce's result, `(n-1)/n` of an
all-gather's result and of a reduce-scatter's input.

- "ring MB, as run": the collectives XLA:CPU runs. It has no reduce-scatter pass,
  so a scattered partial sum runs as an all-reduce and a slice of it.
- "ring MB, scatters as reduce-scatters": the same program with each all-reduce
  of which every device reads only its own slice (`hlo.scattered_all_reduces`)
  counted as the reduce-scatter XLA's GPU and TPU compilers make of it.

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
from hlo import collectives, ring_bytes, scattered_all_reduces

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


SPLITS = {"TP": False, "SP": "regather", "SP keep": "keep"}


def row(model: eqx.Module, mesh: Any, ids: np.ndarray, how: str | bool) -> tuple[dict, Any]:
    """The compiled step's figures, and a runner for `paired`."""
    n_model = mesh.shape["model"]
    batch = {"ids": jax.device_put(ids, NamedSharding(mesh, P("data")))}
    # A copy per row: each row's step donates its own arrays.
    model = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
    placed = rc.place(model, mesh, example_call=lambda m: zoo_loss(m, batch, None))
    opt = optax.adamw(LR)
    state = (placed, opt.init(eqx.filter(placed, eqx.is_inexact_array)))
    split = how and rc.SequenceParallel.of(placed, keep_gathered=how == "keep")
    step: Any = rc.train_step(zoo_loss, opt, mesh=mesh, sequence_parallel=split)
    key = jax.random.key(0)
    compiled = step.lower(*state, batch, key).compile().compiled
    text = compiled.as_text()
    found = [c for c in collectives(text, mesh) if c.axis == "model"]
    scattered = scattered_all_reduces(text)
    ops: dict[str, int] = {}
    for c in found:
        op = "reduce-scatter" if c.name in scattered else c.op
        ops[op] = ops.get(op, 0) + 1
    figures = {
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "result_bytes": sum(c.nbytes for c in found),
        "ring_bytes": ring_bytes(found, n_model),
        "ring_bytes_reduce_scatter": ring_bytes(found, n_model, scattered),
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


def each(figs: dict[str, dict], key: str, f: str) -> str:
    """One figure of every split, in MB: `TP / SP / SP keep`."""
    return " / ".join(format(figs[k][key] / 1e6, f) for k in SPLITS)


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
        "| model | mesh | steps/s TP / SP / SP keep | SP ÷ TP | SP keep ÷ TP | temp MB "
        "TP / SP / SP keep | ring MB as run, TP / SP / SP keep | ring MB, scatters as "
        "reduce-scatters, TP / SP / SP keep | ÷ TP | collectives SP |"
    )
    print("|" + "---|" * 10)
    for name, model in models().items():
        for shape in args.meshes.split(","):
            mesh = rc.make_mesh(int(shape.split("x")[1]))
            figs, runs = {}, {}
            for label, how in SPLITS.items():
                figs[label], runs[label] = row(model, mesh, ids, how)
            timing = paired(runs, args.steps, args.reps, "TP")
            rate = timing["steps_per_s"]
            ratio = {k: 1 / v for k, v in timing["ratio"].items()}  # paired medians of x / TP

            rs = {k: figs[k]["ring_bytes_reduce_scatter"] for k in SPLITS}
            print(
                f"| {name} | {shape} | {' / '.join(f'{rate[k]:.2f}' for k in SPLITS)} "
                f"| {ratio['SP']:.2f} | {ratio['SP keep']:.2f} | {each(figs, 'temp_bytes', '.1f')} "
                f"| {each(figs, 'ring_bytes', '.2f')} "
                f"| {each(figs, 'ring_bytes_reduce_scatter', '.2f')} "
                f"| {rs['SP'] / rs['TP']:.3f} / {rs['SP keep'] / rs['TP']:.3f} "
                f"| {', '.join(f'{v} {k}' for k, v in sorted(figs['SP']['ops'].items()))} |",
                flush=True,
            )
            results.append(
                {
                    "model": name,
                    "mesh": shape,
                    "figures": figs,
                    "steps_per_s": rate,
                    "over_tp_steps_per_s": ratio,
                    "losses": timing["last_loss"],
                }
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
