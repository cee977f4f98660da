"""Qwen 2 / 2.5 (Yang et al. 2024) and Qwen 3 (2025): LLaMA's decoder with biases on the
query, key and value projections (Qwen 2), or an RMSNorm of each query and key head
before the rotation (Qwen 3), and optional sliding windows on the layers from
`max_window_layers` up."""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from . import hf
from .decoder import FULL, SLIDING, Decoder, DecoderConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen2Config(DecoderConfig):
    """Qwen 2's hyperparameters, named as in `transformers.Qwen2Config` (and its config.json).

    Sliding windows as transformers has them: with `use_sliding_window` false there
    are none, whatever `sliding_window` says; else the layers `layer_types` names
    `sliding_attention` (by default those from `max_window_layers` up) see the last
    `sliding_window` positions.

    Example:
        >>> config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...                      num_hidden_layers=2, num_attention_heads=4,
        ...                      num_key_value_heads=2)
        >>> model = Qwen2(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "qwen2"
    architecture: ClassVar[str] = "Qwen2ForCausalLM"
    token_ids: ClassVar[Mapping[str, int | None]] = dict.fromkeys(
        ("pad_token_id", "bos_token_id", "eos_token_id")
    )

    vocab_size: int = 151936
    intermediate_size: int = 22016
    num_key_value_heads: int | None = 32
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: Any = None

    @property
    def has_qkv_bias(self) -> bool:
        return True

    @property
    def window(self) -> int | None:
        return self.sliding_window if self.use_sliding_window else None

    @property
    def layer_types_resolved(self) -> tuple[str, ...]:
        return self.listed_layer_types() or tuple(
            SLIDING if self.window is not None and i >= self.max_window_layers else FULL
            for i in range(self.num_hidden_layers)
        )


class Qwen2(Decoder):
    """Qwen 2 / 2.5 as an Equinox module (see `Decoder`), called on one sequence of ids.

    Example:
        >>> model = Qwen2(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    config_class: ClassVar[type[hf.HFConfig]] = Qwen2Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3Config(Qwen2Config):
    """Qwen 3's hyperparameters, named as in `transformers.Qwen3Config` (and its config.json).

    As Qwen 2's, with `head_dim` (128 by default) and `attention_bias` (biases on all
    four attention projections, none by default) instead of Qwen 2's Q/K/V biases.

    Example:
        >>> config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...                      num_hidden_layers=2, num_attention_heads=4,
        ...                      num_key_value_heads=2, head_dim=8)
        >>> model = Qwen3(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "qwen3"
    architecture: ClassVar[str] = "Qwen3ForCausalLM"
    qk_norm: ClassVar[bool] = True

    head_dim: int | None = 128
    attention_bias: bool = False

    @property
    def has_qkv_bias(self) -> bool:
        return self.attention_bias


class Qwen3(Decoder):
    """Qwen 3 as an Equinox module (see `Decoder`), called on one sequence of ids.

    Example:
        >>> model = Qwen3(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    config_class: ClassVar[type[hf.HFConfig]] = Qwen3Config
