"""Fine-tune a pretrained checkpoint on your text, tensor parallel; hand back a Hugging Face folder.

`--model` is any zoo checkpoint folder with its tokenizer; `--data` is text files,
a folder of them, or a `.jsonl` of prompt/completion records (the loss then
counts the completions only). With no arguments it runs offline: a small GPT-2
and its BPE tokenizer pretrained on Python's documentation (built once, see
`_pretrained.py`) are fine-tuned on another domain that ships with Python, the
standard library's own source code. Prints held-out perplexity before and after
and a sample, and writes the model and tokenizer with `to_hf`.
"""

import math
import shutil
import sysconfig
from pathlib import Path

import jax
import numpy as np
import optax
from _pretrained import base_checkpoint

import redcoast as rc


def perplexity(model, rows, mesh, batch_size: int) -> float:
    """exp(mean negative log-likelihood per counted token) over `rows`."""

    def pred_fn(m, batch, key):
        nll, n = rc.models.next_token_nll(m, batch["input_ids"], batch["loss_mask"])
        return {"nll": nll, "n": n}

    out = rc.predict(
        model,
        rows,
        collate_fn=rc.text.collate,
        pred_fn=pred_fn,
        mesh=mesh,
        per_device_batch_size=batch_size,
    )
    return math.exp(sum(float(o["nll"]) for o in out) / sum(float(o["n"]) for o in out))


def main(
    model: str | None = None,
    data: str | None = None,
    output: str = "runs/finetune/model",
    n_model_shards: int = 2,
    fsdp: bool = False,
    seq_len: int = 128,
    per_device_batch_size: int = 4,
    max_steps: int = 150,
    learning_rate: float = 1e-3,
    eval_rows: int = 128,
    prompt: str = "def read_file(path):\n",
    base_dir: str = "runs/finetune/base",
    workdir: str | None = None,
) -> dict[str, float]:
    """Fine-tune, compare held-out perplexity, sample, and write the result.

    Args:
        model: a checkpoint folder (config.json, safetensors, tokenizer); default: the
            small base built (once) in `base_dir`.
        data: text files, a folder (every file) or a .jsonl of prompt/completion
            records; default: the standard library's .py files.
        output: where the fine-tuned model and its tokenizer are written.
        n_model_shards: devices each model is split over; the rest split the batch.
        fsdp: also split the weights over the data axis (ZeRO-3).
        seq_len: tokens per row.
        per_device_batch_size: rows per data-parallel device per step.
        max_steps: optimizer steps.
        learning_rate: peak AdamW learning rate (warm-up, then cosine decay).
        eval_rows: held-out rows (the end of the data) for the perplexity.
        prompt: the sample's prompt.
        base_dir: where the default base checkpoint is built and cached.
        workdir: where metrics.jsonl goes.
    """
    folder = Path(model) if model else base_checkpoint(base_dir, n_model_shards=n_model_shards)
    cache = Path(output).parent / "tokens"
    source = Path(data) if data else Path(sysconfig.get_paths()["stdlib"])
    if source.suffix == ".jsonl":
        tokens = rc.text.tokenize_instructions(source, folder, cache)
    elif data:
        tokens = rc.text.tokenize(source, folder, cache)
    else:  # the standard library's modules (a few test files hold invalid UTF-8 on purpose)
        files = [p for p in sorted(source.glob("**/*.py")) if "site-packages" not in p.parts]
        tokens = rc.text.tokenize(files, folder, cache, errors="replace")
    mesh = rc.make_mesh(n_model_shards)
    net = rc.models.from_hf(folder, mesh=mesh, fsdp=fsdp)
    rows = (rc.text.padded if source.suffix == ".jsonl" else rc.text.packed)(
        tokens, seq_len, model=net
    )
    train, held_out = rows[: len(rows) - eval_rows], rows[len(rows) - eval_rows :]
    before = perplexity(net, held_out, mesh, per_device_batch_size)
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max_steps // 10, max_steps)
    result = rc.fit(
        net,
        optax.inject_hyperparams(optax.adamw)(learning_rate=schedule),
        train,
        collate_fn=rc.text.collate,
        loss_fn=rc.models.lm_loss,
        mesh=mesh,
        per_device_batch_size=per_device_batch_size,
        max_steps=max_steps,
        workdir=workdir,
        donate=True,
    )
    after = perplexity(result.model, held_out, mesh, per_device_batch_size)
    print(f"held-out perplexity: {before:.2f} before, {after:.2f} after ({after / before:.2f}x)")
    tok = rc.text.load_tokenizer(folder)
    ids = np.asarray([tok.fast.encode(prompt).ids], np.int32)
    new = rc.models.generate(
        result.model,
        ids,
        max_new_tokens=48,
        temperature=0.7,
        eos_id=tok.eos_id,
        key=jax.random.key(0),
    )
    print("sample:", repr(prompt + tok.fast.decode(np.asarray(new[0]).tolist())))
    result.model.to_hf(output)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            shutil.copy(folder / name, Path(output) / name)
    print(f"wrote {output}: transformers' AutoModelForCausalLM and AutoTokenizer open it")
    return {"perplexity_before": before, "perplexity_after": after, "ratio": after / before}


if __name__ == "__main__":
    main()
