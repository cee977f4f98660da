"""Score a model before and after fine-tuning with the LM Evaluation Harness, sharded.

The harness's own tasks run on redcoast's model where it is (`rc.eval`: `lm_eval`'s
`LM` interface over `rc.predict`): here the three tasks redcoast ships, made from the
standard library's source (`rc.eval.TASKS`): which of four lines begins a function's
body given its signature and docstring (`redcoast_stdlib_choice`, accuracy), that line
generated to its end (`redcoast_stdlib_line`, exact match), and whole functions'
bits per byte (`redcoast_stdlib_source`). With no arguments it runs offline: the small
GPT-2 pretrained on Python's documentation (`redcoast pretrained`, built once into
`--base-dir`) is scored, fine-tuned on the standard library's source by the finetune
example (once, into `--tuned`), and scored again. Needs the `eval` extra
(`pip install 'redcoast[eval]'`).
"""

import math
from pathlib import Path

import lm_eval
from _pretrained import base_checkpoint
from finetune import main as finetune

import redcoast.eval as rce

TASKS = ["redcoast_stdlib_choice", "redcoast_stdlib_line", "redcoast_stdlib_source"]
# What each task reports, and the name this example gives it.
REPORTED = {
    "redcoast_stdlib_choice": ("acc,none", "choice_accuracy"),
    "redcoast_stdlib_line": ("exact_match,none", "line_exact_match"),
    "redcoast_stdlib_source": ("bits_per_byte,none", "source_bits_per_byte"),
}


def score(
    folder: Path, tasks: object, n_model_shards: int, batch_size: int, limit: int | None
) -> dict:
    """The tasks' figures for the checkpoint in `folder`, its model split over
    `n_model_shards` devices and the requests over the rest (`tasks`: lm-eval's
    `TaskManager`, which indexes every task it knows once)."""
    lm = rce.RedcoastLM(str(folder), n_model_shards=n_model_shards, batch_size=batch_size)
    results = lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=tasks, limit=limit)
    assert results is not None
    return {name: results["results"][task][key] for task, (key, name) in REPORTED.items()}


def main(
    model: str | None = None,
    tuned: str | None = None,
    n_model_shards: int = 2,
    batch_size: int = 8,
    limit: int = 0,
    base_dir: str = "runs/finetune/base",
    base_steps: int = 200,
    finetune_steps: int = 150,
) -> dict[str, float]:
    """Score the base and the fine-tuned model on the shipped tasks.

    Args:
        model: the base checkpoint folder (with its tokenizer); default: the small
            GPT-2 built (once) in `base_dir`.
        tuned: the fine-tuned checkpoint folder; default: `model` beside `base_dir`
            (runs/finetune/model, where the finetune example writes; run here, from
            `model`, if it is missing).
        n_model_shards: devices each model is split over; the rest split the requests.
        batch_size: requests per data-parallel device at once.
        limit: documents per task (0: all of them: 200, 100 and 50).
        base_dir: where the default base checkpoint is built and cached.
        base_steps: steps of pretraining when the base is built.
        finetune_steps: the finetune example's steps, when it runs here.
    """
    shards = n_model_shards
    base = (
        Path(model) if model else base_checkpoint(base_dir, n_model_shards=shards, steps=base_steps)
    )
    after = Path(tuned) if tuned else Path(base_dir).parent / "model"
    if not (after / "config.json").is_file():
        finetune(model=str(base), output=str(after), max_steps=finetune_steps)
    how = {"n_model_shards": n_model_shards, "batch_size": batch_size, "limit": limit or None}
    how["tasks"] = rce.task_manager()
    before_scores, after_scores = score(base, **how), score(after, **how)
    metrics = {}
    for name in before_scores:
        metrics[f"{name}_before"] = float(before_scores[name])
        metrics[f"{name}_after"] = float(after_scores[name])
        print(f"{name}: {before_scores[name]:.4f} before, {after_scores[name]:.4f} after")
    # Bits per byte, as a ratio of perplexities per byte: below 1 is better.
    bpb = metrics["source_bits_per_byte_after"] - metrics["source_bits_per_byte_before"]
    metrics["byte_perplexity_ratio"] = math.pow(2.0, bpb)
    return metrics
