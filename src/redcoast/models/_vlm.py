"""What the zoo's vision-language models share (`Llava`, `Gemma3VL`): a vision tower, a
projector into the decoder's width, and a decoder of the zoo reading the projected image
features in place of the prompt's image tokens.

A model says how an image becomes features (`image_features`) and, if its image
tokens see each other both ways, their groups (`bidirectional_groups`); the rest is
here: the forward pass, the cached one that `rc.sampling` generates with, the
vocabulary's growth, and the checkpoint's names, which `transformers` 5 saves as 4.x
did and holds in other modules.
"""

import abc
import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray, Shaped

from .._checks import check_range
from ..parallel.place import placement_hint
from . import hf
from .causal_lm import AbstractCausalLM, Cache, OutputHead
from .vision_tower import VisionTower, stored_tower

Pixels = Shaped[Array, "images channels height width"]
"""A sequence's images, preprocessed as the checkpoint's processor makes them."""


def _decoders() -> Iterator[type[AbstractCausalLM]]:
    """Every decoder class of the zoo (each `AbstractCausalLM` subclass with a config)."""
    todo = list(AbstractCausalLM.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "config_class" in vars(cls):
            yield cls


def decoder_configs() -> dict[str, type[hf.HFConfig]]:
    """config.json's `model_type` -> the config class of each decoder of the zoo."""
    return {cls.config_class.model_type: cls.config_class for cls in _decoders()}


def decoder_class(config: hf.HFConfig) -> type[AbstractCausalLM]:
    """The zoo decoder built from `config` (a `LlamaConfig` -> `Llama`, ...).

    Raises:
        ValueError: no decoder of the zoo takes this config.
    """
    for cls in _decoders():
        if cls.config_class is type(config):
            return cls
    raise ValueError(
        f"no decoder of the zoo takes a {type(config).__name__}; a vision-language model's "
        "text_config must be a decoder's config (llama, qwen2, qwen3, mistral, gemma2, ...)."
    )


def under(m: hf.TensorMap, prefix: str) -> hf.TensorMap:
    """A part's tensor map inside a model that holds it as `prefix`'s field."""
    if m.per_layer:
        return dataclasses.replace(m, hf=prefix + m.hf, stack=prefix + m.stack)
    return dataclasses.replace(m, hf=prefix + m.hf, ours=tuple(prefix + o for o in m.ours))


class ImageTextModel(hf.HFModel):
    """A vision tower, a projector and a decoder, called on one sequence and its images.

    Attributes:
        config: (static) the hyperparameters: `vision_config`, `text_config`,
            `image_token_index` and `image_tokens` (features per image).
        vision_tower: CLIP's or SigLIP's vision transformer.
        projector: the tower's states to the decoder's width.
        language_model: a decoder of the zoo.
    """

    config: Any = eqx.field(static=True)
    vision_tower: VisionTower
    projector: Any
    language_model: AbstractCausalLM

    hf_base_prefix: ClassVar[str] = ""
    # transformers 5 saves the names of 4.x and holds the tensors in other modules.
    hf_modules: ClassVar[tuple[tuple[str, str], ...]] = (
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
    )
    # Read too: the hub's 4.x checkpoints (llava-hf/...) keep the tower's
    # `vision_model.`, and a state dict of 5's modules has their names.
    hf_aliases: ClassVar[tuple[tuple[str, str], ...]] = (
        ("vision_tower.", "vision_tower.vision_model."),
        *hf_modules,
    )

    @abc.abstractmethod
    def image_features(self, pixel_values: Pixels) -> Float[Array, "images tokens hidden"]:
        """Each image's features in the decoder's width."""

    def bidirectional_groups(
        self, input_ids: Int[Array, " seq"], pixel_values: Pixels | None
    ) -> Int[Array, " seq"] | None:
        """Groups of tokens that see each other both ways (`AbstractCausalLM.hidden`);
        `None`: every token attends causally."""
        del input_ids, pixel_values
        return None

    @property
    def vocab_size(self) -> int:
        """The decoder's vocabulary."""
        return self.language_model.vocab_size

    @property
    def max_positions(self) -> int | None:
        """The decoder's positions (`None` for rotary ones)."""
        return self.language_model.max_positions

    def trace_call(self) -> Float[Array, "seq vocab"]:
        """The call the sharding rules trace: one image and its image tokens (constants
        from outside the trace, which the rules take for data)."""
        c = self.config
        v = c.vision_config
        ids = np.full((c.image_tokens + 2,), c.image_token_index, np.int32)
        ids[0] = ids[-1] = 0 if c.image_token_index else 1
        pixels = np.zeros((1, v.num_channels, v.image_size, v.image_size), np.float32)
        return self(jnp.asarray(ids), jnp.asarray(pixels))

    def __call__(
        self,
        input_ids: Int[Array, " seq"],
        pixel_values: Pixels | None = None,
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq vocab"]:
        """Next-token logits at every position of one sequence, float32.

        Args:
            input_ids: token ids of one sequence (vmap for a batch), each image's
                `config.image_tokens` placeholders (`image_token_index`) where it goes,
                as the model's processor writes them (`rc.vision.chat_rows` does).
            pixel_values: the sequence's images, `(images, channels, size, size)`,
                preprocessed as the processor does (`rc.vision.preprocess`); `None`
                for text alone.
            positions, segment_ids: as for the decoder (`AbstractCausalLM.hidden`).
            key: accepted for the Equinox calling convention; unused.

        Raises:
            ValueError: images of another shape or integer pixels.
            RuntimeError: when the computation runs, the image tokens are not
                `images * image_tokens`, or a token id is outside the vocabulary.
        """
        del key
        x = self.hidden(input_ids, pixel_values, positions=positions, segment_ids=segment_ids)
        with placement_hint():
            return self.output_head()(x)

    def hidden(
        self,
        input_ids: Int[Array, " seq"],
        pixel_values: Pixels | None = None,
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> Float[Array, "seq hidden"]:
        """The decoder's last hidden states, before its final norm (as
        `AbstractCausalLM.hidden`), the images read in place of their tokens."""
        return self.language_model.hidden(
            input_ids,
            positions=positions,
            segment_ids=segment_ids,
            inputs_embeds=self.embeddings(input_ids, pixel_values),
            bidirectional_groups=self.bidirectional_groups(input_ids, pixel_values),
        )

    def output_head(self) -> OutputHead:
        """The decoder's final norm and vocabulary head (`AbstractCausalLM.output_head`)."""
        return self.language_model.output_head()

    def decode(
        self,
        input_ids: Int[Array, " seq"],
        cache: Cache,
        index: Int[Array, ""] | int,
        *,
        pixel_values: Pixels | None = None,
    ) -> tuple[Float[Array, "seq vocab"], Cache]:
        """The cached forward pass (`AbstractCausalLM.decode`): the prompt with its
        images first, then a token a step. `rc.sampling.generate(model, ids,
        prompt_inputs={"pixel_values": images})` generates from images."""
        return self.language_model.decode(
            input_ids,
            cache,
            index,
            inputs_embeds=self.embeddings(input_ids, pixel_values),
            bidirectional_groups=self.bidirectional_groups(input_ids, pixel_values),
        )

    def init_cache(self, max_len: int, dtype: DTypeLike | None = None) -> Cache:
        """The decoder's empty key/value cache for one sequence of `max_len` tokens."""
        return self.language_model.init_cache(max_len, dtype)

    def embeddings(self, input_ids: Int[Array, " seq"], pixel_values: Pixels | None) -> Array:
        """The decoder's input: the tokens' embeddings (scaled as the decoder scales
        them), the image tokens' replaced by the images' features in order.

        Raises:
            ValueError: images of another shape or integer pixels.
            RuntimeError: when the computation runs, the image tokens are not
                `images * image_tokens`.
        """
        if pixel_values is None:
            return self.language_model.token_embeddings(input_ids)
        if pixel_values.ndim != 4:
            raise ValueError(
                f"pixel_values of shape {pixel_values.shape}: {type(self).__name__} takes a "
                "sequence's images as (images, channels, height, width); for one image, "
                "pixels[None]."
            )
        image = self.config.image_token_index
        is_image = input_ids == image
        # Their rows are replaced: any id embeds them (Gemma 3's lies past the vocabulary).
        x = self.language_model.token_embeddings(jnp.where(is_image, 0, input_ids))
        with placement_hint():
            features = self.image_features(pixel_values)
        images, per_image = features.shape[:2]
        n = images * per_image
        features = features.reshape(n, -1).astype(x.dtype)
        count = check_range(
            jnp.sum(is_image, dtype=jnp.int32),
            n,
            n + 1,
            f"the image tokens (id {image}) of a sequence",
            f"Its {images} image(s) give {per_image} features each; put that many image "
            "tokens per image in input_ids, as the model's processor does "
            "(rc.vision.expand_images).",
        )
        slot = jnp.clip(jnp.cumsum(is_image) - 1, 0, count - 1)
        return jnp.where(is_image[:, None], features[slot], x)

    def with_vocab_size(self, vocab_size: int) -> "ImageTextModel":
        """The model with `vocab_size` token ids: its decoder's
        `AbstractCausalLM.with_vocab_size`, the config's `text_config` to match.

        Example:
            >>> tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
            >>> model = model.with_vocab_size(len(tokenizer))
        """
        decoder = self.language_model.with_vocab_size(vocab_size)
        config = dataclasses.replace(self.config, text_config=decoder.config)
        model = eqx.tree_at(lambda m: m.language_model, copy.copy(self), decoder)
        object.__setattr__(model, "config", config)  # static: the copy's own
        return model

    @classmethod
    def tied_copies(cls, config: Any) -> Mapping[str, str]:
        """The decoder's tied head, under `language_model.`."""
        tied = decoder_class(config.text_config).tied_copies(config.text_config)
        return {f"language_model.{k}": f"language_model.{v}" for k, v in tied.items()}

    @classmethod
    def stored_config(cls, config: Any, checkpoint: hf.SavedTensors) -> Any:
        """`config`, its tower's head and decoder's tie as the checkpoint stores them."""
        vision = stored_tower(config.vision_config, checkpoint, "vision_tower.")
        config = dataclasses.replace(config, vision_config=vision)
        return super().stored_config(config, checkpoint)
