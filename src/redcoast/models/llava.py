"""LLaVA (Liu et al. 2023): a vision tower, a two-layer MLP projector and a decoder of
the zoo reading the projected image features in place of the prompt's image tokens,
`transformers`' `LlavaForConditionalGeneration`.

The tower (CLIP's or SigLIP's) runs up to `vision_feature_layer`; its states there
(the class token dropped under the `"default"` strategy) go through the projector
into the decoder's width and replace, in order, the embeddings of the tokens whose
id is `image_token_index`, which the processor repeats once per image feature. Each
part is split by the rules as it would be alone: the tower's attention by heads,
the projector's two Linears one way then the other, the decoder as any decoder.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import check_choice
from ..nn import Implementation, dense
from ..parallel import fsdp
from . import hf
from ._vlm import ImageTextModel, Pixels, decoder_class, decoder_configs, under
from .init import normal_init
from .layers import activation
from .llama import LlamaConfig
from .vision_tower import (
    CLIPVision,
    CLIPVisionConfig,
    SiglipVision,
    VisionTower,
    VisionTowerConfig,
)

_TOWERS: dict[str, type[VisionTower]] = {
    cls.config_class.model_type: cls for cls in (CLIPVision, SiglipVision)
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlavaConfig(hf.HFConfig):
    """LLaVA's config, as `transformers.LlavaConfig` writes it: the tower's
    (`vision_config`: `clip_vision_model` or `siglip_vision_model`) and the decoder's
    (`text_config`: any decoder of the zoo) nested.

    `image_token_index` is the id of the image placeholder (config.json's
    `image_token_index`, or `image_token_id`); it must be a token of the decoder's
    vocabulary, whose row the image features replace.

    Example:
        >>> config = LlavaConfig(
        ...     vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64,
        ...         num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4),
        ...     text_config=LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
        ...         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        ...     image_token_index=99)
    """

    model_type: ClassVar[str] = "llava"
    architecture: ClassVar[str] = "LlavaForConditionalGeneration"

    vision_config: VisionTowerConfig = dataclasses.field(
        default_factory=lambda: CLIPVisionConfig(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=336,
            patch_size=14,
        )
    )
    text_config: hf.HFConfig = dataclasses.field(default_factory=LlamaConfig)
    image_token_index: int = 32000
    image_seq_length: int = 576
    projector_hidden_act: str = "gelu"
    vision_feature_select_strategy: str = "default"
    vision_feature_layer: int | tuple[int, ...] = -2
    multimodal_projector_bias: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if type(self.vision_config).model_type not in _TOWERS:
            raise TypeError(
                f"LlavaConfig: vision_config is a {type(self.vision_config).__name__}; the "
                f"tower must be one of {sorted(_TOWERS)} (CLIPVisionConfig, SiglipVisionConfig)."
            )
        decoder_class(self.text_config)
        check_choice(
            "vision_feature_select_strategy",
            self.vision_feature_select_strategy,
            ("default", "full"),
            '"default" drops the class token\'s state, "full" keeps every state.',
        )
        activation(self.projector_hidden_act)
        vocab = self.text_config.vocab_size  # type: ignore[attr-defined]
        if not 0 <= self.image_token_index < vocab:
            raise ValueError(
                f"LlavaConfig: image_token_index={self.image_token_index} is not a token of the "
                f"decoder's vocabulary of {vocab}; add the image token to the tokenizer and "
                "the decoder's vocabulary (resize its embeddings), and give its id."
            )
        for layer in self.feature_layers:
            n = self.vision_config.num_hidden_layers
            if not -n - 1 <= layer <= n:
                raise ValueError(
                    f"LlavaConfig: vision_feature_layer {layer} is not a hidden state of a "
                    f"{n}-layer tower ({-n - 1} to {n})."
                )
        if self.text_config.vocab_multiple != self.vocab_multiple:
            text = dataclasses.replace(self.text_config, vocab_multiple=self.vocab_multiple)
            object.__setattr__(self, "text_config", text)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The tower's hidden states the projector reads, concatenated in this order."""
        layer = self.vision_feature_layer
        return (layer,) if isinstance(layer, int) else tuple(layer)

    @property
    def vocab_size(self) -> int:
        """The decoder's vocabulary."""
        return self.text_config.vocab_size  # type: ignore[attr-defined]

    @property
    def image_tokens(self) -> int:
        """Features per image: the tower's states, less the class token under `"default"`."""
        v = self.vision_config
        states = v.num_patches + v.class_token
        return states - (self.vision_feature_select_strategy == "default")

    @classmethod
    def _normalise(cls, values: dict[str, Any]) -> dict[str, Any]:
        if "image_token_id" in values:
            values.setdefault("image_token_index", values.pop("image_token_id"))
        if isinstance(values.get("vision_feature_layer"), list):
            values["vision_feature_layer"] = tuple(values["vision_feature_layer"])
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "LlavaConfig":
        """The config from a `LlavaForConditionalGeneration`'s parsed config.json.

        Raises:
            ValueError: the tower or the decoder is not one the zoo implements.
        """
        values = dict(values)
        towers = {t: c.config_class for t, c in _TOWERS.items()}
        for name, known, default in (
            ("vision_config", towers, "clip_vision_model"),
            ("text_config", decoder_configs(), "llama"),
        ):
            given = dict(values.get(name) or {})
            kind = given.get("model_type", default)
            if kind not in known:
                raise ValueError(
                    f"config.json's {name} has model_type={kind!r}; redcoast's LLaVA reads "
                    f"{sorted(known)}."
                )
            values[name] = known[kind].from_dict(given)
        return super().from_dict(values)  # pyright: ignore[reportReturnType]

    def to_dict(self) -> dict[str, Any]:
        """The config.json object, the tower's and decoder's nested."""
        out = super().to_dict()
        for name in ("vision_config", "text_config"):
            part = getattr(self, name).to_dict()
            out[name] = {k: v for k, v in part.items() if k != "architectures"}
        if isinstance(self.vision_feature_layer, tuple):
            out["vision_feature_layer"] = list(self.vision_feature_layer)
        return out


class Projector(eqx.Module):
    """LLaVA's multimodal projector: Linear, activation, Linear, from the tower's width
    (times the feature layers) into the decoder's."""

    linear_1: eqx.nn.Linear
    linear_2: eqx.nn.Linear
    act: str = eqx.field(static=True)

    def __call__(self, x: Float[Array, "tokens vision"]) -> Float[Array, "tokens hidden"]:
        return dense(self.linear_2, activation(self.act)(dense(self.linear_1, x)))


class Llava(ImageTextModel):
    """A LLaVA, called on one sequence and its images: `transformers`'
    `LlavaForConditionalGeneration` (see `ImageTextModel` for its calls).

    Args:
        config: the hyperparameters.
        scan_layers: stack each part's layers and run them with `lax.scan`.
        remat: rematerialise each layer in the backward pass (see `rc.remat`).
        attention: the decoder's attention implementation (see `rc.nn.attention`).
        key: for the initialisation: each part as it initialises alone.

    Example:
        >>> model = Llava(config, key=jax.random.key(0))
        >>> ids = jnp.array([1, *[99] * config.image_tokens, 5, 6])
        >>> model(ids, jnp.zeros((1, 3, 16, 16))).shape    # one image
        (19, 100)
        >>> model = rc.models.from_hf("llava-folder", mesh=rc.make_mesh(2))
    """

    config: LlavaConfig = eqx.field(static=True)
    projector: Projector

    config_class: ClassVar[type[hf.HFConfig]] = LlavaConfig

    def __init__(
        self,
        config: LlavaConfig,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        attention: Implementation = "auto",
        key: PRNGKeyArray,
    ):
        if not isinstance(config, LlavaConfig):
            raise TypeError(
                f"Llava takes a LlavaConfig, got {type(config).__name__}; build one with "
                "LlavaConfig(vision_config=..., text_config=...) or load a folder with "
                "rc.models.from_hf."
            )
        kv, kp, kt = jax.random.split(key, 3)
        c = config
        decoder = decoder_class(c.text_config)(
            c.text_config, scan_layers=scan_layers, remat=remat, attention=attention, key=kt
        )
        tower = _TOWERS[c.vision_config.model_type]
        width = c.vision_config.hidden_size * len(c.feature_layers)
        hidden = decoder.embed_tokens.weight.shape[-1]  # GPT-2's n_embd, Llama's hidden_size
        bias = c.multimodal_projector_bias
        k1, k2 = jax.random.split(kp)
        linears = (
            eqx.nn.Linear(width, hidden, use_bias=bias, key=k1),
            eqx.nn.Linear(hidden, hidden, use_bias=bias, key=k2),
        )
        std = getattr(c.text_config, "initializer_range", 0.02)
        linears = normal_init(linears, std, key=kp)
        self.config = config
        self.vision_tower = tower(c.vision_config, scan_layers=scan_layers, remat=remat, key=kv)
        self.projector = Projector(*linears, act=c.projector_hidden_act)
        self.language_model = decoder

    def image_features(self, pixel_values: Pixels) -> Float[Array, "images tokens hidden"]:
        """Each image's features in the decoder's width: the tower's states at
        `vision_feature_layer` (each layer's, concatenated), projected."""
        c = self.config

        def one(image: Array) -> Array:
            states = self.vision_tower.hidden_states(image, c.feature_layers)
            if c.vision_feature_select_strategy == "default":
                states = [s[1:] for s in states]
            return jnp.concatenate(states, axis=-1)

        features = jax.vmap(one)(pixel_values)
        projector = fsdp.gather(self.projector, fsdp.layouts(self).projector)
        return jax.vmap(projector)(features)

    @classmethod
    def hf_tensors(cls, config: LlavaConfig) -> list[hf.TensorMap]:
        """`LlavaForConditionalGeneration`'s checkpoint names as `transformers` 5 writes
        them: the tower's under `vision_tower.`, the projector's under
        `multi_modal_projector.`, the decoder's under `language_model.`."""
        c = config
        tower = _TOWERS[c.vision_config.model_type]
        projector = [
            hf.same(f"multi_modal_projector.{name}.{w}", f"projector.{name}.{w}")
            for name in ("linear_1", "linear_2")
            for w in (("weight", "bias") if c.multimodal_projector_bias else ("weight",))
        ]
        return [
            *tower.hf_tensors(c.vision_config, "vision_tower.", "vision_tower."),
            *projector,
            *(
                under(m, "language_model.")
                for m in decoder_class(c.text_config).hf_tensors(c.text_config)
            ),
        ]

    @classmethod
    def untied(cls, config: LlavaConfig) -> LlavaConfig | None:
        """`config` with the decoder's head untied (`AbstractCausalLM.untied`)."""
        text = decoder_class(config.text_config).untied(config.text_config)
        return None if text is None else dataclasses.replace(config, text_config=text)
