"""Run every example at full length through `redcoast run` and check its quality bar.

Each example runs in its own process with its default options (8 simulated CPU
devices), so the wall time includes start-up and compilation. The table of results
(example, lines of code, metric reached, wall time) is printed and written to
examples/RESULTS.md; the exit status is 1 if any example misses its bar. A row of
VARIANTS runs an example with other options (finetune_lora: LoRA adapters only,
measured against the example's own row, which runs with it; finetune_qlora: rank-8
adapters on an NF4 base, measured against finetune_lora8, the same adapters on the
float32 base; finetune_functions: instruction records made from the standard library's
functions, packed with segment ids; finetune_joined: the same records packed with each
attending to the ones before it, measured against finetune_functions; preference_simpo:
SimPO in place of DPO).

Run: python scripts/run_examples.py [EXAMPLE ...]   (or `nox -s examples`)
"""

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from count_lines import code_lines

ROOT = Path(__file__).resolve().parents[1]


# example: (metric, "min" | "max", bar, wall-time limit in seconds or None)
BARS = {
    "classification": ("test_accuracy", "min", 0.97, None),
    "dp_sgd": ("test_accuracy", "min", 0.90, None),
    "evaluate": ("byte_perplexity_ratio", "max", 0.7, None),
    "fedavg": ("test_accuracy", "min", 0.93, None),
    "grpo": ("gain", "min", 0.4, 900.0),
    "finetune": ("ratio", "max", 0.7, None),
    "finetune_lora": ("gain_vs_full", "min", 0.9, None),
    "finetune_lora8": ("ratio", "max", 0.7, None),
    "finetune_qlora": ("gain_vs_lora", "min", 0.95, None),
    "finetune_functions": ("ratio", "max", 0.7, None),
    "finetune_joined": ("gain_vs_segments", "max", 1.0, None),
    "language_modeling": ("below_unigram", "min", 0.30, 300.0),
    "maml": ("mse_after_1_step", "max", 0.30, None),
    "ppo": ("mean_return", "min", 450.0, None),
    "preference": ("accuracy_after", "min", 0.85, None),
    "preference_simpo": ("accuracy_after", "min", 0.8, None),
    "captioning": ("rougeL", "min", 0.90, 300.0),
    "seq2seq": ("rougeL", "min", 0.90, 300.0),
    # 480 s: its prompt's tokens join the patches (21 tokens a step, not 16); 330-399 s seen.
    "text_to_image": ("recognised", "min", 0.80, 480.0),
    "vlm": ("accuracy_after", "min", 0.85, None),
}

# The examples that start from `_pretrained.py`'s base checkpoint (`--base-dir`).
BASED = ("finetune", "preference", "evaluate", "vlm")

# A second row of an example, run with other options: row -> (example, options).
VARIANTS = {
    "finetune_lora": (
        "finetune",
        ["--lora-table-rank", "6", "--learning-rate", "1e-2"],
    ),
    "finetune_lora8": ("finetune", ["--lora-rank", "8", "--learning-rate", "1e-2"]),
    "finetune_qlora": (
        "finetune",
        ["--lora-rank", "8", "--quantize", "nf4", "--learning-rate", "1e-2"],
    ),
    "finetune_functions": ("finetune", ["--instructions", "--seq-len", "256"]),
    "finetune_joined": (
        "finetune",
        ["--instructions", "--seq-len", "256", "--packing", "joined"],
    ),
    "preference_simpo": ("preference", ["--loss", "simpo"]),
}
# Bars of a variant measured against its example's row (both run together), and other
# bars: finetune_lora's held-out log-perplexity gain, log(before / after), is at least
# 0.9 x full fine-tuning's on the same data, and its AdamW state at most 2% of it;
# finetune_qlora's gain, counted from the float32 base's perplexity (its own row starts
# from the NF4 base's), is at least 0.95 x finetune_lora8's (QLoRA's claim: 4-bit base,
# same adapters, the 16-bit result). finetune_joined's gain, on the same held-out records
# each alone, is at most finetune_functions': rows whose documents see one another train
# no better for documents alone than rows that keep them apart. The preference rows'
# chosen answers lose at most 0.25 nats a token of held-out likelihood.
AGAINST = {
    "finetune_lora": "finetune",
    "finetune_qlora": "finetune_lora8",
    "finetune_joined": "finetune_functions",
}
ALSO = {
    "finetune_lora": [("opt_state", "max", 0.02)],
    "preference": [("chosen_logp_change", "min", -0.25)],
    "preference_simpo": [("chosen_logp_change", "min", -0.25)],
}


def _gain(metrics: dict, before: float | None = None) -> float | None:
    """log(before / after): the held-out log-perplexity gain, from `before` if given."""
    if "perplexity_after" not in metrics:
        return None
    start = metrics["perplexity_before"] if before is None else before
    return math.log(start / metrics["perplexity_after"])


def run(name: str, folder: Path, rows: dict[str, dict] | None = None) -> dict:
    """Run one example; return its metrics, wall time and whether it reached the bar."""
    out = folder / f"{name}.json"
    example, options = VARIANTS.get(name, (name, []))
    # The pretrained base these examples start from is built afresh by this run (once, by
    # its first row that needs it), never reused from an earlier run of other code.
    fresh = ["--base-dir", str(folder / "base")] if example in BASED else []
    cmd = [sys.executable, "-m", "redcoast", "run", example, *options, *fresh]
    cmd += ["--metrics-json", str(out)]
    print(f"$ redcoast run {' '.join([example, *options])}", flush=True)
    start = time.perf_counter()
    code = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}).returncode
    seconds = time.perf_counter() - start
    metrics = json.loads(out.read_text()) if code == 0 and out.is_file() else {}
    if name in AGAINST:
        reference = (rows or {})[AGAINST[name]]["metrics"]
        gain = _gain(metrics, reference.get("perplexity_before"))
        full = _gain(reference)
        if gain is not None and full:
            metrics[BARS[name][0]] = gain / full
        if metrics.get("step_s") and reference.get("step_s"):
            metrics["step_s_ratio"] = metrics["step_s"] / reference["step_s"]
    metric, mode, bar, limit = BARS[name]
    checks = [(metric, mode, bar), *ALSO.get(name, [])]
    values = [metrics.get(m) for m, _, _ in checks]
    reached = all(
        v is not None and (v >= b if mode == "min" else v <= b)
        for v, (_, mode, b) in zip(values, checks, strict=True)
    )
    in_time = limit is None or seconds < limit
    return {
        "example": " ".join([f"{example}.py", *options]),
        "lines": code_lines((ROOT / "examples" / f"{example}.py").read_text()),
        "metric": metric,
        "value": values[0],
        "bar": f"{'≥' if mode == 'min' else '≤'} {bar:g}"
        + (f" in < {limit:g} s" if limit else "")
        + "".join(f", {m} {'≥' if o == 'min' else '≤'} {b:g}" for m, o, b in checks[1:]),
        "passed": bool(reached and in_time),
        "seconds": seconds,
        "metrics": metrics,
        "exit_code": code,
    }


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| example | lines of code | metric | reached | bar | wall time | other metrics |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        value = "failed" if r["value"] is None else _fmt(r["value"])
        mark = "✓" if r["passed"] else "✗"
        others = ", ".join(f"{k} {_fmt(v)}" for k, v in r["metrics"].items() if k != r["metric"])
        lines.append(
            f"| `{r['example']}` | {r['lines']} | {r['metric']} | {value} {mark} | {r['bar']} "
            f"| {r['seconds']:.0f} s | {others} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", nargs="*", help=f"a subset of {sorted(BARS)}")
    parser.add_argument("--out", default=str(ROOT / "examples" / "RESULTS.md"))
    args = parser.parse_args()
    unknown = set(args.examples) - set(BARS)
    if unknown:
        parser.error(f"unknown examples {sorted(unknown)}; choose from {sorted(BARS)}")
    missing = {p.stem for p in (ROOT / "examples").glob("*.py") if p.stem[0] != "_"} - set(BARS)
    if missing:
        sys.exit(f"no quality bar for {sorted(missing)}: add one to BARS in {__file__}")
    names = args.examples or sorted(BARS)
    # A variant measured against its example's row runs after it, with it.
    names = sorted({*names, *(AGAINST[n] for n in names if n in AGAINST)}, key=sorted(BARS).index)
    done: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            done[name] = run(name, Path(folder), done)
    rows = list(done.values())
    body = table(rows)
    print(body)
    # A run of some examples keeps the other examples' rows from the last full run.
    out = Path(args.out)
    ran = {f"| `{r['example']}` |" for r in rows}
    kept = [
        line
        for line in (out.read_text().splitlines() if out.is_file() else [])
        if line.startswith("| `") and not any(line.startswith(r) for r in ran)
    ]
    head, rows_text = body.splitlines()[:2], body.splitlines()[2:]
    body = "\n".join(head + sorted(kept + rows_text))
    machine = (
        f"{os.cpu_count()} CPU cores, Python {platform.python_version()}, jax {version('jax')}"
    )
    out.write_text(
        "# Example results\n\n"
        "Generated by `nox -s examples` (scripts/run_examples.py); do not edit by hand.\n"
        "Each example ran once through `redcoast run EXAMPLE` with its default options on 8\n"
        "simulated CPU devices. Lines of code: non-blank, non-comment lines (docstrings\n"
        "count). Wall time includes start-up and compilation. The finetune and preference\n"
        "rows start from a base checkpoint the run pretrains afresh (once, in the first of\n"
        "them), never one left by an earlier run.\n\n"
        f"Machine: {machine}.\n\n" + body + "\n"
    )
    failed = [r["example"] for r in rows if not r["passed"]]
    if failed:
        sys.exit(f"below the bar: {', '.join(failed)}")


if __name__ == "__main__":
    main()
