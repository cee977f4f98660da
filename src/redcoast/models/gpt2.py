"""GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm, GELU MLP, a head tied to
the token table (or its own, `tie_word_embeddings=False`)."""

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from . import hf
from ._stack import make_stack
from .causal_lm import AbstractCausalLM, CausalLMParts, LayerOptions
from .init import normal_init, token_embeddings, vocab_head
from .layers import MLP, Attention, DecoderBlock, activation
from .seq2seq import DecoderLayer, Seq2SeqAttention


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig(hf.HFConfig):
    """The hyperparameters GPT-2 and GPT-J share, named as in their config.json."""

    sizes: ClassVar[tuple[str, ...]] = (
        "vocab_size",
        "n_positions",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
    )
    divides: ClassVar[tuple[tuple[str, str], ...]] = (("n_head", "n_embd"),)
    token_ids: ClassVar[Mapping[str, int | None]] = {
        "pad_token_id": None,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
    }

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        super().__post_init__()
        activation(self.activation_function)

    @property
    def inner_size(self) -> int:
        """The MLP's width: `n_inner`, or 4 x `n_embd` when config.json gives none."""
        return self.n_inner or 4 * self.n_embd


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config(GPTConfig):
    """GPT-2's hyperparameters, named as in `transformers.GPT2Config` (and its config.json).

    Example:
        >>> config = GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4)
        >>> model = GPT2(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "gpt2"
    architecture: ClassVar[str] = "GPT2LMHeadModel"

    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False  # changes only the rounding, not the result
    tie_word_embeddings: bool = True
    add_cross_attention: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(
            scale_attn_weights=(self.scale_attn_weights, True),
            scale_attn_by_inverse_layer_idx=(self.scale_attn_by_inverse_layer_idx, False),
        )


class GPT2(AbstractCausalLM):
    """GPT-2 as an Equinox module, called on one unbatched sequence of token ids.

    Constructed with `(config, *, scan_layers, remat, attention, key)` (see
    `AbstractCausalLM.__init__`). Initialised as `transformers` does: weights and
    embeddings N(0, `initializer_range`), the residual projections (attention's and the
    MLP's `c_proj`) N(0, `initializer_range / sqrt(2 * n_layer)`), zero biases.

    Example:
        >>> config = GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4)
        >>> model = GPT2(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
        >>> model = GPT2.from_hf("gpt2-folder")  # a transformers save_pretrained folder
    """

    config_class: ClassVar[type[hf.HFConfig]] = GPT2Config
    hf_base_prefix: ClassVar[str] = "transformer."
    tied_hf_tensors: ClassVar[Mapping[str, str]] = {"lm_head.weight": "transformer.wte.weight"}

    @classmethod
    def build(cls, config: GPT2Config, how: LayerOptions, key: PRNGKeyArray) -> CausalLMParts:
        if config.add_cross_attention:
            raise ValueError(
                "GPT2Config(add_cross_attention=True) describes the decoder of an "
                "encoder-decoder, which GPT2 alone is not; load the whole model with "
                "rc.models.from_hf (a VisionEncoderDecoder), or set add_cross_attention=False."
            )
        c = config
        kt, kp, kb, kh = jax.random.split(key, 4)
        eps = c.layer_norm_epsilon
        std = c.initializer_range
        residual_std = std / math.sqrt(2 * c.n_layer)

        def block(k: PRNGKeyArray) -> DecoderBlock:
            ka, km, kr, ko, kf = jax.random.split(k, 5)
            attn = Attention(
                c.n_embd,
                c.n_head,
                qkv_bias=True,
                out_bias=True,
                recompute_scores=how.remat == "attention",
                implementation=how.attention,
                key=ka,
            )
            mlp = MLP(
                c.n_embd,
                c.inner_size,
                activation=activation(c.activation_function),
                key=km,
            )
            attn, mlp = normal_init((attn, mlp), std, key=kr)
            # GPT-2's scaled residual projections: each block adds two outputs to
            # the residual stream, so 2 * n_layer of them add up by the last layer.
            o_proj = normal_init(attn.o_proj, residual_std, key=ko)
            fc_out = normal_init(mlp.fc_out, residual_std, key=kf)
            return DecoderBlock(
                eqx.nn.LayerNorm(c.n_embd, eps=eps),
                eqx.tree_at(lambda a: a.o_proj, attn, o_proj),
                eqx.nn.LayerNorm(c.n_embd, eps=eps),
                eqx.tree_at(lambda m: m.fc_out, mlp, fc_out),
            )

        positions = eqx.nn.Embedding(c.n_positions, c.n_embd, key=kp)
        return CausalLMParts(
            embed_tokens=token_embeddings(c, c.n_embd, std, key=kt),
            embed_positions=normal_init(positions, std, key=kp),
            blocks=make_stack(block, c.n_layer, scan_layers=how.scan_layers, key=kb),
            norm=eqx.nn.LayerNorm(c.n_embd, eps=eps),
            lm_head=vocab_head(c, c.n_embd, std, key=kh),
        )

    @classmethod
    def hf_tensors(cls, config: GPT2Config) -> list[hf.TensorMap]:
        """GPT-2's checkpoint names; its Linears are `Conv1D`s stored `(in, out)`."""
        maps = [
            hf.vocab_rows("transformer.wte.weight", "embed_tokens.weight", config),
            hf.same("transformer.wpe.weight", "embed_positions.weight"),
            *block_tensors("transformer.h.{i}.", cross=False),
            hf.same("transformer.ln_f.weight", "norm.weight"),
            hf.same("transformer.ln_f.bias", "norm.bias"),
        ]
        if not config.tie_word_embeddings:
            maps.append(hf.vocab_rows("lm_head.weight", "lm_head.weight", config))
        return maps


def block_tensors(h: str, *, cross: bool) -> list[hf.TensorMap]:
    """A GPT-2 block's checkpoint names (`h` holds `{i}`), its cross-attention's too
    when `cross` (`add_cross_attention=True`), relative to one block of ours."""

    def parts(attn: str, ours: str, fused: tuple[str, ...]) -> list[hf.TensorMap]:
        return [
            hf.fused_conv1d(
                h + attn + ".c_attn.weight", tuple(f"{ours}.{p}.weight" for p in fused), bias=False
            ),
            hf.fused_conv1d(
                h + attn + ".c_attn.bias", tuple(f"{ours}.{p}.bias" for p in fused), bias=True
            ),
            hf.conv1d(h + attn + ".c_proj.weight", ours + ".o_proj.weight"),
            hf.same(h + attn + ".c_proj.bias", ours + ".o_proj.bias"),
        ]

    maps = [
        hf.same(h + "ln_1.weight", "attn_norm.weight"),
        hf.same(h + "ln_1.bias", "attn_norm.bias"),
        *parts("attn", "attn", ("q_proj", "k_proj", "v_proj")),
        hf.same(h + "ln_2.weight", "mlp_norm.weight"),
        hf.same(h + "ln_2.bias", "mlp_norm.bias"),
        hf.conv1d(h + "mlp.c_fc.weight", "mlp.fc_in.weight"),
        hf.same(h + "mlp.c_fc.bias", "mlp.fc_in.bias"),
        hf.conv1d(h + "mlp.c_proj.weight", "mlp.fc_out.weight"),
        hf.same(h + "mlp.c_proj.bias", "mlp.fc_out.bias"),
    ]
    if not cross:
        return maps
    return [
        *maps,
        hf.same(h + "ln_cross_attn.weight", "cross_norm.weight"),
        hf.same(h + "ln_cross_attn.bias", "cross_norm.bias"),
        *parts("crossattention", "cross_attn", ("k_proj", "v_proj")),
        hf.conv1d(h + "crossattention.q_attn.weight", "cross_attn.q_proj.weight"),
        hf.same(h + "crossattention.q_attn.bias", "cross_attn.q_proj.bias"),
    ]


def cross_attention_block(config: GPT2Config, *, remat: str, key: PRNGKeyArray) -> DecoderLayer:
    """A GPT-2 block with cross-attention (`add_cross_attention=True`): pre-norm causal
    self-attention, cross-attention to an encoder's output of width `n_embd`, the MLP.

    Initialised as `transformers` does GPT-2: N(0, `initializer_range`) weights, the
    three residual projections N(0, `initializer_range / sqrt(2 * n_layer)`), zero biases.
    """
    c = config
    ka, kc, km, kr, ko = jax.random.split(key, 5)
    head_dim = c.n_embd // c.n_head

    def attention(k: PRNGKeyArray) -> Seq2SeqAttention:
        return Seq2SeqAttention(
            c.n_embd,
            c.n_head,
            head_dim,
            use_bias=True,
            scale=head_dim**-0.5,
            recompute_scores=remat == "attention",
            key=k,
        )

    mlp = MLP(c.n_embd, c.inner_size, activation=activation(c.activation_function), key=km)
    attn, cross, mlp = normal_init((attention(ka), attention(kc), mlp), c.initializer_range, key=kr)
    residual_std = c.initializer_range / math.sqrt(2 * c.n_layer)
    outs = normal_init((attn.o_proj, cross.o_proj, mlp.fc_out), residual_std, key=ko)
    attn, cross, mlp = eqx.tree_at(
        lambda t: (t[0].o_proj, t[1].o_proj, t[2].fc_out), (attn, cross, mlp), outs
    )

    def norm() -> eqx.nn.LayerNorm:
        return eqx.nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)

    return DecoderLayer(norm(), attn, norm(), cross, norm(), mlp, post_norm=False)
