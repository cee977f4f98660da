"""LLaMA 1, 2 and 3 (Touvron et al. 2023; Grattafiori et al. 2024): RoPE (Llama 3's
scaled by `rope_scaling`), RMSNorm, SwiGLU, grouped-query attention, the 1B and 3B
models' tied head. The decoder itself is `decoder.Decoder`."""

import dataclasses
from typing import ClassVar

from . import hf
from .decoder import Decoder, DecoderConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    """LLaMA's hyperparameters, named as in `transformers.LlamaConfig` (and its config.json).

    `rope_theta` and `rope_scaling` are read from `rope_parameters` (transformers 5)
    or from `rope_theta` and `rope_scaling` (transformers 4); the scalings are
    transformers' `linear`, `dynamic`, `yarn`, `longrope` and `llama3` (Llama 3.1
    and 3.2), any other is an error.

    Example:
        >>> config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...                      num_hidden_layers=2, num_attention_heads=4,
        ...                      num_key_value_heads=2)
        >>> model = Llama(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"

    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def has_mlp_bias(self) -> bool:
        return self.mlp_bias


class Llama(Decoder):
    """LLaMA as an Equinox module (see `Decoder`), called on one sequence of token ids.

    Example:
        >>> config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...                      num_hidden_layers=2, num_attention_heads=4,
        ...                      num_key_value_heads=2)
        >>> model = Llama(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    config_class: ClassVar[type[hf.HFConfig]] = LlamaConfig
