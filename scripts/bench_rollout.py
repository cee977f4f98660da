"""Rollout tokens/s: `rc.sampling.sample` against `transformers`' `generate` on one model.

An RL step samples `--samples` completions of each of `--prompts` prompts. Both sides
run the same Llama (built by transformers from a config, random weights, saved and
loaded into redcoast with `rc.models.from_hf`) on the CPU, the same prompts
(`--prompt` tokens), `--new` new tokens, with the same filters: temperature 1 and no
top-k or top-p (transformers' default top-k of 50 switched off), and greedy. Rows:

- `sample T=1` and `greedy`: no EOS, so every row generates `--new` tokens and the
  tokens/s count the same work on both sides.
- `sample T=1, EOS`: an EOS that ends each row early. The head's EOS row reads one
  hidden dimension which the embeddings hold constant, so every step ends a row with
  about the same probability (`--eos-logit` sets it) and lengths spread as in a
  rollout; both sides stop once every row has ended. The tokens/s count each row's
  tokens up to its EOS. Called as is, `sample` drops the rows that have ended as the
  batch halves; `redcoast 1 loop` calls it inside `jax.jit`, where one loop steps
  every row until the last has ended (what `sample` did before).

transformers repeats each prompt `--samples` times before its prefill
(`num_return_sequences`); redcoast prefills each prompt once and shares its cache.
Greedy decoding in transformers takes no `num_return_sequences`, so there both
sides get the prompts already repeated. torch runs on `--threads` threads
(`torch.set_num_threads`); XLA's CPU client uses one thread per core, so give the
machine's core count. Compilation (redcoast) and the first call (both) are excluded
and the compile time reported apart. Each repeat runs the two sides back to back;
times and tokens/s are medians over `--repeats` repeats, and the speedup is the
median of the repeats' ratios (the machine is shared: load moves both sides alike
within a repeat).

Then the share of a GRPO step spent sampling: `--grpo-steps` steps of `rc.rl.train`
on the same model, prompts (as text of a word-level tokenizer whose words are the
token ids), `--samples` completions of `--new` tokens (TRL's GRPO defaults
otherwise, the same EOS), a reward that costs nothing (each completion's length),
once with LoRA (rank 16 on every projection) and once fine-tuning every weight.
From the run's records (`log_every=1`; the first step, which compiles, left out),
medians of `step_s` and of the rollout's `time/sampling_s` and `time/rewards_s`;
training is the rest.

Target: redcoast >= 2x transformers' tokens/s on every row.

Run: python scripts/bench_rollout.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers
import torch
import transformers

import redcoast as rc

EOS = 2
# The hidden dimension the EOS trick uses: the embeddings hold it constant.
CONSTANT_DIM = 0


def hf_model(args: argparse.Namespace) -> Any:
    """A random Llama whose EOS logit is about `--eos-logit` above the others at every step."""
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.new,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for weight in model.parameters():
            if weight.ndim == 2:  # Llama's initialisation (initializer_range 0.02)
                weight.normal_(0.0, 0.02)
                # No layer reads or writes the constant dimension: it stays 1 to the end.
                if weight.shape[1] == args.hidden:
                    weight[:, CONSTANT_DIM] = 0.0
                if weight.shape[0] == args.hidden:
                    weight[CONSTANT_DIM] = 0.0
        model.model.embed_tokens.weight[:, CONSTANT_DIM] = 1.0
        ids = torch.randint(3, args.vocab, (4, args.prompt))
        constant = model.model(ids).last_hidden_state[..., CONSTANT_DIM].mean()
        model.lm_head.weight[EOS] = 0.0
        model.lm_head.weight[EOS, CONSTANT_DIM] = args.eos_logit / constant
    return model


def completion_lengths(tokens: np.ndarray, eos: int | None) -> np.ndarray:
    """Each row's tokens up to and including its first EOS (all of them without one)."""
    if eos is None:
        return np.full(len(tokens), tokens.shape[1])
    ended = tokens == eos
    return np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, tokens.shape[1])


def ours(
    model: Any,
    prompts: np.ndarray,
    args: argparse.Namespace,
    greedy: bool,
    eos: int | None,
    one_loop: bool = False,
) -> Callable[[int], np.ndarray]:
    ids = jnp.asarray(prompts)

    def call(model: Any, ids: jax.Array, key: jax.Array) -> jax.Array:
        out = rc.sampling.sample(
            model,
            ids,
            num_samples=args.samples,
            max_new_tokens=args.new,
            temperature=0.0 if greedy else 1.0,
            eos_id=eos,
            key=key,
        )
        return out.tokens

    if one_loop:  # inside a trace: one loop, every row stepped until the last ends
        call = eqx.filter_jit(call)

    def run(seed: int) -> np.ndarray:
        return np.asarray(jax.block_until_ready(call(model, ids, jax.random.key(seed))))

    return run


def theirs(
    model: Any, prompts: np.ndarray, args: argparse.Namespace, greedy: bool, eos: int | None
) -> Callable[[int], np.ndarray]:
    ids = torch.tensor(prompts, dtype=torch.long)
    if greedy:  # transformers' greedy search returns one sequence per row
        ids = ids.repeat_interleave(args.samples, dim=0)

    def run(seed: int) -> np.ndarray:
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=not greedy,
                num_return_sequences=1 if greedy else args.samples,
                max_new_tokens=args.new,
                min_new_tokens=0,
                temperature=1.0,
                # transformers samples from the 50 most likely tokens unless told otherwise.
                top_k=None if greedy else 0,
                eos_token_id=eos,
                pad_token_id=EOS if eos is not None else 0,
            )
        new = out[:, ids.shape[1] :].numpy()
        # transformers stops early once every row is done; pad as redcoast returns.
        return np.pad(new, ((0, 0), (0, args.new - new.shape[1])), constant_values=EOS)

    return run


def timed(run: Callable[[int], np.ndarray], seed: int) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    tokens = run(seed)
    return time.perf_counter() - start, tokens


SETTINGS = [("sample T=1", False, None), ("greedy", True, None), ("sample T=1, EOS", False, EOS)]
# (header, width, format, row key): add a column by adding its row key and a line here.
COLUMNS = [
    ("setting", 16, "{}", "setting"),
    ("side", 16, "{}", "side"),
    ("median s", 9, "{:.3f}", "seconds"),
    ("tokens/s", 9, "{:.0f}", "tokens_per_s"),
    ("x HF", 6, "{:.2f}", "speedup"),
    ("mean len", 8, "{:.1f}", "mean_length"),
    ("steps", 5, "{}", "steps"),
    ("compile s", 9, "{:.1f}", "compile_s"),
]


def measure(args: argparse.Namespace, model: Any, ported: Any, prompts: np.ndarray) -> list[dict]:
    rows = []
    for setting, greedy, eos in SETTINGS:
        sides = {"redcoast": ours(ported, prompts, args, greedy, eos)}
        if eos is not None:
            sides["redcoast 1 loop"] = ours(ported, prompts, args, greedy, eos, one_loop=True)
        sides["transformers"] = theirs(model, prompts, args, greedy, eos)
        first = {name: timed(run, 0)[0] for name, run in sides.items()}
        calls: dict[str, list[tuple[float, np.ndarray]]] = {name: [] for name in sides}
        for repeat in range(args.repeats):
            for name, run in sides.items():
                seconds, tokens = timed(run, repeat + 1)
                calls[name].append((seconds, completion_lengths(tokens, eos)))
        # Each call's tokens (up to EOS) over its time.
        speed = {n: [float(k.sum()) / t for t, k in c] for n, c in calls.items()}
        for name, made in calls.items():
            seconds = statistics.median(t for t, _ in made)
            lengths = np.stack([k for _, k in made])
            rows.append(
                {
                    "setting": setting,
                    "side": name,
                    "seconds": seconds,
                    "tokens_per_s": statistics.median(speed[name]),
                    "speedup": statistics.median(
                        a / b for a, b in zip(speed[name], speed["transformers"], strict=True)
                    ),
                    "mean_length": float(lengths.mean()),
                    "steps": int(np.median(lengths.max(axis=1))),
                    "compile_s": first[name] - seconds if name != "transformers" else 0.0,
                }
            )
        print(f"  measured {setting}", flush=True)
    return rows


# (header, width, format, row key) of the GRPO table.
GRPO_COLUMNS = [
    ("run", 6, "{}", "run"),
    ("step s", 7, "{:.2f}", "step_s"),
    ("sampling s", 10, "{:.2f}", "sampling_s"),
    ("rewards s", 9, "{:.3f}", "rewards_s"),
    ("training s", 10, "{:.2f}", "training_s"),
    ("sampling %", 10, "{:.0f}", "sampling_pct"),
    ("mean len", 8, "{:.1f}", "mean_length"),
]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def word_tokenizer(vocab: int) -> rc.text.Tokenizer:
    """A tokenizer whose words are the token ids (`w17` is 17): prompts as text, for
    `rc.rl.train`, that tokenize to the very ids the sampling rows use."""
    words = {"<unk>": 0, "<bos>": 1, "<eos>": EOS, **{f"w{i}": i for i in range(3, vocab)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return rc.text.load_tokenizer(tok, eos_id=EOS)


def completion_length(prompts: list, completions: list, completion_ids: list, **_: Any) -> list:
    """A reward that costs nothing to compute: each completion's length in tokens."""
    return [float(len(c)) for c in completion_ids]


def median_step(records: list[dict]) -> dict[str, Any]:
    """A run's median step (each record one step; the first, which compiles, left out):
    its seconds sampling, scoring and training (the rest), and the completions' length."""
    steps = [
        {
            "step_s": r["step_s"],
            "sampling_s": r["time/sampling_s"],
            "rewards_s": r["time/rewards_s"],
            "training_s": r["step_s"] - r["time/sampling_s"] - r["time/rewards_s"],
            "sampling_pct": 100 * r["time/sampling_s"] / r["step_s"],
            "mean_length": r["completions/mean_length"],
        }
        for r in records[1:]
    ]
    return {k: statistics.median(s[k] for s in steps) for k in steps[0]} | {"steps": len(steps)}


def grpo_share(args: argparse.Namespace, load: Callable[[], Any], prompts: np.ndarray) -> list:
    """A LoRA and a full GRPO run's median step: sampling, rewards and training seconds."""
    tok = word_tokenizer(args.vocab)
    records = [{"prompt": " ".join(f"w{t}" for t in p)} for p in prompts]
    algorithm = rc.rl.GRPO(num_generations=args.samples, max_new_tokens=args.new)
    rows = []
    for run in ("LoRA", "full"):
        model, options = load(), {}
        if run == "LoRA":
            model = rc.lora.apply(model, LORA_TARGETS, rank=16, key=jax.random.key(0))
            options["trainable"] = rc.lora.trainable(model)
        result = rc.rl.train(
            model,
            optax.adamw(1e-5),
            records,
            rewards=completion_length,
            tokenizer=tok,
            per_device_batch_size=args.prompts,
            algorithm=algorithm,
            max_steps=args.grpo_steps,
            log_every=1,
            progress=False,
            **options,
        )
        rows.append({"run": run, **median_step(result.history["train"])})
        print(f"  measured GRPO, {run}", flush=True)
    return rows


def table(columns: list, rows: list[dict]) -> None:
    header = " ".join(f"{h:>{w}}" for h, w, _, _ in columns)
    print(header)
    print("-" * len(header))
    for r in rows:
        print(" ".join(f"{f.format(r[k]):>{w}}" for _, w, f, k in columns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="new tokens per completion")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--eos-logit", type=float, default=6.6)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grpo-steps", type=int, default=5, help="at least 2; 0: none")
    parser.add_argument("--out", default="bench-results/bench_rollout.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    model = hf_model(args)
    params = sum(p.numel() for p in model.parameters())
    prompts = np.random.default_rng(0).integers(3, args.vocab, (args.prompts, args.prompt))
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        rows = measure(args, model, rc.models.from_hf(folder), prompts.astype(np.int32))
        load = lambda: rc.models.from_hf(folder)  # noqa: E731
        grpo = grpo_share(args, load, prompts) if args.grpo_steps > 1 else []

    print(
        f"\nrollout on {jax.devices()[0].platform} ({args.threads} torch threads, uptime load "
        f"{os.getloadavg()[0]:.1f}): Llama {params / 1e6:.1f}M parameters, {args.prompts} "
        f"prompts x {args.samples} samples, {args.prompt}-token prompts, {args.new} new tokens"
    )
    table(COLUMNS, rows)
    slowest = min(r["speedup"] for r in rows if r["side"] == "redcoast")
    print(f"\nsmallest speedup over transformers: {slowest:.2f}x (target >= 2)")
    if grpo:
        print(f"\na GRPO step (rc.rl.train), median of steps 2-{args.grpo_steps}:")
        table(GRPO_COLUMNS, grpo)
    print(f"\n{time.perf_counter() - start:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"rows": rows, "grpo": grpo, "settings": settings, "parameters": params}
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
