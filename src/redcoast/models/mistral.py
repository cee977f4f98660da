"""Mistral 7B (Jiang et al. 2023): LLaMA's decoder attending within a sliding window;
and Mixtral (Jiang et al. 2024), whose MLPs are sparse mixtures of experts."""

import dataclasses
from typing import ClassVar

from . import hf
from .decoder import Decoder, DecoderConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class MistralConfig(DecoderConfig):
    """Mistral's hyperparameters, named as in `transformers.MistralConfig` (and its
    config.json). Every layer sees the last `sliding_window` positions; `null` for
    all of them (Mistral 7B v0.2 and later).

    Example:
        >>> config = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...                        num_hidden_layers=2, num_attention_heads=4,
        ...                        num_key_value_heads=2, sliding_window=8)
        >>> model = Mistral(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "mistral"
    architecture: ClassVar[str] = "MistralForCausalLM"

    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = 4096

    @property
    def window(self) -> int | None:
        return self.sliding_window

    @property
    def layer_types_resolved(self) -> tuple[str, ...]:
        kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
        return (kind,) * self.num_hidden_layers


class Mistral(Decoder):
    """Mistral as an Equinox module (see `Decoder`), called on one sequence of ids.

    Example:
        >>> model = Mistral(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    config_class: ClassVar[type[hf.HFConfig]] = MistralConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtralConfig(MistralConfig):
    """Mixtral's hyperparameters, named as in `transformers.MixtralConfig` (and its
    config.json): Mistral's, each MLP a mixture of `num_local_experts` SwiGLU experts
    of which each token uses `num_experts_per_tok` (`moe.SparseMoE`).

    `router_aux_loss_coef` weighs the load-balancing loss in `rc.models.moe_lm_loss`.
    `router_jitter_noise` (noise on the router's input while training) is not
    implemented: a value other than 0 is an error.

    Example:
        >>> config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...                        num_hidden_layers=2, num_attention_heads=4,
        ...                        num_key_value_heads=2, num_local_experts=4)
        >>> model = Mixtral(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "mixtral"
    architecture: ClassVar[str] = "MixtralForCausalLM"
    sizes: ClassVar[tuple[str, ...]] = (
        *DecoderConfig.sizes,
        "num_local_experts",
        "num_experts_per_tok",
    )
    default_theta: ClassVar[float] = 1e6

    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    sliding_window: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    output_router_logits: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(router_jitter_noise=(self.router_jitter_noise, 0.0))
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"MixtralConfig: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_local_experts={self.num_local_experts}."
            )

    @property
    def experts(self) -> tuple[int, int] | None:
        return self.num_local_experts, self.num_experts_per_tok


class Mixtral(Decoder):
    """Mixtral as an Equinox module (see `Decoder`), called on one sequence of ids.

    `with_router_logits` gives every layer's router logits beside the logits, for
    `rc.models.load_balancing_loss`; `rc.models.moe_lm_loss` is the loss with it.

    Example:
        >>> model = Mixtral(config, key=jax.random.key(0))
        >>> logits, router = model.with_router_logits(jnp.arange(10))
        >>> router.shape  # (layers, seq, experts)
        (2, 10, 4)
    """

    config_class: ClassVar[type[hf.HFConfig]] = MixtralConfig
