"""Named sizes of the zoo: the published configurations of GPT-2, LLaMA, GPT-J, OPT,
BART and T5 (the original T5 1.0: `t5-xxl` is the 11B model), and of today's
checkpoints: Llama 3.1 8B, Llama 3.2 1B and 3B, Qwen 2.5 7B, Qwen 3 8B, Mistral 7B (v0.1,
with its sliding window), Mixtral 8x7B, Qwen3-30B-A3B and Qwen3-235B-A22B, Gemma 2 9B,
Gemma 3 4B (with images: its SigLIP so400m tower at 896 pixels), Phi-3 mini (4k),
DeepSeek-V3 (671B, without its multi-token-prediction layer), Moonlight-16B-A3B, and
LLaVA-1.5 7B (CLIP ViT-L/14 at 336 pixels and Vicuna 7B).

`preset("llama-7b")` gives the class and config of that model, as its
`config.json` on the Hugging Face hub has them, so a model can be planned
(`rc.memory_plan`) or built (`sharded_init`) by name without downloading anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .bart import BART, BARTConfig
from .deepseek import DeepseekV3, DeepseekV3Config
from .gemma import Gemma2, Gemma2Config, Gemma3TextConfig
from .gemma3_vision import Gemma3Config, Gemma3VL
from .gpt2 import GPT2, GPT2Config
from .gptj import GPTJ, GPTJConfig
from .hf import HFConfig
from .llama import Llama, LlamaConfig
from .llava import Llava, LlavaConfig
from .mistral import Mistral, MistralConfig, Mixtral, MixtralConfig
from .opt import OPT, OPTConfig
from .phi3 import Phi3, Phi3Config
from .qwen import Qwen2, Qwen2Config, Qwen3, Qwen3Config, Qwen3Moe, Qwen3MoeConfig
from .t5 import T5, T5Config
from .vision_tower import CLIPVisionConfig, SiglipVisionConfig


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


def _llama3(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


_LLAMA_3 = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=_llama3(8.0),
)
"""Llama 3.1 8B."""


def _llama32(hidden: int, layers: int, heads: int, head_dim: int) -> LlamaConfig:
    """A Llama 3.2 model: Llama 3.1's with other sizes, RoPE factor 32 and a tied head."""
    return dataclasses.replace(
        _LLAMA_3,
        hidden_size=hidden,
        intermediate_size=8192,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        head_dim=head_dim,
        rope_scaling=_llama3(32.0),
        tie_word_embeddings=True,
    )


# The hub's config.json of each, sizes and RoPE (token ids aside).
_TODAY: dict[str, tuple[type[Any], HFConfig]] = {
    "llama-3.1-8b": (Llama, _LLAMA_3),
    "llama-3.2-1b": (Llama, _llama32(2048, 16, 32, 64)),
    "llama-3.2-3b": (Llama, _llama32(3072, 28, 24, 128)),
    "qwen2.5-7b": (
        Qwen2,
        Qwen2Config(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=131072,
            rope_theta=1000000.0,
            sliding_window=131072,
            max_window_layers=28,
        ),
    ),
    "qwen3-8b": (
        Qwen3,
        Qwen3Config(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
        ),
    ),
    "mistral-7b": (
        Mistral,
        MistralConfig(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            sliding_window=4096,
        ),
    ),
    "mixtral-8x7b": (
        Mixtral,
        MixtralConfig(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,
        ),
    ),
    "qwen3-30b-a3b": (
        Qwen3Moe,
        Qwen3MoeConfig(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            max_position_embeddings=40960,
            rope_theta=1e6,
        ),
    ),
    "qwen3-235b-a22b": (
        Qwen3Moe,
        Qwen3MoeConfig(
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            max_position_embeddings=40960,
            rope_theta=1e6,
        ),
    ),
    "gemma-2-9b": (
        Gemma2,
        Gemma2Config(
            vocab_size=256000,
            hidden_size=3584,
            intermediate_size=14336,
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=4096,
        ),
    ),
    "gemma-3-4b": (
        Gemma3VL,
        Gemma3Config(
            vision_config=SiglipVisionConfig(
                hidden_size=1152,
                intermediate_size=4304,
                num_hidden_layers=27,
                num_attention_heads=16,
                image_size=896,
                patch_size=14,
                vision_use_head=False,
            ),
            text_config=Gemma3TextConfig(
                vocab_size=262208,
                hidden_size=2560,
                intermediate_size=10240,
                num_hidden_layers=34,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=256,
                query_pre_attn_scalar=256,
                sliding_window=1024,
                rope_scaling={"rope_type": "linear", "factor": 8.0},
            ),
            mm_tokens_per_image=256,
        ),
    ),
    "phi-3-mini": (
        Phi3,
        Phi3Config(
            vocab_size=32064,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            sliding_window=2047,
        ),
    ),
    "deepseek-v3": (
        DeepseekV3,
        DeepseekV3Config(
            max_position_embeddings=163840,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    "moonlight-16b-a3b": (
        DeepseekV3,
        DeepseekV3Config(
            vocab_size=163840,
            hidden_size=2048,
            intermediate_size=11264,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_shared_experts=2,
            n_routed_experts=64,
            routed_scaling_factor=2.446,
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=50000.0,
        ),
    ),
}


# LLaVA-1.5 7B (llava-hf/llava-1.5-7b-hf): CLIP ViT-L/14 at 336 pixels, Vicuna-7B.
_LLAVA_15 = LlavaConfig(
    vision_config=CLIPVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
    ),
    text_config=dataclasses.replace(_llama(4096, 11008, 32, 32, positions=4096), vocab_size=32064),
    image_token_index=32000,
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
    **_TODAY,
    "llava-1.5-7b": (Llava, _LLAVA_15),
}
"""Preset name -> (model class, config)."""


def preset(name: str) -> tuple[type[Any], HFConfig]:
    """The model class and config of a named size.

    Args:
        name: one of `PRESETS` (`"gpt2-large"`, `"llama-7b"`, `"opt-66b"`,
            `"llama-3.1-8b"`, `"qwen3-8b"`, `"mixtral-8x7b"`, `"gemma-2-9b"`, ...).

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
