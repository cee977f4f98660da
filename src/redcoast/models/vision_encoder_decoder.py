"""Image captioning: a ViT encoder and a GPT-2 decoder with cross-attention, the model
`transformers` calls `VisionEncoderDecoderModel` (Li et al. 2021's TrOCR, ViT-GPT2).

The decoder is GPT-2 built from the encoder-decoders' `DecoderLayer`s (pre-norm, causal
self-attention, cross-attention to the image's patches, the MLP); when the widths differ
a Linear (`enc_to_dec_proj`) maps the encoder's output to the decoder's. Being an
`AbstractSeq2SeqLM` whose source is an image, it trains, splits and generates (greedy,
sampling or beam search with `generate_seq2seq`) as `T5` and `BART` do.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, Shaped

from ..nn import RematPolicy, check_remat, dense, normalise, tied_logits
from ..parallel import fsdp
from . import hf
from ._stack import Stack, make_stack
from .gpt2 import GPT2Config, block_tensors, cross_attention_block
from .init import normal_init, token_embeddings
from .seq2seq import AbstractSeq2SeqLM, in_stack
from .vit import ViT, ViTConfig, check_pixels

_PARAMS = ("weight", "bias")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionEncoderDecoderConfig(hf.HFConfig):
    """The captioning model's config, as `transformers.VisionEncoderDecoderConfig` writes it:
    the encoder's (a `ViTConfig`) and the decoder's (a `GPT2Config` with
    `add_cross_attention=True`) nested, with the generation's token ids beside them.

    Example:
        >>> config = VisionEncoderDecoderConfig(
        ...     encoder=ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                       intermediate_size=64, image_size=16, patch_size=4),
        ...     decoder=GPT2Config(vocab_size=20, n_positions=16, n_embd=32, n_layer=2,
        ...                        n_head=4, add_cross_attention=True),
        ...     decoder_start_token_id=1, eos_token_id=2, pad_token_id=0)
    """

    model_type: ClassVar[str] = "vision-encoder-decoder"
    architecture: ClassVar[str] = "VisionEncoderDecoderModel"

    encoder: ViTConfig = dataclasses.field(default_factory=ViTConfig)
    decoder: GPT2Config = dataclasses.field(
        default_factory=lambda: GPT2Config(add_cross_attention=True)
    )
    decoder_start_token_id: int | None = None
    pad_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, want in (("encoder", ViTConfig), ("decoder", GPT2Config)):
            got = getattr(self, name)
            if not isinstance(got, want):
                raise TypeError(
                    f"VisionEncoderDecoderConfig: {name} must be a {want.__name__} "
                    f"(model_type {want.model_type!r}), got {type(got).__name__}; redcoast's "
                    "vision encoder-decoder is a ViT encoder and a GPT-2 decoder."
                )
        if not self.decoder.add_cross_attention:
            raise ValueError(
                "VisionEncoderDecoderConfig: the decoder has add_cross_attention=False, so it "
                "cannot attend to the image; build its GPT2Config with add_cross_attention=True."
            )
        if not self.decoder.tie_word_embeddings:
            raise ValueError(
                "VisionEncoderDecoderConfig: the decoder has tie_word_embeddings=False, a head "
                "of its own, which redcoast's captioner does not have: its logits come from "
                "the decoder's token table. Build its GPT2Config with tie_word_embeddings=True."
            )

    @property
    def vocab_size(self) -> int:
        """The decoder's vocabulary."""
        return self.decoder.vocab_size

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "VisionEncoderDecoderConfig":
        """The config from a `VisionEncoderDecoderModel`'s parsed config.json.

        Raises:
            ValueError: the encoder is not a ViT or the decoder not a GPT-2.
        """
        values = dict(values)
        for name, part in (("encoder", ViTConfig), ("decoder", GPT2Config)):
            given = values.get(name)
            got = given.get("model_type") if isinstance(given, Mapping) else None
            if got != part.model_type:
                raise ValueError(
                    f"config.json's {name} has model_type={got!r}; redcoast's vision "
                    f"encoder-decoder reads a {part.model_type!r} {name} (a ViT encoder and "
                    "a GPT-2 decoder). Save the model with such an encoder and decoder."
                )
            values[name] = part.from_dict(given)  # type: ignore[arg-type]
        return super().from_dict(values)  # pyright: ignore[reportReturnType]

    def to_dict(self) -> dict[str, Any]:
        """The config.json object, the encoder's and decoder's nested."""
        out = super().to_dict()
        out["encoder"] = self.encoder.to_dict()
        out["decoder"] = {k: v for k, v in self.decoder.to_dict().items() if k != "architectures"}
        return out


class VisionEncoderDecoder(AbstractSeq2SeqLM):
    """A ViT encoder and a GPT-2 decoder with cross-attention, called on one image and
    one caption: `transformers`' `VisionEncoderDecoderModel`.

    Constructed as every `AbstractSeq2SeqLM` is, from its config.

    Example:
        >>> model = VisionEncoderDecoder(config, key=jax.random.key(0))
        >>> model(jnp.zeros((3, 16, 16)), jnp.array([1, 5, 7])).shape
        (3, 20)
        >>> rc.models.generate_seq2seq(model, images, max_new_tokens=12, num_beams=3)
    """

    config: VisionEncoderDecoderConfig = eqx.field(static=True)
    remat: RematPolicy = eqx.field(static=True)
    encoder: ViT
    enc_to_dec_proj: eqx.nn.Linear | None
    embed_tokens: eqx.nn.Embedding
    embed_positions: eqx.nn.Embedding
    decoder_blocks: Stack
    norm: eqx.nn.LayerNorm
    lm_head: eqx.nn.Linear | None

    config_class: ClassVar[type[hf.HFConfig]] = VisionEncoderDecoderConfig
    tied_hf_tensors: ClassVar[Mapping[str, str]] = {
        "decoder.lm_head.weight": "decoder.transformer.wte.weight"
    }

    def __init__(
        self,
        config: VisionEncoderDecoderConfig,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        key: PRNGKeyArray,
    ):
        c, d = config, config.decoder
        ke, kp, kt, kpos, kb = jax.random.split(key, 5)
        std = d.initializer_range
        self.config = config
        self.remat = check_remat(remat)
        self.encoder = ViT(c.encoder, scan_layers=scan_layers, remat=remat, key=ke)
        self.enc_to_dec_proj = None
        if c.encoder.hidden_size != d.n_embd:
            proj = eqx.nn.Linear(c.encoder.hidden_size, d.n_embd, key=kp)
            self.enc_to_dec_proj = normal_init(proj, std, key=kp)
        self.embed_tokens = token_embeddings(c, d.n_embd, std, key=kt)
        positions = eqx.nn.Embedding(d.n_positions, d.n_embd, key=kpos)
        self.embed_positions = normal_init(positions, std, key=kpos)

        def block(k: PRNGKeyArray) -> Any:
            return cross_attention_block(d, remat=remat, key=k)

        self.decoder_blocks = make_stack(block, d.n_layer, scan_layers=scan_layers, key=kb)
        self.norm = eqx.nn.LayerNorm(d.n_embd, eps=d.layer_norm_epsilon)
        self.lm_head = None

    @property
    def encoder_blocks(self) -> Stack:
        """The ViT's layers."""
        return self.encoder.blocks

    @property
    def max_positions(self) -> int:
        """The longest caption (start token included) the decoder's position table allows."""
        return self.config.decoder.n_positions

    def special_token(self, name: str) -> int | None:
        """A token id of the config (`decoder_start_token_id`, `eos_token_id`, ...), or
        the decoder's when the config has none, as `transformers`' `generate` reads them."""
        value = super().special_token(name)
        if value is None:
            value = getattr(self.config.decoder, name, None)
        if value is None:
            value = self.config.decoder.get_extra(name)
        return None if value is None else int(value)

    def trace_call(self) -> Array:
        """The call the sharding rules trace when none is given: an image of zeros and
        eight token ids, constants from outside the trace (data to the rules)."""
        e = self.config.encoder
        pixels = np.zeros((e.num_channels, e.image_size, e.image_size), np.float32)
        return self(jnp.asarray(pixels), jnp.asarray(hf.TRACE_IDS))

    def generation_source(
        self, source: ArrayLike, attention_mask: ArrayLike | None
    ) -> tuple[Array, Array]:
        """Check a batch of images for `generate_seq2seq`; every patch is attended to.

        Raises:
            ValueError: the images are not `(batch, channels, height, width)` floats of
                the encoder's size, or an `attention_mask` is given.
        """
        pixels = jnp.asarray(source)
        if attention_mask is not None:
            raise ValueError(
                "attention_mask is for padded token sources; a VisionEncoderDecoder attends "
                "to every patch of the image. Pass attention_mask=None."
            )
        if pixels.ndim != 4:
            raise ValueError(
                f"pixel_values of shape {pixels.shape}: generation takes a batch of images, "
                "(batch, channels, height, width). For one image use pixel_values[None]."
            )
        check_pixels(pixels[0], self.config.encoder, "each image of pixel_values")
        tokens = self.config.encoder.num_patches + 1
        return pixels, jnp.ones((pixels.shape[0], tokens), jnp.int32)

    def encode(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        pixel_values: Shaped[Array, "channels height width"],
        attention_mask: Bool[ArrayLike, " src"] | Int[ArrayLike, " src"] | None = None,
    ) -> Float[Array, "tokens hidden"]:
        """The ViT's output for one image, mapped to the decoder's width.

        Args:
            pixel_values: one image, `(num_channels, image_size, image_size)`, floats.
            attention_mask: unused (every patch is attended to); accepted so that
                generation treats images as it treats token sources.
        """
        del attention_mask
        x = self.encoder(pixel_values)
        if self.enc_to_dec_proj is None:
            return x
        return dense(fsdp.gather(self.enc_to_dec_proj, fsdp.layouts(self).enc_to_dec_proj), x)

    def __call__(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        pixel_values: Shaped[Array, "channels height width"],
        decoder_input_ids: Int[Array, " seq"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq vocab"]:
        """Next-token logits at every caption position, teacher-forced.

        Args:
            pixel_values: one image (vmap for a batch), `(channels, height, width)`.
            decoder_input_ids: the start token, then the caption without its last token.
            key: accepted for the Equinox calling convention; unused (no dropout).

        Raises:
            ValueError: the image has the wrong shape or dtype, or the caption is longer
                than the decoder's position table.
        """
        del key
        return self._teacher_forced(pixel_values, decoder_input_ids, None)

    def _embed(
        self, ids: Int[Array, " seq"], positions: Int[Array, " seq"], decoder: bool
    ) -> Float[Array, "seq hidden"]:
        use = fsdp.layouts(self)
        x = jax.vmap(fsdp.gather(self.embed_tokens, use.embed_tokens))(ids)
        return x + jax.vmap(fsdp.gather(self.embed_positions, use.embed_positions))(positions)

    def _final(self, x: Float[Array, "seq hidden"], decoder: bool) -> Float[Array, "seq hidden"]:
        return normalise(fsdp.gather(self.norm, fsdp.layouts(self).norm), x)

    def _bias(self, queries: Int[Array, " seq"], keys: Int[Array, " kv"], decoder: bool) -> None:
        return None

    def _head(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq vocab"]:
        table = fsdp.gather(self.embed_tokens, fsdp.layouts(self).embed_tokens)
        return tied_logits(table, x).astype(jnp.float32)

    @classmethod
    def hf_tensors(cls, config: VisionEncoderDecoderConfig) -> list[hf.TensorMap]:
        """`VisionEncoderDecoderModel`'s checkpoint names: `encoder.` (a `ViTModel`),
        `enc_to_dec_proj.` when the widths differ, `decoder.` (a `GPT2LMHeadModel`)."""
        t = "decoder.transformer."
        proj = []
        if config.encoder.hidden_size != config.decoder.n_embd:
            proj = [
                hf.same(f"enc_to_dec_proj.{p}", f"enc_to_dec_proj.{p}") for p in ("weight", "bias")
            ]
        return [
            *ViT.hf_tensors(config.encoder, prefix="encoder.", ours="encoder."),
            *proj,
            hf.vocab_rows(t + "wte.weight", "embed_tokens.weight", config),
            hf.same(t + "wpe.weight", "embed_positions.weight"),
            *in_stack(block_tensors(t + "h.{i}.", cross=True), "decoder_blocks"),
            hf.same(t + "ln_f.weight", "norm.weight"),
            hf.same(t + "ln_f.bias", "norm.bias"),
        ]
