"""The LM Evaluation Harness through redcoast and through its own `hf` backend: the
same tasks on the same checkpoint, requests per second.

The tasks are the three redcoast ships (`redcoast_stdlib_choice`: 200 questions of 4
choices, 800 log-likelihoods; `redcoast_stdlib_source`: 50 functions' rolling
log-likelihood; `redcoast_stdlib_line`: 100 lines generated to the newline). The
checkpoint is a GPT-2 of 6 layers, width 512 and 1,024 positions (random weights; a
4,096-id byte-level BPE trained on Python's documentation), written with `to_hf`,
which both backends read; batches of `--batch-size` requests (16).

Rows:
- `hf`: lm-eval's `HFLM(pretrained=FOLDER)`, PyTorch on this CPU.
- `redcoast, 1 device`: `RedcoastLM(FOLDER)` on one CPU device.
- `redcoast, 8 devices, TP 2`: 8 simulated CPU devices, the model split in 2 and the
  requests over 4 (the devices share this machine's cores: it measures the overhead
  of the split, not a speed-up).

Columns: `load s`, the model and tokenizer read; `first s`, the load and the first
`simple_evaluate` (the harness building its requests, redcoast compiling a program per
padded length, the model); `again s`, the same evaluation again on the loaded model
(the programs compiled: what an evaluation every N steps of `fit` costs); `x hf`, the
speed over `hf`'s (its seconds over the backend's). The tasks' requests are the same for
each backend, and each backend's answers are checked equal to `hf`'s (log-likelihoods
to 1e-4 or a millionth of their size, greedy flags and generations identical) before a
row is printed.

Run: python scripts/bench_eval.py [--batch-size 16] [--limit N]
     (prints the table; writes bench-results/bench_eval.json)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

TASKS = ["redcoast_stdlib_choice", "redcoast_stdlib_source", "redcoast_stdlib_line"]


def make_checkpoint(folder: Path) -> Path:
    """The GPT-2-shaped checkpoint and its tokenizer, once."""
    if (folder / "config.json").is_file():
        return folder
    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from pydoc_data.topics import topics

    from _pretrained import _tokenizer

    from redcoast.models import GPT2, GPT2Config

    tok = _tokenizer([topics[k] for k in sorted(topics)], 4096)
    config = GPT2Config(vocab_size=4096, n_positions=1024, n_embd=512, n_layer=6, n_head=8)
    GPT2(config, key=jax.random.key(0)).to_hf(folder)
    tok.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def run_one(backend: str, folder: str, batch_size: int, limit: int | None, out: str) -> None:
    """One backend: its model loaded, then `simple_evaluate` twice (the second finds the
    programs compiled), timed, the first's answers written to `out`."""
    import lm_eval

    import redcoast.eval as rce

    start = time.perf_counter()
    if backend == "hf":
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=folder, device="cpu", batch_size=batch_size)
    else:
        shards = 2 if backend == "tp" else 1
        lm = rce.RedcoastLM(folder, n_model_shards=shards, batch_size=batch_size)
    record = {"load_s": time.perf_counter() - start}
    tasks = rce.task_manager()
    for run in ("first", "again"):
        start = time.perf_counter()
        results = lm_eval.simple_evaluate(
            model=lm, tasks=TASKS, task_manager=tasks, limit=limit, log_samples=True
        )
        record[f"{run}_s"] = time.perf_counter() - start
        assert results is not None
        if run == "first":
            record["samples"] = {t: [s["resps"] for s in results["samples"][t]] for t in TASKS}
    record["requests"] = sum(len(r) for t in TASKS for r in record["samples"][t])
    Path(out).write_text(json.dumps(record, default=float))


def _leaves(x: object) -> list:
    return [y for z in x for y in _leaves(z)] if isinstance(x, list | tuple) else [x]


def _same(a: dict, b: dict) -> None:
    """The same answers: strings and greedy flags equal, log-likelihoods to 1e-4 (or a
    millionth of their size: a long function's sums over a thousand float32 terms)."""
    for task in TASKS:
        for x, y in zip(_leaves(a[task]), _leaves(b[task]), strict=True):
            if isinstance(x, float) and not isinstance(x, bool):
                assert abs(x - y) <= max(1e-4, 1e-6 * abs(y)), (task, x, y)
            else:
                assert x == y, (task, x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--checkpoint", default="bench-results/eval-gpt2")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args.one[0], args.checkpoint, args.batch_size, args.limit, args.one[1])
        return
    folder = make_checkpoint(Path(args.checkpoint))
    rows = {"hf": "hf", "one": "redcoast, 1 device", "tp": "redcoast, 8 devices, TP 2"}
    devices = {"hf": 1, "one": 1, "tp": 8}
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in rows:
            out = os.path.join(tmp, f"{backend}.json")
            env = {
                **os.environ,
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices[backend]}",
            }
            command = [sys.executable, __file__, "--one", backend, out]
            command += ["--checkpoint", str(folder), "--batch-size", str(args.batch_size)]
            command += ["--limit", str(args.limit)] if args.limit else []
            subprocess.run(command, env=env, check=True, capture_output=True)
            records[backend] = json.loads(Path(out).read_text())
            print(f"{rows[backend]}: {records[backend]['again_s']:.1f} s again", flush=True)
    table = []
    hf = records["hf"]
    for backend, name in rows.items():
        r = records[backend]
        _same(r["samples"], hf["samples"])
        first, again = r["load_s"] + r["first_s"], r["again_s"]
        table.append(
            {
                "backend": name,
                "requests": r["requests"],
                "load_s": r["load_s"],
                "first_s": first,
                "again_s": again,
                "x_hf_first": (hf["load_s"] + hf["first_s"]) / first,
                "x_hf_again": hf["again_s"] / again,
            }
        )
    print(
        f"{'backend':<28} {'requests':>8} {'load s':>7} {'first s':>8} {'again s':>8} "
        f"{'x hf first':>10} {'x hf again':>10}"
    )
    for t in table:
        print(
            f"{t['backend']:<28} {t['requests']:8d} {t['load_s']:7.1f} {t['first_s']:8.1f} "
            f"{t['again_s']:8.1f} {t['x_hf_first']:10.2f} {t['x_hf_again']:10.2f}"
        )
    Path("bench-results").mkdir(exist_ok=True)
    meta = {"batch_size": args.batch_size, "limit": args.limit, "tasks": TASKS}
    Path("bench-results/bench_eval.json").write_text(json.dumps({**meta, "rows": table}, indent=2))


if __name__ == "__main__":
    main()
