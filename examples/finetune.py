"""Fine-tune a pretrained checkpoint on your text, tensor parallel; hand back a Hugging Face folder.

`--model` is any zoo checkpoint folder with its tokenizer; `--data` is text files,
a folder of them, or a `.jsonl` of prompt/completion records (the loss then
counts the completions only; `--instructions` makes such records from the standard
library's functions). Documents are packed into rows, each attending to itself alone
(`--packing segments`), or to the ones before it too (`joined`, `run_clm.py`'s rows),
or one per row (`padded`); held-out perplexity is always of documents alone. With no arguments
it runs offline: a small GPT-2 and its BPE tokenizer pretrained on Python's documentation (built
once into `--base-dir` in `--base-steps` steps, before fine-tuning's `--max-steps`; see
`_pretrained.py` and `redcoast pretrained`) are fine-tuned on another domain that
ships with Python, the standard library's own source code (`--lora-table-rank 6`,
`--lora-rank R`: LoRA adapters only, on the token table that the head is tied to
and on every projection, merged before writing; `--quantize nf4` stores the frozen
projections in QLoRA's 4-bit NormalFloat as they are read). Prints held-out perplexity before
and after, optimizer state and a sample (of `--prompt`, else the held-out data's
start), and writes the model and tokenizer with `to_hf`. It is the whole fine-tuning job (data,
packing, LoRA, QLoRA, evaluation, writing back), so it has a bound of its own: 208 lines, not 120.
"""

import ast
import json
import math
import shutil
import sysconfig
import textwrap
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


def function_records(files: list[Path], max_chars: int = 600) -> list[dict[str, str]]:
    """Instruction records from Python source: a documented function's signature and
    docstring are the prompt, its body the completion (functions up to `max_chars`)."""
    records = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few test files hold invalid source on purpose
        lines = source.split("\n")  # as `ast` numbers them (not at form feeds)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if ast.get_docstring(node) is None or len(node.body) < 2 or node.decorator_list:
                continue
            text = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])) + "\n"
            split = node.body[0].end_lineno - node.lineno + 1  # the docstring's last line
            head, body = text.split("\n")[:split], text.split("\n")[split:]
            if len(text) <= max_chars:
                records.append({"prompt": "\n".join(head) + "\n", "completion": "\n".join(body)})
    return records


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
    instructions: bool = False,
    packing: str = "segments",
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
        instructions: with no --data, fine-tune on instruction records made from the
            standard library (each documented function's signature and docstring the
            prompt, its body the completion), written to a .jsonl beside --output.
        packing: `segments` (documents packed into rows, each attending to itself
            alone), `joined` (packed, each seeing the documents before it in its row)
            or `padded` (one document per row; each must fit in --seq-len).
        eval_rows: held-out rows (the end of the data, packed as `segments`: each
            document alone) for the perplexity.
        prompt: the sample's prompt; default: the start of the held-out data (a
            function header for the standard library's source).
        base_dir: where the default base checkpoint is built and cached.
        base_steps: steps of pretraining when the base is built (once, before
            fine-tuning's --max-steps; `redcoast pretrained` builds one too).
        workdir: where metrics.jsonl goes.
    """
    if quantize and not lora_rank:
        raise ValueError("--quantize stores a frozen base: train adapters on it (--lora-rank R).")
    if packing not in ("segments", "joined", "padded"):
        raise ValueError(f"--packing is segments, joined or padded, not {packing!r}.")
    folder = (
        Path(model)
        if model
        else base_checkpoint(base_dir, n_model_shards=n_model_shards, steps=base_steps)
    )
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(stdlib.glob("**/*.py")) if "site-packages" not in p.parts]
    cache = Path(output).parent / ("functions" if instructions and not data else "tokens")
    source = Path(data) if data else stdlib
    if instructions and not data:
        source = cache.with_suffix(".jsonl")
        if not source.is_file():  # written whole, then renamed into place
            source.parent.mkdir(parents=True, exist_ok=True)
            part = source.with_suffix(".part")
            part.write_text("".join(json.dumps(r) + "\n" for r in function_records(files)))
            part.replace(source)
    if source.suffix == ".jsonl":
        tokens = rc.text.tokenize_instructions(source, folder, cache)
    elif data:
        tokens = rc.text.tokenize(source, folder, cache)
    else:  # the standard library's modules (a few test files hold invalid UTF-8 on purpose)
        tokens = rc.text.tokenize(files, folder, cache, errors="replace")
    mesh = rc.make_mesh(n_model_shards)
    net = rc.models.from_hf(folder, mesh=mesh, fsdp=fsdp, quantize=quantize)
    alone = rc.text.packed(tokens, seq_len, model=net)  # each document attends to itself
    n_train = len(alone) - eval_rows  # rows before the held-out ones
    held_out = alone[n_train:]
    if packing == "padded":  # the documents that end before the held-out rows
        rows = rc.text.padded(tokens, seq_len, model=net)
        train = rows[: int(np.searchsorted(tokens.starts, n_train * seq_len, "right")) - 1]
    else:
        rows = rc.text.packed(tokens, seq_len, separate_documents=packing == "segments")
        train = rows[:n_train]
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
    print(f"fine-tuning {folder} for {max_steps} step{'s' * (max_steps != 1)}")
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
    if not prompt and source.suffix == ".jsonl":  # the first held-out record's prompt
        d = min(int(np.searchsorted(tokens.starts, n_train * seq_len)), tokens.n_documents - 1)
        ids, mask = tokens.read(int(tokens.starts[d]), int(tokens.starts[d + 1]))
        prompt = tok.fast.decode(ids[: max(1, int(np.argmax(mask)))].tolist())
    elif not prompt:  # the held-out rows' start, or a function header for the stdlib
        prompt = tok.fast.decode(held_out[0]["input_ids"][:16].tolist()) if data else ""
        prompt = prompt or "def read_file(path):\n"
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
