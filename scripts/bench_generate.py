"""Tokens per second of `rc.models.generate` with the key/value cache and without, on CPU.

For each model of the decoder zoo (random weights, the same small size for all) and
each batch size in (1, 8), greedy generation of `--new` tokens after a `--prompt`-token
prompt is timed with `use_cache=True` (prefill once, then one token per step) and
`use_cache=False` (the whole sequence through the model at every step, as step-by-step
argmax without a cache does). Compilation is excluded and reported apart; each figure
is the median of `--repeats` timed calls. Both ways must produce the same tokens.

Target: the cache is faster at every batch size, by more as the sequence grows.

Run: python scripts/bench_generate.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

import redcoast as rc

KEY = jax.random.key(0)
VOCAB, HIDDEN, LAYERS, HEADS = 1024, 256, 4, 8
MODELS: dict[str, Callable[[int], rc.models.AbstractCausalLM]] = {
    "gpt2": lambda positions: rc.models.GPT2(
        rc.models.GPT2Config(
            vocab_size=VOCAB, n_positions=positions, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS
        ),
        key=KEY,
    ),
    "llama": lambda positions: rc.models.Llama(
        rc.models.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=688,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
        ),
        key=KEY,
    ),
    "opt": lambda positions: rc.models.OPT(
        rc.models.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            ffn_dim=4 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=positions,
        ),
        key=KEY,
    ),
    "gptj": lambda positions: rc.models.GPTJ(
        rc.models.GPTJConfig(
            vocab_size=VOCAB,
            n_positions=positions,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            rotary_dim=HIDDEN // HEADS // 2,
        ),
        key=KEY,
    ),
}


def measure(
    model: rc.models.AbstractCausalLM, prompt: jax.Array, new: int, use_cache: bool, repeats: int
) -> tuple[float, float, np.ndarray]:
    """(compile + first call seconds, median seconds of a call, the tokens)."""
    start = time.perf_counter()
    tokens = jax.block_until_ready(
        rc.models.generate(model, prompt, max_new_tokens=new, use_cache=use_cache)
    )
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(
            rc.models.generate(model, prompt, max_new_tokens=new, use_cache=use_cache)
        )
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), np.asarray(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="generated tokens")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="bench-results/bench_generate.json")
    args = parser.parse_args()
    positions = args.prompt + args.new
    rng = np.random.default_rng(0)
    rows = []
    start = time.perf_counter()
    for name in args.models:
        model = MODELS[name](positions)
        for batch in args.batches:
            prompt = jax.numpy.asarray(rng.integers(0, VOCAB, (batch, args.prompt)), "int32")
            result = {}
            for use_cache in (True, False):
                result[use_cache] = measure(model, prompt, args.new, use_cache, args.repeats)
            (c_first, c_time, c_tokens), (n_first, n_time, n_tokens) = result[True], result[False]
            rows.append(
                {
                    "model": name,
                    "batch": batch,
                    "cache_tokens_per_s": batch * args.new / c_time,
                    "no_cache_tokens_per_s": batch * args.new / n_time,
                    "speedup": n_time / c_time,
                    "cache_compile_s": c_first - c_time,
                    "no_cache_compile_s": n_first - n_time,
                    "same_tokens": bool((c_tokens == n_tokens).all()),
                }
            )
            print(f"  measured {name} at batch {batch}", flush=True)

    header = (
        f"{'model':6} {'batch':>5} {'cache tok/s':>12} {'no-cache tok/s':>15} {'speedup':>8} "
        f"{'compile s (cache/no)':>21} {'same tokens':>11}"
    )
    print(
        f"\ngreedy generate on {jax.devices()[0].platform}: {args.prompt}-token prompt, "
        f"{args.new} new tokens, hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        compile_s = f"{r['cache_compile_s']:.1f} / {r['no_cache_compile_s']:.1f}"
        print(
            f"{r['model']:6} {r['batch']:>5} {r['cache_tokens_per_s']:12.1f} "
            f"{r['no_cache_tokens_per_s']:15.1f} {r['speedup']:8.2f} {compile_s:>21} "
            f"{r['same_tokens']!s:>11}"
        )
    slowest = min(r["speedup"] for r in rows)
    print(
        f"\nsmallest speedup from the cache: {slowest:.2f}x (target > 1); tokens equal with "
        f"and without: {all(r['same_tokens'] for r in rows)}; "
        f"{time.perf_counter() - start:.0f} s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"prompt": args.prompt, "new": args.new, "hidden": HIDDEN, "layers": LAYERS}
    out.write_text(json.dumps({"rows": rows, "settings": settings}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
