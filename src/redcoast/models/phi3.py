"""Phi-3 (Abdin et al. 2024): LLaMA's decoder whose checkpoint fuses the query, key and
value projections into one `qkv_proj` and the gate and up projections into one
`gate_up_proj`. The model holds them as separate Linears, which the sharding rules
split as LLaMA's; the tensor map splits the fused tensors on loading and joins them
on saving. LongRoPE (`rope_scaling` of type `longrope`, the 128k models) and a
partial rotation (`partial_rotary_factor`) as transformers has them."""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from . import hf
from .decoder import FULL, SLIDING, Decoder, DecoderConfig
from .rope import RoPE, rope_from_parameters


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phi3Config(DecoderConfig):
    """Phi-3's hyperparameters, named as in `transformers.Phi3Config` (and its config.json).

    Every layer sees the last `sliding_window` positions (`null` for all of them).
    `rope_scaling` is `longrope` or none, as in transformers (its old names `su` and
    `yarn` read as `longrope`); `original_max_position_embeddings` is where LongRoPE
    switches to its long factors.

    Example:
        >>> config = Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...                     num_hidden_layers=2, num_attention_heads=4,
        ...                     num_key_value_heads=2)
        >>> model = Phi3(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "phi3"
    architecture: ClassVar[str] = "Phi3ForCausalLM"
    token_ids: ClassVar[Mapping[str, int | None]] = {
        "pad_token_id": 32000,
        "bos_token_id": 1,
        "eos_token_id": 32000,
    }
    fused_projections: ClassVar[bool] = True
    partial_rotation: ClassVar[bool] = True

    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        kind = dict(self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ("default", "longrope"):
            raise ValueError(
                f"Phi3Config: rope_type={kind!r}; transformers' Phi-3 takes 'longrope' "
                "(or no scaling) only."
            )
        super().__post_init__()

    @classmethod
    def _read_rope(cls, params: dict[str, Any], values: dict[str, Any]) -> None:
        if params.get("rope_type", params.get("type")) in ("su", "yarn"):
            params.pop("type", None)
            params["rope_type"] = "longrope"  # transformers' old names for it
        super()._read_rope(params, values)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def window(self) -> int | None:
        return self.sliding_window

    @property
    def layer_types_resolved(self) -> tuple[str, ...]:
        return ((SLIDING if self.sliding_window is not None else FULL),) * self.num_hidden_layers

    def rope_for(self, layer_type: str) -> RoPE:
        del layer_type
        return rope_from_parameters(
            dict(self.rope_scaling or {}),
            rope_theta=self.rope_theta,
            rotary_dim=self.rotary_dim,
            max_position_embeddings=self.max_position_embeddings,
            original_max_position_embeddings=self.original_max_position_embeddings,
            where="Phi3Config: rope_parameters",
        )


class Phi3(Decoder):
    """Phi-3 as an Equinox module (see `Decoder`), called on one sequence of ids.

    PEFT names Phi-3's fused projections `qkv_proj` and `gate_up_proj`: adapters of
    `o_proj` and `down_proj` go to and from PEFT folders; adapters of the separate
    `q_proj`, `k_proj`, `v_proj`, `gate_proj` and `up_proj` have no PEFT module of
    their own (`rc.lora.save_peft` refuses them; merge them and save with `to_hf`).

    Example:
        >>> model = Phi3(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    config_class: ClassVar[type[hf.HFConfig]] = Phi3Config
