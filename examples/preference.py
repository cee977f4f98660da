"""Preference-tune a pretrained checkpoint with DPO (or SimPO) and LoRA, tensor parallel.

Offline pairs from the standard library: the prompt is a function's signature, the
chosen answer its docstring's first line, the rejected one the same line with
typos. The base is `finetune.py`'s small GPT-2 (`_pretrained.py`); LoRA adapters
on every projection are tuned, DPO's reference being the model with its adapters
off, in the same step. Prints held-out reward accuracy before and after (DPO's
rewards are all 0 before: ties, counted half) and the chosen answers' held-out
log-probability per token, which must not collapse (`sft_weight` holds it up).
"""

import ast
import functools
import random
import sysconfig
from pathlib import Path

import jax
import numpy as np
import optax
from _pretrained import base_checkpoint

import redcoast as rc


def misspelled(word: str, rng: random.Random) -> str:
    """`word` with two neighbouring letters swapped, half the time (words of 4+ letters)."""
    if len(word) < 4 or not word.isalpha() or rng.random() < 0.5:
        return word
    i = rng.randrange(1, len(word) - 2)
    return word[:i] + word[i + 1] + word[i] + word[i + 2 :]


def docstring_pairs(seed: int = 0) -> list[dict[str, str]]:
    """Public functions of the standard library's top-level modules: each signature with
    its docstring's first line, and that line misspelled."""
    rng, pairs = random.Random(seed), []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_bytes())):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            words = (ast.get_docstring(node) or "").split("\n")[0].split()
            typos = [misspelled(w, rng) for w in words]
            if 4 <= len(words) <= 16 and typos != words:
                prompt = f'def {node.name}({", ".join(a.arg for a in node.args.args)}):\n    """'
                chosen, rejected = (" ".join(w) + '"""' for w in (words, typos))
                pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    rng.shuffle(pairs)
    return pairs


def held_out(model, rows, mesh, loss: str, batch_size: int) -> tuple[float, float]:
    """Reward accuracy (DPO's against the base model, ties counting half; SimPO's own)
    and the chosen answers' mean log-probability per token."""

    def pred_fn(m, batch, key):
        logps = [rc.preference.pair_logps(x, batch) for x in (m, rc.lora.disabled(m))]
        (c, r), (ref_c, ref_r) = logps
        n_c, n_r = batch["chosen_mask"].sum(-1), batch["rejected_mask"].sum(-1)
        dpo, simpo = (c - ref_c) - (r - ref_r), c / n_c - r / n_r
        return {"margin": dpo if loss == "dpo" else simpo, "logp": c / n_c}

    how = {"collate_fn": rc.text.collate, "mesh": mesh, "per_device_batch_size": batch_size}
    out = rc.predict(model, rows, pred_fn=pred_fn, **how)
    margin = np.array([float(o["margin"]) for o in out])
    return np.mean(margin > 0) + 0.5 * np.mean(margin == 0), np.mean([o["logp"] for o in out])


def main(
    model: str | None = None,
    loss: str = "dpo",
    n_model_shards: int = 2,
    seq_len: int = 80,
    per_device_batch_size: int = 4,
    max_steps: int = 150,
    learning_rate: float = 5e-3,
    beta: float = 0.1,
    sft_weight: float = 0.3,
    eval_pairs: int = 256,
    base_dir: str = "runs/finetune/base",
    output: str = "runs/preference",
    workdir: str | None = None,
) -> dict[str, float]:
    """Tune on docstring pairs; compare held-out reward accuracy and chosen log-probability.

    Args:
        model: a checkpoint folder with its tokenizer; default: the base built in `base_dir`.
        loss: "dpo" (the model with its adapters off is the reference) or "simpo".
        n_model_shards: devices each model is split over; the rest split the batch.
        seq_len: tokens per sequence (the prompt with one answer).
        per_device_batch_size: pairs per data-parallel device per step.
        max_steps: optimizer steps.
        learning_rate: peak AdamW learning rate (warm-up, then cosine decay).
        beta: DPO's beta (how far from the reference the model may move); SimPO keeps 2.
        sft_weight: weight of the chosen answers' negative log-likelihood in the loss.
        eval_pairs: held-out pairs (the end of the shuffled pairs).
        base_dir: where the base checkpoint is built and cached (shared with finetune).
        output: where the token folder goes.
        workdir: where metrics.jsonl goes.
    """
    losses = {"dpo": functools.partial(rc.preference.dpo_loss, beta=beta)}
    loss_fn = functools.partial(losses.get(loss, rc.preference.simpo_loss), sft_weight=sft_weight)
    folder = Path(model) if model else base_checkpoint(base_dir, n_model_shards=n_model_shards)
    pairs = rc.text.tokenize_preferences(docstring_pairs(), folder, Path(output) / "pairs")
    mesh = rc.make_mesh(n_model_shards)
    net = rc.models.from_hf(folder, mesh=mesh)
    rows = rc.text.paired(pairs, seq_len, model=net)
    train, test = rows[: len(rows) - eval_pairs], rows[len(rows) - eval_pairs :]
    net = rc.lora.apply(net, lambda *_: True, rank=8, key=jax.random.key(1))
    before = held_out(net, test, mesh, loss, per_device_batch_size)
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max_steps // 10, max_steps)
    result = rc.fit(
        net,
        optax.adamw(schedule),
        train,
        collate_fn=rc.text.collate,
        loss_fn=loss_fn,
        mesh=mesh,
        per_device_batch_size=per_device_batch_size,
        max_steps=max_steps,
        workdir=workdir,
        donate=True,
        trainable=rc.lora.trainable(net),
    )
    after = held_out(result.model, test, mesh, loss, per_device_batch_size)
    print(f"{loss}, held-out reward accuracy {before[0]:.3f} -> {after[0]:.3f}")
    print(f"held-out chosen log-probability per token {before[1]:.3f} -> {after[1]:.3f}")
    figures = {"accuracy_before": before[0], "accuracy_after": after[0]}
    figures |= {"chosen_logp_before": before[1], "chosen_logp_after": after[1]}
    figures["chosen_logp_change"] = after[1] - before[1]
    return {k: float(v) for k, v in figures.items()}


if __name__ == "__main__":
    main()
