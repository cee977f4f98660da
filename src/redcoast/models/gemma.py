"""Gemma 2 (Gemma Team 2024) and Gemma 3's text model (2025): LLaMA's decoder with a
GeGLU MLP, RMSNorms that scale by `1 + weight`, a norm after attention and after the
MLP too, embeddings scaled by `sqrt(hidden_size)`, local (sliding-window) layers
alternating with global ones, `query_pre_attn_scalar` for the scores' scale and
soft-capped scores and logits (Gemma 2) or per-head query/key norms (Gemma 3, whose
local layers rotate with their own base)."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from . import hf
from .decoder import FULL, SLIDING, Decoder, DecoderConfig
from .rope import RoPE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma2Config(DecoderConfig):
    """Gemma 2's hyperparameters, named as in `transformers.Gemma2Config` (and its config.json).

    `layer_types` says which layers are local (`sliding_attention`, every other one
    from the first by default); `use_bidirectional_attention` (an encoder's
    attention) is not implemented and an error when true.

    Example:
        >>> config = Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...                       num_hidden_layers=2, num_attention_heads=4,
        ...                       num_key_value_heads=2, head_dim=8, sliding_window=8)
        >>> model = Gemma2(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "gemma2"
    architecture: ClassVar[str] = "Gemma2ForCausalLM"
    token_ids: ClassVar[Mapping[str, int | None]] = {
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }
    norm_offset: ClassVar[bool] = True
    post_norms: ClassVar[bool] = True

    vocab_size: int = 256000
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_act: str = "gelu_pytorch_tanh"  # unused: transformers reads hidden_activation
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    query_pre_attn_scalar: int | float = 256
    sliding_window: int | None = 4096
    layer_types: Any = None
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0
    use_bidirectional_attention: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(use_bidirectional_attention=(bool(self.use_bidirectional_attention), False))

    @property
    def activation_name(self) -> str:
        return self.hidden_activation

    @property
    def embed_scale(self) -> float | None:
        return math.sqrt(self.hidden_size)

    @property
    def attn_scale(self) -> float | None:
        return self.query_pre_attn_scalar**-0.5

    @property
    def attn_softcap(self) -> float | None:
        return self.attn_logit_softcapping

    @property
    def final_softcap(self) -> float | None:
        return self.final_logit_softcapping

    @property
    def window(self) -> int | None:
        return self.sliding_window

    @property
    def layer_types_resolved(self) -> tuple[str, ...]:
        return self.listed_layer_types() or tuple(
            SLIDING if (i + 1) % self.local_period else FULL for i in range(self.num_hidden_layers)
        )

    @property
    def local_period(self) -> int:
        """Without `layer_types`, every `local_period`-th layer is global (Gemma 2: 2)."""
        return 2


class Gemma2(Decoder):
    """Gemma 2 as an Equinox module (see `Decoder`), called on one sequence of ids.

    Example:
        >>> model = Gemma2(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    config_class: ClassVar[type[hf.HFConfig]] = Gemma2Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3TextConfig(Gemma2Config):
    """Gemma 3's text model's hyperparameters, named as in `transformers.Gemma3TextConfig`.

    Its global layers rotate with `rope_theta` (and `rope_scaling`, e.g. `linear`
    for the 4B to 27B models), its local ones with `rope_local_base_freq`; read from
    config.json's `rope_parameters` of each layer type (transformers 5) or the
    top-level keys (transformers 4). Without `layer_types`, every
    `sliding_window_pattern`-th layer is global. Like transformers, the model has no
    attention soft-capping (its query/key norms take that part):
    `attn_logit_softcapping` is kept but not used.

    Example:
        >>> config = Gemma3TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...                           num_hidden_layers=2, num_attention_heads=4,
        ...                           num_key_value_heads=2, head_dim=8, sliding_window=8)
        >>> model = Gemma3(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "gemma3_text"
    architecture: ClassVar[str] = "Gemma3ForCausalLM"
    qk_norm: ClassVar[bool] = True
    default_theta: ClassVar[float] = 1e6

    vocab_size: int = 262208
    max_position_embeddings: int = 131072
    rope_theta: float = 1e6
    rope_local_base_freq: float = 10000.0
    sliding_window_pattern: int = 6
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool | None = False

    @property
    def attn_softcap(self) -> float | None:
        return None  # transformers' Gemma 3 passes no soft cap to its attention

    @property
    def local_period(self) -> int:
        return self.sliding_window_pattern

    def rope_for(self, layer_type: str) -> RoPE:
        if layer_type == SLIDING:
            return RoPE.default(self.rotary_dim, self.rope_local_base_freq)
        return super().rope_for(layer_type)

    @classmethod
    def _normalise(cls, values: dict[str, Any]) -> dict[str, Any]:
        params = values.get("rope_parameters") or {}
        if not (FULL in params or SLIDING in params):
            # transformers 4's keys: rope_scaling applies to the global layers.
            return super()._normalise(values)
        params = dict(values.pop("rope_parameters"))
        values.pop("rope_scaling", None)
        local = dict(params.get(SLIDING) or {})
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default" or set(local) - {"rope_type", "type", "rope_theta"}:
            raise ValueError(
                f"Gemma3TextConfig: rope_parameters.{SLIDING} is {local}; the local layers' "
                "rotation is implemented unscaled only (rope_type 'default', rope_theta)."
            )
        values["rope_local_base_freq"] = local.get(
            "rope_theta", values.get("rope_local_base_freq", 10000.0)
        )
        cls._read_rope(dict(params.get(FULL) or {}), values)
        return values

    def _rope_parameters(self) -> dict[str, Any]:
        local = {"rope_theta": self.rope_local_base_freq, "rope_type": "default"}
        return {FULL: super()._rope_parameters(), SLIDING: local}


class Gemma3(Decoder):
    """Gemma 3's text model as an Equinox module (see `Decoder`), called on one
    sequence of ids.

    Example:
        >>> model = Gemma3(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    config_class: ClassVar[type[hf.HFConfig]] = Gemma3TextConfig
