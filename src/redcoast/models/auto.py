"""Load any model of the zoo from a Hugging Face folder, the class picked by config.json."""

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Unpack

from .bart import BART
from .causal_lm import AbstractCausalLM
from .deepseek import DeepseekV3
from .gemma import Gemma2, Gemma3
from .gemma3_vision import Gemma3VL
from .gpt2 import GPT2
from .gptj import GPTJ
from .hf import LoadOptions, check_load_options, read_config
from .llama import Llama
from .llava import Llava
from .mistral import Mistral, Mixtral
from .opt import OPT
from .phi3 import Phi3
from .qwen import Qwen2, Qwen3, Qwen3Moe
from .seq2seq import AbstractSeq2SeqLM
from .t5 import T5
from .vision_encoder_decoder import VisionEncoderDecoder
from .vision_tower import CLIPVision, SiglipVision, VisionTower
from .vit import ViT, ViTClassifier

_CLASSES = (
    GPT2,
    OPT,
    GPTJ,
    T5,
    BART,
    VisionEncoderDecoder,
    ViT,
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Mistral,
    Mixtral,
    Gemma2,
    Gemma3,
    Phi3,
    DeepseekV3,
    CLIPVision,
    SiglipVision,
    Llava,
    Gemma3VL,
)
ZooModel = (
    AbstractCausalLM | AbstractSeq2SeqLM | ViT | ViTClassifier | VisionTower | Llava | Gemma3VL
)
"""What `from_hf` returns: a model of the zoo."""

ARCHITECTURES: dict[str, type[ZooModel]] = {cls.config_class.model_type: cls for cls in _CLASSES}
"""config.json's `model_type` -> the class that implements it."""

# Models of a `model_type` with a head of their own, which config.json's `architectures`
# names: `ViTForImageClassification` is a `vit`.
_HEADS: dict[str, type[ZooModel]] = {ViTClassifier.config_class.architecture: ViTClassifier}


def model_class(values: Mapping[str, Any], where: str = "config.json") -> type[ZooModel]:
    """The zoo class a parsed config.json describes: by its `architectures` where that
    names a model with a head of its own (`ViTForImageClassification`), else by its
    `model_type`.

    Raises:
        ValueError: `model_type` names an architecture redcoast does not implement; the
            message says `where` the config came from.
    """
    model_type = values.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{where} describes model_type={model_type!r} (architectures="
            f"{values.get('architectures')}), which redcoast does not implement; "
            f"supported model_type values: {sorted(ARCHITECTURES)}."
        )
    for name in values.get("architectures") or ():
        head = _HEADS.get(name)
        if head is not None and head.config_class.model_type == model_type:
            return head
    return ARCHITECTURES[model_type]


def from_hf(path: str | Path, **options: Unpack[LoadOptions]) -> ZooModel:
    """Load a `transformers` `save_pretrained` folder as the zoo model its `model_type` names.

    The `model_type`s: `gpt2`, `opt`, `gptj`, `llama` (1, 2, 3, 3.1, 3.2), `qwen2`
    (Qwen 2, 2.5), `qwen3`, `mistral`, `mixtral`, `gemma2`, `gemma3_text`, `phi3`,
    `deepseek_v3` (DeepSeek-V3, Moonlight), and the encoder-decoders `t5` and `bart`,
    the image encoder `vit` (a `ViTClassifier` when `architectures` says
    `ViTForImageClassification`) and the captioning `vision-encoder-decoder` (ViT +
    GPT-2), the vision towers `clip_vision_model` and `siglip_vision_model`, and the
    vision-language models `llava` and `gemma3` (Gemma 3 with images; `gemma3_text`
    is the text-only Gemma 3) (`ARCHITECTURES`).

    Args:
        path: the folder (config.json + safetensors).
        **options: `mesh`, `specs`, `fsdp`, `dtype`, `scan_layers`, `vocab_multiple`,
            `remat` and `quantize`, each a keyword (see `LoadOptions`), as for `HFModel.from_hf`.

    Returns:
        The model, of the class config.json's `model_type` names.

    Raises:
        ValueError: config.json names an architecture redcoast does not implement.
        TypeError: an option that `LoadOptions` does not name.

    Example:
        >>> model = rc.models.from_hf("tiny-llama", mesh=rc.make_mesh(2))
    """
    check_load_options(options)
    folder = Path(path)
    cls = model_class(read_config(folder), f"config.json in {folder}")
    return cls.from_hf(folder, **options)
