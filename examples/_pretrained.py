"""A small pretrained checkpoint, made offline once: what `finetune.py` starts from by default.

A byte-level BPE tokenizer (4096 ids) and a GPT-2 (4 layers, width 128, 256
positions) are trained on Python's documentation (`pydoc_data.topics`, shipped
with CPython), then written as a Hugging Face folder (`config.json`,
`model.safetensors`, `tokenizer.json`, `tokenizer_config.json`) that `from_hf`,
`rc.text` and `transformers` all open. The folder is built under a temporary
name and renamed when complete, so it is made once and reused.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path
from pydoc_data.topics import topics

import jax
import optax
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import redcoast as rc
from redcoast.models import GPT2, GPT2Config

EOS = "<|endoftext|>"


def _tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=alphabet
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def base_checkpoint(folder: str, *, n_model_shards: int = 2, steps: int = 200) -> Path:
    """The base checkpoint at `folder`, trained first (saying so) if it is not there yet."""
    out = Path(folder)
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    print(
        f"no checkpoint in {out}: pretraining one first, {steps} step{'s' * (steps != 1)} (a BPE "
        "tokenizer and a small GPT-2 on Python's documentation; made once, then reused)",
        flush=True,
    )
    texts = [topics[k] for k in sorted(topics)]
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{out.name}.tmp-"))
    try:
        tok = _tokenizer(texts, 4096)
        tok.save(str(work / "tokenizer.json"))
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}
        settings |= {"bos_token": EOS, "unk_token": EOS, "model_max_length": 256}
        (work / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
        rows = rc.text.packed(rc.text.tokenize(texts, tok, work / "tokens"), 128)
        config = GPT2Config(vocab_size=4096, n_positions=256, n_embd=128, n_layer=4, n_head=4)
        eos = tok.token_to_id(EOS)
        config = GPT2Config.from_dict(
            {**config.to_dict(), "bos_token_id": eos, "eos_token_id": eos}
        )
        schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, steps // 10, steps)
        result = rc.fit(
            GPT2(config, key=jax.random.key(0)),
            optax.adamw(schedule, weight_decay=0.01),
            rows,
            collate_fn=rc.text.collate,
            loss_fn=rc.models.lm_loss,
            mesh=rc.make_mesh(n_model_shards),
            per_device_batch_size=4,
            max_steps=steps,
            donate=True,
        )
        result.model.to_hf(work)
        shutil.rmtree(work / "tokens")
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out
