"""BART (Lewis et al. 2020): learned positions with an offset of 2, a LayerNorm on the
embeddings, post-LayerNorm blocks, GELU feed-forward networks, a tied head plus
`final_logits_bias`."""

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..nn import RematPolicy, check_remat, normalise, tied_logits
from ..parallel import fsdp
from . import hf
from ._stack import make_stack
from .layers import MLP, activation
from .seq2seq import (
    AbstractSeq2SeqLM,
    DecoderLayer,
    EncoderLayer,
    Seq2SeqAttention,
    Stack,
    in_stack,
)

# fairseq's position tables start at row 2 (rows 0 and 1 were for padding).
POSITION_OFFSET = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class BARTConfig(hf.HFConfig):
    """BART's hyperparameters, named as in `transformers.BartConfig` (and its config.json).

    Example:
        >>> config = BARTConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
        ...     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        ...     decoder_ffn_dim=64, max_position_embeddings=64)
        >>> model = BART(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "bart"
    architecture: ClassVar[str] = "BartForConditionalGeneration"
    sizes: ClassVar[tuple[str, ...]] = (
        "vocab_size",
        "max_position_embeddings",
        "d_model",
        "encoder_layers",
        "encoder_ffn_dim",
        "encoder_attention_heads",
        "decoder_layers",
        "decoder_ffn_dim",
        "decoder_attention_heads",
    )
    divides: ClassVar[tuple[tuple[str, str], ...]] = (
        ("encoder_attention_heads", "d_model"),
        ("decoder_attention_heads", "d_model"),
    )

    vocab_size: int = 50265
    max_position_embeddings: int = 1024
    d_model: int = 1024
    encoder_layers: int = 12
    encoder_ffn_dim: int = 4096
    encoder_attention_heads: int = 16
    decoder_layers: int = 12
    decoder_ffn_dim: int = 4096
    decoder_attention_heads: int = 16
    activation_function: str = "gelu"
    scale_embedding: bool = False
    tie_word_embeddings: bool = True
    pad_token_id: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 2
    decoder_start_token_id: int = 2
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(tie_word_embeddings=(self.tie_word_embeddings, True))
        activation(self.activation_function)


class BART(AbstractSeq2SeqLM):
    """BART as an Equinox module, called on one source and one target sequence of token ids.

    Constructed as every `AbstractSeq2SeqLM` is, from its config.

    Example:
        >>> model = BART(config, key=jax.random.key(0))
        >>> model(jnp.arange(10), jnp.arange(4)).shape
        (4, 128)
    """

    config: BARTConfig = eqx.field(static=True)
    remat: RematPolicy = eqx.field(static=True)
    embed_tokens: eqx.nn.Embedding
    encoder_positions: eqx.nn.Embedding
    encoder_embed_norm: eqx.nn.LayerNorm
    encoder_blocks: Stack
    decoder_positions: eqx.nn.Embedding
    decoder_embed_norm: eqx.nn.LayerNorm
    decoder_blocks: Stack
    final_logits_bias: Float[Array, " vocab"]
    lm_head: eqx.nn.Linear | None

    config_class: ClassVar[type[hf.HFConfig]] = BARTConfig
    hf_base_prefix: ClassVar[str] = "model."
    tied_hf_tensors: ClassVar[Mapping[str, str]] = {
        "model.encoder.embed_tokens.weight": "model.shared.weight",
        "model.decoder.embed_tokens.weight": "model.shared.weight",
        "lm_head.weight": "model.shared.weight",
    }

    def __init__(
        self,
        config: BARTConfig,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        key: PRNGKeyArray,
    ):
        c = config
        keys = jax.random.split(key, 5)
        act = activation(c.activation_function)

        def attention(k: PRNGKeyArray, heads: int) -> Seq2SeqAttention:
            head_dim = c.d_model // heads
            return Seq2SeqAttention(
                c.d_model,
                heads,
                head_dim,
                use_bias=True,
                scale=head_dim**-0.5,
                recompute_scores=remat == "attention",
                key=k,
            )

        def norm() -> eqx.nn.LayerNorm:
            return eqx.nn.LayerNorm(c.d_model)

        def encoder_layer(k: PRNGKeyArray) -> EncoderLayer:
            ka, kf = jax.random.split(k)
            mlp = MLP(c.d_model, c.encoder_ffn_dim, activation=act, key=kf)
            return EncoderLayer(
                norm(), attention(ka, c.encoder_attention_heads), norm(), mlp, post_norm=True
            )

        def decoder_layer(k: PRNGKeyArray) -> DecoderLayer:
            ka, kc, kf = jax.random.split(k, 3)
            heads = c.decoder_attention_heads
            mlp = MLP(c.d_model, c.decoder_ffn_dim, activation=act, key=kf)
            return DecoderLayer(
                norm(),
                attention(ka, heads),
                norm(),
                attention(kc, heads),
                norm(),
                mlp,
                post_norm=True,
            )

        rows = c.max_position_embeddings + POSITION_OFFSET
        self.config = config
        self.remat = check_remat(remat)
        self.embed_tokens = eqx.nn.Embedding(c.padded_vocab_size, c.d_model, key=keys[0])
        self.encoder_positions = eqx.nn.Embedding(rows, c.d_model, key=keys[1])
        self.encoder_embed_norm = norm()
        self.encoder_blocks = make_stack(
            encoder_layer, c.encoder_layers, scan_layers=scan_layers, key=keys[2]
        )
        self.decoder_positions = eqx.nn.Embedding(rows, c.d_model, key=keys[3])
        self.decoder_embed_norm = norm()
        self.decoder_blocks = make_stack(
            decoder_layer, c.decoder_layers, scan_layers=scan_layers, key=keys[4]
        )
        self.final_logits_bias = jax.numpy.zeros((c.padded_vocab_size,))
        self.lm_head = None

    @property
    def max_positions(self) -> int:
        """The longest source or target sequence the position tables allow."""
        return self.config.max_position_embeddings

    def _embed(
        self, ids: Int[Array, " seq"], positions: Int[Array, " seq"], decoder: bool
    ) -> Float[Array, "seq hidden"]:
        use = fsdp.layouts(self)
        x = jax.vmap(fsdp.gather(self.embed_tokens, use.embed_tokens))(ids)
        if self.config.scale_embedding:
            x = x * math.sqrt(self.config.d_model)
        if decoder:
            table = fsdp.gather(self.decoder_positions, use.decoder_positions)
            norm = fsdp.gather(self.decoder_embed_norm, use.decoder_embed_norm)
        else:
            table = fsdp.gather(self.encoder_positions, use.encoder_positions)
            norm = fsdp.gather(self.encoder_embed_norm, use.encoder_embed_norm)
        return normalise(norm, x + jax.vmap(table)(positions + POSITION_OFFSET))

    def _final(self, x: Float[Array, "seq hidden"], decoder: bool) -> Float[Array, "seq hidden"]:
        return x  # post-norm blocks end normed

    def _bias(self, queries: Int[Array, " seq"], keys: Int[Array, " kv"], decoder: bool) -> None:
        return None

    def _head(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq vocab"]:
        use = fsdp.layouts(self)
        table = fsdp.gather(self.embed_tokens, use.embed_tokens)
        return tied_logits(table, x) + fsdp.gather(self.final_logits_bias, use.final_logits_bias)

    @classmethod
    def hf_tensors(cls, config: BARTConfig) -> list[hf.TensorMap]:
        """BART's checkpoint names (`BartForConditionalGeneration`)."""

        def linear(hf_name: str, ours: str) -> list[hf.TensorMap]:
            return [hf.same(f"{hf_name}.{p}", f"{ours}.{p}") for p in ("weight", "bias")]

        def block(prefix: str, cross: bool) -> list[hf.TensorMap]:
            maps = []
            parts = [("self_attn", "attn", "self_attn_layer_norm", "attn_norm")]
            if cross:
                parts.append(
                    ("encoder_attn", "cross_attn", "encoder_attn_layer_norm", "cross_norm")
                )
            for attn, ours, norm, ours_norm in parts:
                for p in ("q_proj", "k_proj", "v_proj"):
                    maps += linear(f"{prefix}.{attn}.{p}", f"{ours}.{p}")
                maps += linear(f"{prefix}.{attn}.out_proj", f"{ours}.o_proj")
                maps += linear(f"{prefix}.{norm}", ours_norm)
            maps += linear(f"{prefix}.fc1", "mlp.fc_in") + linear(f"{prefix}.fc2", "mlp.fc_out")
            return maps + linear(f"{prefix}.final_layer_norm", "mlp_norm")

        vocab, padded = config.vocab_size, config.padded_vocab_size

        def bias_in(x: np.ndarray) -> tuple[np.ndarray, ...]:
            if x.shape != (1, vocab):
                raise ValueError(f"expected (1, {vocab}) (1, vocab_size), got {x.shape}")
            return (np.concatenate([x[0], np.zeros(padded - vocab, x.dtype)]),)

        def bias_out(xs: tuple[np.ndarray, ...]) -> np.ndarray:
            return xs[0][None, :vocab]

        return [
            hf.vocab_rows("model.shared.weight", "embed_tokens.weight", config),
            hf.same("model.encoder.embed_positions.weight", "encoder_positions.weight"),
            hf.same("model.decoder.embed_positions.weight", "decoder_positions.weight"),
            *linear("model.encoder.layernorm_embedding", "encoder_embed_norm"),
            *linear("model.decoder.layernorm_embedding", "decoder_embed_norm"),
            hf.TensorMap("final_logits_bias", ("final_logits_bias",), bias_in, bias_out),
            *in_stack(block("model.encoder.layers.{i}", False), "encoder_blocks"),
            *in_stack(block("model.decoder.layers.{i}", True), "decoder_blocks"),
        ]
