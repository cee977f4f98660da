"""A tiny Hugging Face GPT-2 folder, with a tokenizer, for tests that need a checkpoint on disk."""

import json
from pathlib import Path
from pydoc_data.topics import topics

import jax

from redcoast.models import GPT2, GPT2Config


def tiny_gpt2(folder: Path, *, positions: int = 64) -> Path:
    """A 2-layer GPT-2 (vocabulary 400) with a byte-level BPE trained on Python's documentation.

    The folder holds what `save_pretrained` writes for the model (`config.json`,
    `model.safetensors`) and for a fast tokenizer (`tokenizer.json`,
    `tokenizer_config.json`), so `transformers` opens both.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)][:100], trainer)
    config = GPT2Config(vocab_size=400, n_positions=positions, n_embd=32, n_layer=2, n_head=2)
    GPT2(config, key=jax.random.key(0)).to_hf(folder)
    tok.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder
