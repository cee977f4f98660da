"""Named sizes of the zoo: the published configurations of GPT-2, LLaMA, GPT-J, OPT,
BART and T5 (the original T5 1.0: `t5-xxl` is the 11B model).

`preset("llama-7b")` gives the class and config of that model, as its
`config.json` on the Hugging Face hub has them, so a model can be planned
(`rc.memory_plan`) or built (`sharded_init`) by name without downloading anything.
"""

from __future__ import annotations

from typing import Any

from .bart import BART, BARTConfig
from .gpt2 import GPT2, GPT2Config
from .gptj import GPTJ, GPTJConfig
from .hf import HFConfig
from .llama import Llama, LlamaConfig
from .opt import OPT, OPTConfig
from .t5 import T5, T5Config


def _opt(hidden: int, layers: int, heads: int) -> OPTConfig:
    return OPTConfig(
        hidden_size=hidden,
        ffn_dim=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        word_embed_proj_dim=hidden,
    )


def _llama(hidden: int, inter: int, layers: int, heads: int, positions: int = 2048) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=positions,
    )


PRESETS: dict[str, tuple[type[Any], HFConfig]] = {
    "gpt2": (GPT2, GPT2Config()),
    "gpt2-medium": (GPT2, GPT2Config(n_embd=1024, n_layer=24, n_head=16)),
    "gpt2-large": (GPT2, GPT2Config(n_embd=1280, n_layer=36, n_head=20)),
    "gpt2-xl": (GPT2, GPT2Config(n_embd=1600, n_layer=48, n_head=25)),
    "gpt-j-6b": (GPTJ, GPTJConfig()),
    "llama-1b": (Llama, _llama(2048, 5504, 22, 16)),
    "llama-7b": (Llama, _llama(4096, 11008, 32, 32)),
    "llama-2-7b": (Llama, _llama(4096, 11008, 32, 32, positions=4096)),
    "llama-13b": (Llama, _llama(5120, 13824, 40, 40)),
    "opt-125m": (OPT, _opt(768, 12, 12)),
    "opt-1.3b": (OPT, _opt(2048, 24, 32)),
    "opt-6.7b": (OPT, _opt(4096, 32, 32)),
    "opt-13b": (OPT, _opt(5120, 40, 40)),
    "opt-30b": (OPT, _opt(7168, 48, 56)),
    "opt-66b": (OPT, _opt(9216, 64, 72)),
    "bart-large": (BART, BARTConfig()),
    "t5-large": (T5, T5Config(d_model=1024, d_ff=4096, num_layers=24, num_heads=16)),
    "t5-xxl": (
        T5,
        T5Config(d_model=1024, d_kv=128, d_ff=65536, num_layers=24, num_heads=128),
    ),
}
"""Preset name -> (model class, config)."""


def preset(name: str) -> tuple[type[Any], HFConfig]:
    """The model class and config of a named size.

    Args:
        name: one of `PRESETS` (`"gpt2-large"`, `"llama-7b"`, `"gpt-j-6b"`,
            `"opt-13b"`, `"opt-66b"`, ...).

    Returns:
        `(cls, config)`; build with `cls(config, key=key)` (or `sharded_init`).

    Raises:
        ValueError: an unknown name; the message lists the known ones.

    Example:
        >>> cls, config = preset("llama-7b")
        >>> config.num_hidden_layers
        32
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; the presets are: {', '.join(PRESETS)}.")
    return PRESETS[name]
