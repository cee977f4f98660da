"""Mixtures of experts: only the chosen experts compute, measured against all of them.

A mixture's layer (a router and stacked SwiGLU experts, `rc.models.SparseMoE`) and
two small whole models (`rc.models.Mixtral`, `rc.models.Qwen3Moe`), each trained one
step (forward and backward) three ways: `dense` (every expert on every token, the
routing weights zero outside each token's top-k: what redcoast did before),
`dropless` (the routings sorted by expert, each expert applied to its own rows:
blocks of one expert's rows on CPU), and a capacity factor of 1.25 (static shapes,
the routings past an expert's capacity dropped).

Columns:
- `ms`: the step's wall time on this CPU (one device), the median of `--reps` runs
  after a warm-up, the contestants in turn within each repeat; `x dense` the median
  of the paired ratios (below 1: faster than every expert on every token).
- `FLOPs / chosen`: the expert matmuls' FLOPs the dispatch runs over those of the
  chosen experts alone (`18 x hidden x ffn` a routing, forward and backward): the
  dense path's is `experts / top_k`; dropless's counts each expert's last block's
  padding, from this batch's routing; the capacity path's is its static buffer.
- `TPU program FLOPs / chosen` (layers only): the matmul FLOPs of the dropless step
  as it is traced for a TPU (`jax.lax.ragged_dot`, each row meeting its expert's
  matrix once; counted by the planner's `matmul_flops`) over those of the chosen
  experts and the router. XLA:TPU's `cost_analysis` counts the weights' gradient
  (a ragged dot over the contracted rows) as dense, though its kernel skips the
  other experts' rows (`scripts/bench_maxtext.py --tpu --moe` reads the HLO).
- `temp MB`: the compiled CPU step's temporaries (`memory_analysis`).

Layer shapes: Mixtral's (8 experts, 2 a token) and Qwen3-MoE's (128 experts, 8 a
token) at a quarter of their widths (hidden 1024 / ffn 3584, hidden 512 / ffn 192),
2 sequences of 1,024 tokens, float32.

Run: python scripts/bench_moe.py [--reps 5]
     (prints the table; writes bench-results/bench_moe.json)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import redcoast as rc
from redcoast.models import Router, SparseMoE
from redcoast.nn._grouped import block_size

ROWS, TOKENS = 2, 1024
DISPATCHES: dict[str, Any] = {"dense": "dense", "dropless": "dropless", "capacity 1.25": 1.25}
LAYERS = {
    "Mixtral-shaped layer": dict(hidden=1024, ffn=3584, experts=8, top_k=2, router=Router()),
    "Qwen3-MoE-shaped layer": dict(
        hidden=512, ffn=192, experts=128, top_k=8, router=Router(normalize=True)
    ),
}
MODELS = {
    "Mixtral, 4 layers": lambda: rc.models.Mixtral(
        rc.models.MixtralConfig(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1792,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_local_experts=8,
        ),
        scan_layers=True,
        key=jax.random.key(0),
    ),
    "Qwen3-MoE, 4 layers": lambda: rc.models.Qwen3Moe(
        rc.models.Qwen3MoeConfig(
            vocab_size=4096,
            hidden_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            moe_intermediate_size=192,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=True,
        ),
        scan_layers=True,
        key=jax.random.key(0),
    ),
}


def _layer(shape: dict, dispatch: Any) -> SparseMoE:
    moe = SparseMoE(
        shape["hidden"],
        shape["ffn"],
        num_experts=shape["experts"],
        top_k=shape["top_k"],
        router=shape["router"],
        dispatch=dispatch,
        key=jax.random.key(0),
    )
    # A router that spreads the tokens as trained ones do, not the uniform init's ties.
    return eqx.tree_at(lambda m: m.gate.weight, moe, moe.gate.weight * 20.0)


def _layer_step(moe: SparseMoE) -> tuple[Any, tuple]:
    params, static = eqx.partition(moe, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(1), (ROWS, TOKENS, moe.w1.shape[-1]))

    def loss(params: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(jax.vmap(eqx.combine(params, static))(x) ** 2)

    return jax.jit(jax.value_and_grad(loss, (0, 1))), (params, x)


def _model_step(model: Any) -> tuple[Any, tuple]:
    params, static = eqx.partition(model, eqx.is_inexact_array)
    ids = jax.random.randint(jax.random.key(1), (ROWS, TOKENS), 0, model.config.vocab_size)

    def loss(params: Any, ids: jax.Array) -> jax.Array:
        return rc.models.lm_loss(eqx.combine(params, static), {"input_ids": ids})[0]

    return jax.jit(jax.value_and_grad(loss)), (params, ids)


def _flops_ratio(moe: SparseMoE, x: jax.Array, dispatch: Any) -> float:
    """The experts' matmul rows the dispatch computes over the chosen routings."""
    n, k = moe.w1.shape[0], moe.top_k
    chosen, _ = moe.route(jax.vmap(moe.logits)(x))
    routings = chosen.size
    if dispatch == "dense":
        return n / k
    if dispatch == "dropless":
        block = block_size(routings, n)  # the batch's rows are dispatched together
        sizes = np.bincount(np.asarray(chosen).ravel(), minlength=n)
        return float(sum(math.ceil(s / block) * block for s in sizes)) / routings
    capacity = max(1, math.ceil(dispatch * TOKENS * k / n))
    return n * capacity * ROWS / routings


def _ragged_flops(shape: dict) -> float:
    """The dropless step's matmul FLOPs as traced for a TPU (`jax.lax.ragged_dot`: each
    row meets one expert's matrix), over the chosen experts' and the router's."""
    from redcoast.nn._kernels import planned_for
    from redcoast.train.throughput import matmul_flops

    step, args = _layer_step(_layer(shape, "dropless"))
    with planned_for("tpu"):
        flops = matmul_flops(jax.make_jaxpr(step)(*args))[0]
    d, f, n, k = shape["hidden"], shape["ffn"], shape["experts"], shape["top_k"]
    tokens = ROWS * TOKENS
    return flops / (18 * d * f * tokens * k + 6 * d * n * tokens)


def _time(fns: dict[str, tuple[Any, tuple]], reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))
    for _ in range(reps):
        for name, (fn, args) in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return times


def _temp_mb(fn: Any, args: tuple) -> float:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 1e6


def _rows(title: str, fns: dict, reps: int, ratios: dict, tpu: float | None) -> list[dict]:
    times = _time(fns, reps)
    rows = []
    for name in fns:
        paired = [t / d for t, d in zip(times[name], times["dense"], strict=True)]
        rows.append(
            {
                "case": title,
                "dispatch": name,
                "ms": 1e3 * statistics.median(times[name]),
                "x_dense": statistics.median(paired),
                "flops_over_chosen": ratios.get(name),
                "tpu_program_flops_over_chosen": tpu if name == "dropless" else None,
                "temp_mb": _temp_mb(*fns[name]),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rows: list[dict] = []
    for title, shape in LAYERS.items():
        fns, ratios = {}, {}
        for name, dispatch in DISPATCHES.items():
            moe = _layer(shape, dispatch)
            fns[name] = _layer_step(moe)
            ratios[name] = _flops_ratio(moe, fns[name][1][1], dispatch)
        rows += _rows(title, fns, args.reps, ratios, _ragged_flops(shape))
    for title, make in MODELS.items():
        fns = {
            name: _model_step(rc.models.with_dispatch(make(), dispatch))
            for name, dispatch in DISPATCHES.items()
        }
        rows += _rows(title, fns, args.reps, {}, None)

    def fmt(v: float | None, spec: str) -> str:
        return "" if v is None else format(v, spec)

    print(
        "| case | dispatch | ms | x dense | FLOPs / chosen | TPU program FLOPs / chosen | temp MB |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['dispatch']} | {r['ms']:.0f} | {r['x_dense']:.2f} | "
            f"{fmt(r['flops_over_chosen'], '.2f')} | "
            f"{fmt(r['tpu_program_flops_over_chosen'], '.2f')} | {r['temp_mb']:.0f} |"
        )
    out = Path("bench-results/bench_moe.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
