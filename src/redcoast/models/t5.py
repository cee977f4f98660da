"""T5 (Raffel et al. 2020) and its v1.1 / Flan-T5 variant: relative position buckets,
pre-RMSNorm blocks without biases, ReLU or gated-GELU feed-forward networks."""

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..nn import RematPolicy, check_remat, normalise, tied_logits
from ..parallel import fsdp
from . import hf
from ._stack import make_stack
from .layers import MLP, SwiGLU, activation
from .seq2seq import (
    AbstractSeq2SeqLM,
    DecoderLayer,
    EncoderLayer,
    Seq2SeqAttention,
    Stack,
    in_stack,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class T5Config(hf.HFConfig):
    """T5's hyperparameters, named as in `transformers.T5Config` (and its config.json).

    `feed_forward_proj="relu"` is T5 v1.0; `"gated-gelu"` is v1.1 and Flan-T5, whose
    head is untied (`tie_word_embeddings=False`). The decoder's output is rescaled by
    `d_model ** -0.5` before the head when `scale_decoder_outputs` (config.json, as
    transformers 5 writes it) says so, else when the head is tied (v1.0).

    Example:
        >>> config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
        ...                   num_heads=4)
        >>> model = T5(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "t5"
    architecture: ClassVar[str] = "T5ForConditionalGeneration"
    # Heads need not divide d_model: each has d_kv features of its own.
    sizes: ClassVar[tuple[str, ...]] = (
        "vocab_size",
        "d_model",
        "d_kv",
        "d_ff",
        "num_layers",
        "num_decoder_layers",
        "num_heads",
        "relative_attention_num_buckets",
        "relative_attention_max_distance",
    )

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0  # written out, so that transformers' generate finds it

    def __post_init__(self) -> None:
        super().__post_init__()
        parts = self.feed_forward_proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise ValueError(
                f"T5Config: feed_forward_proj={self.feed_forward_proj!r} is not 'ACT' or "
                "'gated-ACT' (e.g. 'relu', 'gated-gelu')."
            )
        activation(self.act_name)

    @property
    def gated(self) -> bool:
        """The feed-forward network is gated (v1.1): `wo(act(wi_0 x) * wi_1 x)`."""
        return self.feed_forward_proj.startswith("gated-")

    @property
    def act_name(self) -> str:
        """The activation's name; transformers runs "gated-gelu" with the tanh GELU."""
        name = self.feed_forward_proj.split("-")[-1]
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else name

    @property
    def scale_decoder_outputs(self) -> bool:
        """Whether the decoder output is multiplied by `d_model ** -0.5` before the head."""
        return bool(self.get_extra("scale_decoder_outputs", self.tie_word_embeddings))


def relative_position_bucket(
    relative: Int[Array, "..."], *, bidirectional: bool, num_buckets: int, max_distance: int
) -> Int[Array, "..."]:
    """T5's bucket of each relative position `key - query`: exact when small, log-spaced up
    to `max_distance`; the encoder's buckets tell left from right, the decoder's look back.

    Example:
        >>> relative_position_bucket(jnp.arange(-3, 4), bidirectional=True, num_buckets=32,
        ...                          max_distance=128).tolist()
        [3, 2, 1, 0, 17, 18, 19]
    """
    buckets = jnp.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = (relative > 0).astype(relative.dtype) * num_buckets
        relative = jnp.abs(relative)
    else:
        relative = -jnp.minimum(relative, 0)
    exact = num_buckets // 2
    # float32 throughout, as transformers computes it: a bucket edge must land the same.
    scaled = jnp.log(relative.astype(jnp.float32) / exact) / math.log(max_distance / exact)
    large = exact + (scaled * (num_buckets - exact)).astype(relative.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(relative < exact, relative, large)


class T5(AbstractSeq2SeqLM):
    """T5 as an Equinox module, called on one source and one target sequence of token ids.

    Constructed as every `AbstractSeq2SeqLM` is, from its config.

    Example:
        >>> config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
        ...                   num_heads=4)
        >>> model = T5(config, key=jax.random.key(0))
        >>> model(jnp.arange(10), jnp.arange(4)).shape
        (4, 128)
    """

    config: T5Config = eqx.field(static=True)
    remat: RematPolicy = eqx.field(static=True)
    embed_tokens: eqx.nn.Embedding
    encoder_position_bias: eqx.nn.Embedding
    encoder_blocks: Stack
    encoder_norm: eqx.nn.RMSNorm
    decoder_position_bias: eqx.nn.Embedding
    decoder_blocks: Stack
    decoder_norm: eqx.nn.RMSNorm
    lm_head: eqx.nn.Linear | None

    config_class: ClassVar[type[hf.HFConfig]] = T5Config
    tied_hf_tensors: ClassVar[Mapping[str, str]] = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
        "lm_head.weight": "shared.weight",
    }

    def __init__(
        self,
        config: T5Config,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        key: PRNGKeyArray,
    ):
        c = config
        keys = jax.random.split(key, 6)

        def norm() -> eqx.nn.RMSNorm:
            return eqx.nn.RMSNorm(c.d_model, eps=c.layer_norm_epsilon, use_bias=False)

        def attention(k: PRNGKeyArray) -> Seq2SeqAttention:
            return Seq2SeqAttention(
                c.d_model,
                c.num_heads,
                c.d_kv,
                use_bias=False,
                scale=1.0,
                recompute_scores=remat == "attention",
                key=k,
            )

        def ffn(k: PRNGKeyArray) -> MLP | SwiGLU:
            act = activation(c.act_name)
            if c.gated:
                return SwiGLU(c.d_model, c.d_ff, activation=act, key=k)
            return MLP(c.d_model, c.d_ff, activation=act, use_bias=False, key=k)

        def encoder_layer(k: PRNGKeyArray) -> EncoderLayer:
            ka, kf = jax.random.split(k)
            return EncoderLayer(norm(), attention(ka), norm(), ffn(kf), post_norm=False)

        def decoder_layer(k: PRNGKeyArray) -> DecoderLayer:
            ka, kc, kf = jax.random.split(k, 3)
            return DecoderLayer(
                norm(), attention(ka), norm(), attention(kc), norm(), ffn(kf), post_norm=False
            )

        n_decoder = c.num_layers if c.num_decoder_layers is None else c.num_decoder_layers
        buckets = c.relative_attention_num_buckets
        self.config = config
        self.remat = check_remat(remat)
        self.embed_tokens = eqx.nn.Embedding(c.padded_vocab_size, c.d_model, key=keys[0])
        self.encoder_position_bias = eqx.nn.Embedding(buckets, c.num_heads, key=keys[1])
        self.encoder_blocks = make_stack(
            encoder_layer, c.num_layers, scan_layers=scan_layers, key=keys[2]
        )
        self.encoder_norm = norm()
        self.decoder_position_bias = eqx.nn.Embedding(buckets, c.num_heads, key=keys[3])
        self.decoder_blocks = make_stack(
            decoder_layer, n_decoder, scan_layers=scan_layers, key=keys[4]
        )
        self.decoder_norm = norm()
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else eqx.nn.Linear(c.d_model, c.padded_vocab_size, use_bias=False, key=keys[5])
        )

    @property
    def max_positions(self) -> None:
        """T5 has relative positions only: no length limit."""
        return None

    def _embed(
        self, ids: Int[Array, " seq"], positions: Int[Array, " seq"], decoder: bool
    ) -> Float[Array, "seq hidden"]:
        use = fsdp.layouts(self)
        return jax.vmap(fsdp.gather(self.embed_tokens, use.embed_tokens))(ids)

    def _final(self, x: Float[Array, "seq hidden"], decoder: bool) -> Float[Array, "seq hidden"]:
        use = fsdp.layouts(self)
        if decoder:
            return normalise(fsdp.gather(self.decoder_norm, use.decoder_norm), x)
        return normalise(fsdp.gather(self.encoder_norm, use.encoder_norm), x)

    def _bias(
        self, queries: Int[Array, " seq"], keys: Int[Array, " kv"], decoder: bool
    ) -> Float[Array, "heads seq kv"]:
        c = self.config
        buckets = relative_position_bucket(
            keys[None, :] - queries[:, None],
            bidirectional=not decoder,
            num_buckets=c.relative_attention_num_buckets,
            max_distance=c.relative_attention_max_distance,
        )
        use = fsdp.layouts(self)
        if decoder:
            table = fsdp.gather(self.decoder_position_bias, use.decoder_position_bias)
        else:
            table = fsdp.gather(self.encoder_position_bias, use.encoder_position_bias)
        return jnp.transpose(table.weight[buckets], (2, 0, 1))

    def _head(self, x: Float[Array, "seq hidden"]) -> Float[Array, "seq vocab"]:
        if self.config.scale_decoder_outputs:
            x = x * self.config.d_model**-0.5
        use = fsdp.layouts(self)
        if self.lm_head is not None:
            return jax.vmap(fsdp.gather(self.lm_head, use.lm_head))(x)
        return tied_logits(fsdp.gather(self.embed_tokens, use.embed_tokens), x)

    @classmethod
    def hf_tensors(cls, config: T5Config) -> list[hf.TensorMap]:
        """T5's checkpoint names (`T5ForConditionalGeneration`)."""

        def attention(prefix: str, ours: str) -> list[hf.TensorMap]:
            return [hf.same(f"{prefix}.{p}.weight", f"{ours}.{p}_proj.weight") for p in "qkvo"]

        def ffn(prefix: str) -> list[hf.TensorMap]:
            if config.gated:
                names = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))
            else:
                names = (("wi", "fc_in"), ("wo", "fc_out"))
            return [
                hf.same(f"{prefix}.DenseReluDense.{a}.weight", f"mlp.{b}.weight") for a, b in names
            ]

        enc, dec = "encoder.block.{i}.layer", "decoder.block.{i}.layer"
        encoder = [
            *attention(f"{enc}.0.SelfAttention", "attn"),
            hf.same(f"{enc}.0.layer_norm.weight", "attn_norm.weight"),
            *ffn(f"{enc}.1"),
            hf.same(f"{enc}.1.layer_norm.weight", "mlp_norm.weight"),
        ]
        decoder = [
            *attention(f"{dec}.0.SelfAttention", "attn"),
            hf.same(f"{dec}.0.layer_norm.weight", "attn_norm.weight"),
            *attention(f"{dec}.1.EncDecAttention", "cross_attn"),
            hf.same(f"{dec}.1.layer_norm.weight", "cross_norm.weight"),
            *ffn(f"{dec}.2"),
            hf.same(f"{dec}.2.layer_norm.weight", "mlp_norm.weight"),
        ]
        bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        maps = [
            hf.vocab_rows("shared.weight", "embed_tokens.weight", config),
            hf.same(f"encoder.{bias}", "encoder_position_bias.weight"),
            hf.same("encoder.final_layer_norm.weight", "encoder_norm.weight"),
            hf.same(f"decoder.{bias}", "decoder_position_bias.weight"),
            hf.same("decoder.final_layer_norm.weight", "decoder_norm.weight"),
            *in_stack(encoder, "encoder_blocks"),
            *in_stack(decoder, "decoder_blocks"),
        ]
        if not config.tie_word_embeddings:
            maps.append(hf.vocab_rows("lm_head.weight", "lm_head.weight", config))
        return maps
