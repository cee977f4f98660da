"""Gemma 3 with images (Gemma Team 2025): a SigLIP vision tower, a projector pooling each
image's patches down to `mm_tokens_per_image` soft tokens, and Gemma 3's text decoder
reading them in place of the prompt's image tokens, `transformers`'
`Gemma3ForConditionalGeneration`.

The tower's last hidden states (after its final LayerNorm) are averaged over square
blocks of patches (`Gemma3MultiModalProjector`: 64 x 64 patches of an 896-pixel image
to 16 x 16 tokens), normed by a Gemma RMSNorm (`1 + weight`) and projected into the
decoder's width. They replace, in order, the embeddings of the tokens whose id is
`image_token_index` (the decoder scales its text embeddings by `sqrt(hidden_size)`,
not the images' features). Unlike text, an image's tokens attend to each other both
ways: each run of consecutive image tokens is a group whose tokens see the whole
group, on top of the causal mask and inside the local layers' sliding window
(`AbstractCausalLM.hidden`'s `bidirectional_groups`). Each part is split by the rules
as it would be alone; the projection is a Linear, which tensor parallelism keeps whole
(it writes the residual stream, as Megatron-LM keeps it) and FSDP splits.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..nn import Implementation, dense
from ..parallel import fsdp
from . import hf
from ._vlm import ImageTextModel, Pixels, decoder_class, under
from .gemma import Gemma3, Gemma3TextConfig
from .layers import OffsetRMSNorm, apply_norm
from .vision_tower import SiglipVision, SiglipVisionConfig, VisionTower


def _so400m() -> SiglipVisionConfig:
    """SigLIP so400m-patch14 at 896 pixels, without its head: the published Gemma 3's tower."""
    return SiglipVisionConfig(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=896,
        patch_size=14,
        vision_use_head=False,
    )


_PARTS: dict[str, type[hf.HFConfig]] = {
    "vision_config": SiglipVisionConfig,
    "text_config": Gemma3TextConfig,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config(hf.HFConfig):
    """Gemma 3's config with images, as `transformers.Gemma3Config` writes it: the tower's
    (`vision_config`, `siglip_vision_model`) and the decoder's (`text_config`,
    `gemma3_text`) nested.

    `mm_tokens_per_image` is the number of soft tokens an image becomes, a square
    whose side divides the tower's patches per side. `image_token_index` (config.json's
    `image_token_index` or `image_token_id`) is the placeholder the processor repeats
    `mm_tokens_per_image` times per image, between `boi_token_index` and
    `eoi_token_index`; it may lie past the decoder's vocabulary (its rows are replaced).
    The top-level `tie_word_embeddings` ties the head, as `transformers` reads it; the
    text config's is set to it. Like `transformers`' model, the text config's
    `final_logit_softcapping` is not applied (the published configs have none).

    Example:
        >>> config = Gemma3Config(
        ...     vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64,
        ...         num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4,
        ...         vision_use_head=False),
        ...     text_config=Gemma3TextConfig(vocab_size=128, hidden_size=32,
        ...         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        ...         num_key_value_heads=2, head_dim=8, sliding_window=8),
        ...     mm_tokens_per_image=4, image_token_index=127)
    """

    model_type: ClassVar[str] = "gemma3"
    architecture: ClassVar[str] = "Gemma3ForConditionalGeneration"
    sizes: ClassVar[tuple[str, ...]] = ("mm_tokens_per_image",)

    vision_config: SiglipVisionConfig = dataclasses.field(default_factory=_so400m)
    text_config: Gemma3TextConfig = dataclasses.field(default_factory=Gemma3TextConfig)
    mm_tokens_per_image: int = 256
    boi_token_index: int = 255999
    eoi_token_index: int = 256000
    image_token_index: int = 262144
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, want in _PARTS.items():
            if not isinstance(getattr(self, name), want):
                raise TypeError(
                    f"Gemma3Config: {name} is a {type(getattr(self, name)).__name__}; Gemma 3 "
                    f"takes a {want.__name__} there."
                )
        patches = self.patches_per_side
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image or patches % side:
            fits = [d * d for d in range(1, patches + 1) if patches % d == 0]
            raise ValueError(
                f"Gemma3Config: mm_tokens_per_image={self.mm_tokens_per_image} must be a "
                f"square whose side divides the tower's {patches} patches per side "
                f"(image_size / patch_size), which are averaged over square blocks: one of "
                f"{fits}."
            )
        if self.image_token_index < 0:
            raise ValueError(
                f"Gemma3Config: image_token_index={self.image_token_index} is not a token id; "
                "give the id of the image placeholder token (262144 in the published models)."
            )
        text = dataclasses.replace(
            self.text_config,
            vocab_multiple=self.vocab_multiple,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if text != self.text_config:
            object.__setattr__(self, "text_config", text)

    @property
    def vocab_size(self) -> int:
        """The decoder's vocabulary."""
        return self.text_config.vocab_size

    @property
    def patches_per_side(self) -> int:
        """The tower's patches along each side of an image."""
        return self.vision_config.image_size // self.vision_config.patch_size

    @property
    def image_tokens(self) -> int:
        """Soft tokens per image: `mm_tokens_per_image`."""
        return self.mm_tokens_per_image

    @classmethod
    def _normalise(cls, values: dict[str, Any]) -> dict[str, Any]:
        for name in ("image_token", "boi_token", "eoi_token"):
            if f"{name}_id" in values:
                values.setdefault(f"{name}_index", values.pop(f"{name}_id"))
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Gemma3Config":
        """The config from a `Gemma3ForConditionalGeneration`'s parsed config.json; a
        missing `vision_config` or `text_config` takes the field's default.

        Raises:
            ValueError: a part of another model type, or a text-only Gemma 3's settings
                under `model_type` `"gemma3"`.
        """
        values = dict(values)
        if "text_config" not in values and {"hidden_size", "num_hidden_layers"} & set(values):
            raise ValueError(
                "config.json has model_type='gemma3' (Gemma3ForConditionalGeneration, text "
                "and images) but a text model's settings at its top level and no text_config; "
                "a text-only Gemma 3 (Gemma3ForCausalLM) is model_type 'gemma3_text'."
            )
        for name, part in _PARTS.items():
            if values.get(name) is None:
                values.pop(name, None)
                continue
            given = dict(values[name])
            kind = given.get("model_type", part.model_type)
            if kind != part.model_type:
                raise ValueError(
                    f"config.json's {name} has model_type={kind!r}; redcoast's Gemma 3 reads "
                    f"{part.model_type!r} there."
                )
            values[name] = part.from_dict(given)
        return super().from_dict(values)  # pyright: ignore[reportReturnType]

    def to_dict(self) -> dict[str, Any]:
        """The config.json object, the tower's and decoder's nested."""
        out = super().to_dict()
        for name in _PARTS:
            part = getattr(self, name).to_dict()
            out[name] = {k: v for k, v in part.items() if k != "architectures"}
        return out


class Gemma3MultiModalProjector(eqx.Module):
    """Gemma 3's projector: each image's patch states averaged over square blocks down to
    `mm_tokens_per_image` tokens, normed (`mm_soft_emb_norm`, a `1 + weight` RMSNorm)
    and projected into the decoder's width (`mm_input_projection`, the checkpoint's
    `(vision, text)` `mm_input_projection_weight` as a Linear).

    Example:
        >>> projector = Gemma3MultiModalProjector(config, key=jax.random.key(0))
        >>> projector(jnp.zeros((16, 32))).shape       # 4 x 4 patches -> 2 x 2 tokens
        (4, 32)
    """

    mm_soft_emb_norm: OffsetRMSNorm
    mm_input_projection: eqx.nn.Linear
    patches_per_side: int = eqx.field(static=True)
    tokens_per_side: int = eqx.field(static=True)

    def __init__(self, config: Gemma3Config, *, key: PRNGKeyArray):
        v, width = config.vision_config, config.text_config.hidden_size
        linear = eqx.nn.Linear(v.hidden_size, width, use_bias=False, key=key)
        # transformers initialises the projection with zeros.
        self.mm_input_projection = eqx.tree_at(
            lambda m: m.weight, linear, jnp.zeros_like(linear.weight)
        )
        self.mm_soft_emb_norm = OffsetRMSNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.patches_per_side = config.patches_per_side
        self.tokens_per_side = math.isqrt(config.mm_tokens_per_image)

    def __call__(self, x: Float[Array, "patches vision"]) -> Float[Array, "tokens hidden"]:
        side, t = self.patches_per_side, self.tokens_per_side
        k = side // t
        # Patches are row-major (row, column); each token averages a k x k block.
        blocks = x.reshape(t, k, t, k, x.shape[-1])
        pooled = jnp.mean(blocks, axis=(1, 3)).reshape(t * t, x.shape[-1])
        return dense(self.mm_input_projection, apply_norm(self.mm_soft_emb_norm, pooled))


def image_groups(input_ids: Int[Array, " seq"], image_token: int) -> Int[Array, " seq"]:
    """Each token's image group for the bidirectional mask: runs of consecutive image
    tokens numbered 0, 1, ... in order, -1 for every other token (`transformers`'
    `get_block_sequence_ids_for_mask` of the processor's `token_type_ids`).

    Example:
        >>> image_groups(jnp.array([5, 9, 9, 6, 9, 9]), 9)
        Array([-1,  0,  0, -1,  1,  1], dtype=int32)
    """
    is_image = input_ids == image_token
    starts = is_image & ~jnp.concatenate([jnp.zeros((1,), bool), is_image[:-1]])
    return jnp.where(is_image, jnp.cumsum(starts, dtype=jnp.int32) - 1, -1)


class Gemma3VL(ImageTextModel):
    """Gemma 3 with images, called on one sequence and its images: `transformers`'
    `Gemma3ForConditionalGeneration` (`model_type` `"gemma3"`; a text-only checkpoint,
    `"gemma3_text"`, is a `Gemma3`).

    Args:
        config: the hyperparameters.
        scan_layers: stack each part's layers and run them with `lax.scan`.
        remat: rematerialise each layer in the backward pass (see `rc.remat`).
        attention: the decoder's attention implementation (see `rc.nn.attention`);
            the images' bidirectional mask needs `"auto"`, `"einsum"` or `"blockwise"`.
        key: for the initialisation: the tower and the decoder each as it initialises
            alone, the projection zeros and its norm the identity (as `transformers`).

    Example:
        >>> model = Gemma3VL(config, key=jax.random.key(0))
        >>> ids = jnp.array([1, 2, *[127] * config.image_tokens, 5, 6])
        >>> model(ids, jnp.zeros((1, 3, 16, 16))).shape    # one image
        (8, 128)
        >>> model = rc.models.from_hf("gemma-3-4b-it", mesh=rc.make_mesh(2))
    """

    config: Gemma3Config = eqx.field(static=True)
    projector: Gemma3MultiModalProjector

    config_class: ClassVar[type[hf.HFConfig]] = Gemma3Config

    def __init__(
        self,
        config: Gemma3Config,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        attention: Implementation = "auto",
        key: PRNGKeyArray,
    ):
        if not isinstance(config, Gemma3Config):
            raise TypeError(
                f"Gemma3VL takes a Gemma3Config, got {type(config).__name__}; build one with "
                "Gemma3Config(vision_config=..., text_config=...), or load a folder with "
                "rc.models.from_hf (a Gemma3TextConfig builds a text-only Gemma3)."
            )
        kv, kp, kt = jax.random.split(key, 3)
        c = config
        # As transformers' Gemma3ForConditionalGeneration: no final soft cap.
        text = dataclasses.replace(c.text_config, final_logit_softcapping=None)
        tower = cast(type[VisionTower], SiglipVision)  # built by VisionTower's constructor
        self.config = config
        self.vision_tower = tower(c.vision_config, scan_layers=scan_layers, remat=remat, key=kv)
        self.projector = Gemma3MultiModalProjector(c, key=kp)
        self.language_model = decoder_class(text)(
            text, scan_layers=scan_layers, remat=remat, attention=attention, key=kt
        )

    def image_features(self, pixel_values: Pixels) -> Float[Array, "images tokens hidden"]:
        """Each image's soft tokens in the decoder's width: the tower's last hidden
        states, pooled, normed and projected."""
        states = jax.vmap(self.vision_tower)(pixel_values)
        projector = fsdp.gather(self.projector, fsdp.layouts(self).projector)
        return jax.vmap(projector)(states)

    def bidirectional_groups(
        self, input_ids: Int[Array, " seq"], pixel_values: Pixels | None
    ) -> Int[Array, " seq"] | None:
        """Each image's tokens, which see each other both ways when images are given
        (`image_groups`); `None` for text alone (causal, as `transformers` without
        `token_type_ids`)."""
        if pixel_values is None:
            return None
        return image_groups(input_ids, self.config.image_token_index)

    @classmethod
    def hf_tensors(cls, config: Gemma3Config) -> list[hf.TensorMap]:
        """`Gemma3ForConditionalGeneration`'s checkpoint names as `transformers` 5 writes
        them: the tower's under `vision_tower.`, the projector's under
        `multi_modal_projector.` (its projection stored `(in, out)`, transposed), the
        decoder's under `language_model.`."""
        c = config
        mm = "multi_modal_projector."
        projector = [
            hf.conv1d(mm + "mm_input_projection_weight", "projector.mm_input_projection.weight"),
            hf.same(mm + "mm_soft_emb_norm.weight", "projector.mm_soft_emb_norm.weight"),
        ]
        return [
            *SiglipVision.hf_tensors(c.vision_config, "vision_tower.", "vision_tower."),
            *projector,
            *(under(m, "language_model.") for m in Gemma3.hf_tensors(c.text_config)),
        ]

    @classmethod
    def untied(cls, config: Gemma3Config) -> Gemma3Config | None:
        """`config` with the head untied (`AbstractCausalLM.untied`)."""
        if not config.tie_word_embeddings:
            return None
        return dataclasses.replace(config, tie_word_embeddings=False)
