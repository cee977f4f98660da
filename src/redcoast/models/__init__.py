"""Equinox models and the blocks they share.

The decoder zoo -- `GPT2`, `OPT`, `GPTJ`, and today's checkpoints on one
`Decoder`: `Llama` (1-3.2), `Qwen2`, `Qwen3`, `Mistral`, `Mixtral`, `Gemma2`,
`Gemma3`, `Phi3`; and `DeepseekV3` (DeepSeek-V3, Moonlight), whose layers attend
through a latent (`MLAttention`) -- loads from and saves to Hugging Face
`transformers` folders (`from_hf`, `to_hf`) and generates with a key/value cache
(`generate`). The encoder-decoders `T5` and `BART` do the same, and generate
greedily, by sampling or by beam search (`generate_seq2seq`); so does the captioning model
`VisionEncoderDecoder` (a `ViT` encoder and a GPT-2 decoder), from images, and the
image classifier `ViTClassifier` loads and saves alike, and so do the vision towers of
today's vision-language models (`CLIPVision`, `SiglipVision`) and `Llava`, a tower,
a projector and any decoder of the zoo reading images in place of their tokens, and
`Gemma3VL`, Gemma 3 with images (whose image tokens attend to each other both ways). `DiT`
goes the other way: a text-conditioned diffusion transformer with a DDIM sampler.
"""

from .auto import ARCHITECTURES as ARCHITECTURES
from .auto import from_hf as from_hf
from .bart import BART as BART
from .bart import BARTConfig as BARTConfig
from .causal_lm import AbstractCausalLM as AbstractCausalLM
from .causal_lm import CausalLMParts as CausalLMParts
from .causal_lm import LayerOptions as LayerOptions
from .causal_lm import OutputHead as OutputHead
from .decoder import Decoder as Decoder
from .decoder import DecoderConfig as DecoderConfig
from .deepseek import DeepseekV3 as DeepseekV3
from .deepseek import DeepseekV3Config as DeepseekV3Config
from .dit import DiT as DiT
from .dit import DiTConfig as DiTConfig
from .dit import ddim_sample as ddim_sample
from .dit import noise_prediction_loss as noise_prediction_loss
from .gemma import Gemma2 as Gemma2
from .gemma import Gemma2Config as Gemma2Config
from .gemma import Gemma3 as Gemma3
from .gemma import Gemma3TextConfig as Gemma3TextConfig
from .gemma3_vision import Gemma3Config as Gemma3Config
from .gemma3_vision import Gemma3MultiModalProjector as Gemma3MultiModalProjector
from .gemma3_vision import Gemma3VL as Gemma3VL
from .generation import generate as generate
from .gpt2 import GPT2 as GPT2
from .gpt2 import GPT2Config as GPT2Config
from .gpt2 import GPTConfig as GPTConfig
from .gptj import GPTJ as GPTJ
from .gptj import GPTJConfig as GPTJConfig
from .hf import HFConfig as HFConfig
from .hf import HFModel as HFModel
from .hf import MissingTensorError as MissingTensorError
from .layers import MLP as MLP
from .layers import Attention as Attention
from .layers import DecoderBlock as DecoderBlock
from .layers import KVCache as KVCache
from .layers import SwiGLU as SwiGLU
from .layers import activation as activation
from .layers import rotate as rotate
from .llama import Llama as Llama
from .llama import LlamaConfig as LlamaConfig
from .llava import Llava as Llava
from .llava import LlavaConfig as LlavaConfig
from .loss import lm_loss as lm_loss
from .loss import moe_lm_loss as moe_lm_loss
from .loss import next_token_nll as next_token_nll
from .mistral import Mistral as Mistral
from .mistral import MistralConfig as MistralConfig
from .mistral import Mixtral as Mixtral
from .mistral import MixtralConfig as MixtralConfig
from .mla import MLAttention as MLAttention
from .moe import Router as Router
from .moe import SparseMoE as SparseMoE
from .moe import load_balancing_loss as load_balancing_loss
from .moe import route_layers as route_layers
from .moe import router_z_loss as router_z_loss
from .moe import routing_metrics as routing_metrics
from .moe import with_dispatch as with_dispatch
from .opt import OPT as OPT
from .opt import OPTConfig as OPTConfig
from .phi3 import Phi3 as Phi3
from .phi3 import Phi3Config as Phi3Config
from .presets import PRESETS as PRESETS
from .presets import preset as preset
from .qwen import Qwen2 as Qwen2
from .qwen import Qwen2Config as Qwen2Config
from .qwen import Qwen3 as Qwen3
from .qwen import Qwen3Config as Qwen3Config
from .qwen import Qwen3Moe as Qwen3Moe
from .qwen import Qwen3MoeConfig as Qwen3MoeConfig
from .rope import RoPE as RoPE
from .seq2seq import AbstractSeq2SeqLM as AbstractSeq2SeqLM
from .seq2seq import Seq2SeqAttention as Seq2SeqAttention
from .seq2seq_generation import generate_seq2seq as generate_seq2seq
from .t5 import T5 as T5
from .t5 import T5Config as T5Config
from .vision_encoder_decoder import VisionEncoderDecoder as VisionEncoderDecoder
from .vision_encoder_decoder import VisionEncoderDecoderConfig as VisionEncoderDecoderConfig
from .vision_tower import CLIPVision as CLIPVision
from .vision_tower import CLIPVisionConfig as CLIPVisionConfig
from .vision_tower import SiglipVision as SiglipVision
from .vision_tower import SiglipVisionConfig as SiglipVisionConfig
from .vision_tower import VisionTower as VisionTower
from .vit import ViT as ViT
from .vit import ViTClassifier as ViTClassifier
from .vit import ViTClassifierConfig as ViTClassifierConfig
from .vit import ViTConfig as ViTConfig


def __getattr__(name: str) -> object:
    # `rc.models.dense` and `rc.models.normalise` were the zoo's; any model may use them.
    if name in ("dense", "normalise"):
        import warnings

        from ..nn import _layers as nn

        warnings.warn(
            f"rc.models.{name} is rc.nn.{name}; the old name goes in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(nn, name)
    raise AttributeError(f"module 'redcoast.models' has no attribute {name!r}")
