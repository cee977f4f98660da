"""Fine-tune a pretrained checkpoint on your text, tensor parallel; hand back a Hugging Face folder.

`--model` is any zoo checkpoint folder with its tokenizer; `--data` is text files,
a folder of them, or a `.jsonl` of prompt/completion records (the loss then
counts the completions only). With no arguments it runs offline: a small GPT-2
and its BPE tokenizer pretrained on Python's documentation (built once into
`--base-dir` in `--base-steps` steps, before fine-tuning's `--max-steps`; see
`_pretrained.py` and `redcoast pretrained`) are fine-tuned on another domain that
ships with Python, the standard library's own source code (`--lora-table-rank 2`,
`--lora-rank R`: LoRA adapters only, on the token table that the head is tied to
and on every projection, merged before writing; `--quantize nf4` stores the frozen
projections in QLoRA's 4-bit NormalFloat as they are read). Prints held-out perplexity before
and after, optimizer state and a sample (of `--prompt`, else the held-out data's
start), and writes the model and tokenizer with `to_hf`.
"""

import math
import shutil
import sysconfig
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
from _pretrained import base_checkpoint

import redcoast as rc


def perplexity(model, rows, mesh, batch_size: int) -> float:
    """exp(mean negative log-likelihood per counted token) over `rows`."""

    def pred_fn(m, batch, key):
        documents = {k: batch.get(k) for k in ("segment_ids", "positions")}  # packed rows
        nll, n = rc.models.next_token_nll(m, batch["input_ids"], batch["loss_mask"], **documents)
        return {"nll": nll, "n": n}

    how = {"collate_fn": rc.text.collate, "mesh": mesh, "per_device_batch_size": batch_size}
    out = rc.predict(model, rows, pred_fn=pred_fn, **how)
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
    lora_rank: int = 0,
    lora_table_rank: int = 0,
    quantize: str | None = None,
    eval_rows: int = 128,
    prompt: str = "",
    base_dir: str = "runs/finetune/base",
    base_steps: int = 200,
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
        lora_rank: above 0, LoRA adapters of this rank on every projection.
        lora_table_rank: above 0, a LoRA adapter of this rank on the token table
            (GPT-2's head reads it too). With either, only the adapters train.
        quantize: with --lora-rank, `nf4` (QLoRA) or `int8`: the frozen projections
            quantized as they are read (`from_hf(..., quantize=)`); perplexity before
            is the quantized base's.
        eval_rows: held-out rows (the end of the data) for the perplexity.
        prompt: the sample's prompt; default: the start of the held-out data (a
            function header for the standard library's source).
        base_dir: where the default base checkpoint is built and cached.
        base_steps: steps of pretraining when the base is built (once, before
            fine-tuning's --max-steps; `redcoast pretrained` builds one too).
        workdir: where metrics.jsonl goes.
    """
    folder = (
        Path(model)
        if model
        else base_checkpoint(base_dir, n_model_shards=n_model_shards, steps=base_steps)
    )
    cache = Path(output).parent / "tokens"
    source = Path(data) if data else Path(sysconfig.get_paths()["stdlib"])
    if source.suffix == ".jsonl":
        tokens = rc.text.tokenize_instructions(source, folder, cache)
    elif data:
        tokens = rc.text.tokenize(source, folder, cache)
    else:  # the standard library's modules (a few test files hold invalid UTF-8 on purpose)
        files = [p for p in sorted(source.glob("**/*.py")) if "site-packages" not in p.parts]
        tokens = rc.text.tokenize(files, folder, cache, errors="replace")
    if quantize and not lora_rank:
        raise ValueError("--quantize stores a frozen base: train adapters on it (--lora-rank R).")
    mesh = rc.make_mesh(n_model_shards)
    net = rc.models.from_hf(folder, mesh=mesh, fsdp=fsdp, quantize=quantize)
    rows = (rc.text.padded if source.suffix == ".jsonl" else rc.text.packed)(
        tokens, seq_len, model=net
    )
    train, held_out = rows[: len(rows) - eval_rows], rows[len(rows) - eval_rows :]
    before = perplexity(net, held_out, mesh, per_device_batch_size)
    # Every weight as full fine-tuning trains it (a quantized one decoded: shapes only).
    plain = eqx.filter_eval_shape(rc.quant.dequantize, net)
    full = eqx.filter(plain, lambda x: isinstance(x, jax.ShapeDtypeStruct) and x.dtype.kind == "f")
    lora = bool(lora_rank or lora_table_rank)
    if lora_rank:  # every Linear: the attention and MLP projections (GPT-2 ties its head)
        net = rc.lora.apply(net, lambda *_: True, rank=lora_rank, key=jax.random.key(1))
    if lora_table_rank:
        net = rc.lora.apply(net, "embed_tokens", rank=lora_table_rank, key=jax.random.key(2))
    trainable = rc.lora.trainable(net) if lora else None
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max_steps // 10, max_steps)
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)
    full_mb, mb = (  # AdamW's moments: of every weight, and of the trainable ones
        sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(optimizer.init, t)))
        for t in (full, eqx.filter(net, rc.trainable_mask(net, trainable)))
    )
    print(f"optimizer state: {mb / 1e6:.2f} MB; full fine-tuning's {full_mb / 1e6:.2f} MB")
    print(f"fine-tuning {folder} for {max_steps} steps")
    result = rc.fit(
        net,
        optimizer,
        train,
        collate_fn=rc.text.collate,
        loss_fn=rc.models.lm_loss,
        mesh=mesh,
        per_device_batch_size=per_device_batch_size,
        max_steps=max_steps,
        workdir=workdir,
        donate=True,
        trainable=trainable,
    )
    after = perplexity(result.model, held_out, mesh, per_device_batch_size)
    print(f"held-out perplexity: {before:.2f} before, {after:.2f} after ({after / before:.2f}x)")
    tok = rc.text.load_tokenizer(folder)
    if not prompt:  # the held-out data's start: a record's prompt, or a row's first tokens
        row = held_out[0]
        n = max(1, int(np.argmax(row["loss_mask"]))) if source.suffix == ".jsonl" else 16
        prompt = (
            tok.fast.decode(row["input_ids"][:n].tolist()) if data else "def read_file(path):\n"
        )
    ids = np.asarray([tok.fast.encode(prompt).ids], np.int32)
    sampling = {"max_new_tokens": 48, "temperature": 0.7, "eos_id": tok.eos_id}
    new = rc.models.generate(result.model, ids, key=jax.random.key(0), **sampling)
    print("sample:", repr(prompt + tok.fast.decode(np.asarray(new[0]).tolist())))
    (rc.lora.merge(result.model) if lora else result.model).to_hf(output)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            shutil.copy(folder / name, Path(output) / name)
    print(f"wrote {output}: transformers' AutoModelForCausalLM and AutoTokenizer open it")
    gain = {"perplexity_before": before, "perplexity_after": after, "ratio": after / before}
    step_s = rc.median_speed(result.history["train"]).get("step_s", float("nan"))
    return gain | {"opt_state": mb / full_mb, "step_s": step_s}


if __name__ == "__main__":
    main()
