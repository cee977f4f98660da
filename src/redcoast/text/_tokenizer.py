"""Opening a checkpoint's tokenizer; encoding always runs on the fast (Rust) backend."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` (the fast backend), and the `transformers` one it came from."""

    fast: Any
    hf: Any
    name: str
    eos_id: int | None
    pad_id: int | None

    @property
    def vocab_size(self) -> int:
        return int(self.fast.get_vocab_size(with_added_tokens=True))

    @property
    def prefix(self) -> list[int]:
        """What the tokenizer puts before a sequence (LLaMA's BOS; nothing for GPT-2)."""
        plain = self.fast.encode("a", add_special_tokens=False).ids
        full = self.fast.encode("a", add_special_tokens=True).ids
        at = next(i for i in range(len(full) + 1) if full[i : i + len(plain)] == plain)
        return list(full[:at])

    def fingerprint(self, extra: str = "") -> str:
        h = hashlib.sha256(self.fast.to_str().encode())
        h.update(f"|eos={self.eos_id}|{extra}".encode())
        return h.hexdigest()[:16]

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.fast.encode_batch_fast(texts, add_special_tokens=False)]


def _import(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError as err:
        fix = (
            "`pip install 'redcoast[hf]'` (transformers' AutoTokenizer and chat templates)"
            if module == "transformers"
            else f"`pip install {module}` (a dependency of redcoast: the install is incomplete)"
        )
        raise ImportError(f"redcoast.text needs {module!r}; install it with {fix}.") from err


def load_tokenizer(tokenizer: Any, *, eos_id: int | None = None) -> Tokenizer:
    """Open a tokenizer: a checkpoint folder, a `tokenizer.json`, or a tokenizer object.

    A folder is opened with `transformers.AutoTokenizer` when `transformers` is
    installed (so its chat template and special tokens come along), else from its
    `tokenizer.json` with `tokenizers`. Encoding always runs on the fast (Rust)
    backend.

    Args:
        tokenizer: a folder, a `tokenizer.json` path, a `tokenizers.Tokenizer`, or a
            `transformers` fast tokenizer.
        eos_id: the id put between documents; default: the tokenizer's EOS token
            (`eos_token_id`, or `<|endoftext|>`, `</s>`, `<eos>` in its vocabulary).

    Returns:
        The tokenizer, as `tokenize` and `tokenize_instructions` use it.

    Raises:
        ValueError: the path holds no tokenizer, or a `transformers` tokenizer has no
            fast backend.

    Example:
        >>> tok = load_tokenizer("checkpoints/gpt2")   # the folder from save_pretrained
    """
    if isinstance(tokenizer, Tokenizer):
        return tokenizer if eos_id is None else dataclasses.replace(tokenizer, eos_id=eos_id)
    tokenizers = _import("tokenizers")
    hf, fast, name = None, None, type(tokenizer).__name__
    if isinstance(tokenizer, str | os.PathLike):
        path = Path(tokenizer)
        name = str(path)
        if path.is_dir():
            configured = (path / "tokenizer_config.json").is_file()
            if configured and importlib.util.find_spec("transformers") is not None:
                transformers = _import("transformers")
                hf = transformers.AutoTokenizer.from_pretrained(str(path))
            elif (path / "tokenizer.json").is_file():
                path = path / "tokenizer.json"
            else:
                raise ValueError(
                    f"{path} holds no tokenizer.json (nor a tokenizer_config.json that "
                    "transformers, `pip install 'redcoast[hf]'`, could open)."
                )
        if hf is None:
            if not path.is_file():
                raise ValueError(f"no tokenizer at {path}: give a folder or a tokenizer.json.")
            fast = tokenizers.Tokenizer.from_file(str(path))
    elif isinstance(tokenizer, tokenizers.Tokenizer):
        fast = tokenizer
    else:
        hf = tokenizer
    if hf is not None:
        fast = getattr(hf, "backend_tokenizer", None)
        if fast is None:
            raise ValueError(
                f"{name}: redcoast tokenizes with the fast (Rust) backend, and this "
                f"{type(hf).__name__} has none; load it with AutoTokenizer(use_fast=True)."
            )
    assert fast is not None
    vocab = fast.get_vocab(with_added_tokens=True)
    if eos_id is None and hf is not None:
        eos_id = hf.eos_token_id
    if eos_id is None:
        eos_id = next((vocab[t] for t in ("<|endoftext|>", "</s>", "<eos>") if t in vocab), None)
    pad_id = None if hf is None else hf.pad_token_id
    return Tokenizer(fast, hf, name, None if eos_id is None else int(eos_id), pad_id)
