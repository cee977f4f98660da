"""Qwen 2 / 2.5 (Yang et al. 2024) and Qwen 3 (2025): LLaMA's decoder with biases on the
query, key and value projections (Qwen 2), or an RMSNorm of each query and key head
before the rotation (Qwen 3), and optional sliding windows on the layers from
`max_window_layers` up; and Qwen3-MoE, whose MLPs are sparse mixtures of experts."""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from . import hf
from .decoder import FULL, SLIDING, Decoder, DecoderConfig
from .moe import Router


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE's hyperparameters, named as in `transformers.Qwen3MoeConfig` (and its
    config.json): Qwen 3's attention, each MLP a mixture of `num_experts` SwiGLU experts
    of width `moe_intermediate_size`, of which each token uses `num_experts_per_tok`,
    their weights renormalised when `norm_topk_prob` (`moe.SparseMoE`).

    Every layer is a mixture, as in Qwen3-30B-A3B and Qwen3-235B-A22B: dense layers
    among them (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused. With
    `use_sliding_window`, every layer sees the last `sliding_window` positions.
    `router_aux_loss_coef` weighs the load-balancing loss in `rc.models.moe_lm_loss`.

    Example:
        >>> config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
        ...                         num_attention_heads=4, num_key_value_heads=2,
        ...                         moe_intermediate_size=16, num_experts=8,
        ...                         num_experts_per_tok=2)
        >>> model = Qwen3Moe(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "qwen3_moe"
    architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    sizes: ClassVar[tuple[str, ...]] = (
        *DecoderConfig.sizes,
        "moe_intermediate_size",
        "num_experts",
        "num_experts_per_tok",
    )
    experts_prefix: ClassVar[str] = "mlp."
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int = 128
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: Any = None

    @classmethod
    def _normalise(cls, values: dict[str, Any]) -> dict[str, Any]:
        # transformers 5 writes `num_experts` by its other name.
        if "num_local_experts" in values:
            values.setdefault("num_experts", values.pop("num_local_experts"))
        return super()._normalise(values)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_only_layers or self.decoder_sparse_step != 1:
            raise ValueError(
                f"Qwen3MoeConfig: mlp_only_layers={self.mlp_only_layers!r} and "
                f"decoder_sparse_step={self.decoder_sparse_step} make some layers dense; "
                "redcoast builds Qwen3-MoE with a mixture in every layer (mlp_only_layers "
                "empty, decoder_sparse_step 1), as the published checkpoints are."
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"Qwen3MoeConfig: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}."
            )

    @property
    def experts(self) -> tuple[int, int] | None:
        return self.num_experts, self.num_experts_per_tok

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def router(self) -> Router:
        return Router(normalize=self.norm_topk_prob)

    @property
    def layer_types_resolved(self) -> tuple[str, ...]:
        kind = SLIDING if self.window is not None else FULL
        return (kind,) * self.num_hidden_layers


class Qwen3Moe(Decoder):
    """Qwen3-MoE as an Equinox module (see `Decoder`), called on one sequence of ids.

    `with_router_logits` gives every layer's router logits beside the logits, for
    `rc.models.load_balancing_loss`; `rc.models.moe_lm_loss` is the loss with it.

    Example:
        >>> model = Qwen3Moe(config, key=jax.random.key(0))
        >>> logits, router = model.with_router_logits(jnp.arange(10))
        >>> router.shape  # (layers, seq, experts)
        (2, 10, 8)
    """

    config_class: ClassVar[type[hf.HFConfig]] = Qwen3MoeConfig
