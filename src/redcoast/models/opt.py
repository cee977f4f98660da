"""OPT (Zhang et al. 2022): learned positions offset by 2, pre-LayerNorm, ReLU MLP, tied head."""

import dataclasses
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class OPTConfig(hf.HFConfig):
    """OPT's hyperparameters, named as in `transformers.OPTConfig` (and its config.json).

    Implemented: the pre-LayerNorm models (every OPT but 350m), with
    `word_embed_proj_dim == hidden_size`.

    Example:
        >>> config = OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
        ...                    num_attention_heads=4, max_position_embeddings=64,
        ...                    word_embed_proj_dim=32)
        >>> model = OPT(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "opt"
    architecture: ClassVar[str] = "OPTForCausalLM"
    sizes: ClassVar[tuple[str, ...]] = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "ffn_dim",
        "max_position_embeddings",
        "num_attention_heads",
        "word_embed_proj_dim",
    )
    divides: ClassVar[tuple[tuple[str, str], ...]] = (("num_attention_heads", "hidden_size"),)
    token_ids: ClassVar[Mapping[str, int | None]] = {
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
    }

    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    num_attention_heads: int = 12
    activation_function: str = "relu"
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    enable_bias: bool = True
    init_std: float = 0.02
    layer_norm_elementwise_affine: bool = True
    tie_word_embeddings: bool = True
    _remove_final_layer_norm: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(
            do_layer_norm_before=(self.do_layer_norm_before, True),
            word_embed_proj_dim=(self.word_embed_proj_dim or self.hidden_size, self.hidden_size),
            layer_norm_elementwise_affine=(self.layer_norm_elementwise_affine, True),
            _remove_final_layer_norm=(self._remove_final_layer_norm, False),
        )
        activation(self.activation_function)


class OPT(AbstractCausalLM):
    """OPT as an Equinox module, called on one unbatched sequence of token ids.

    Constructed with `(config, *, scan_layers, remat, attention, key)` (see
    `AbstractCausalLM.__init__`). Initialised as `transformers` does: weights and
    embeddings N(0, `init_std`), zero biases, the padding token's embedding zero
    (`pad_token_id`, 1 unless config.json says otherwise).

    Example:
        >>> config = OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
        ...                    num_attention_heads=4, max_position_embeddings=64)
        >>> model = OPT(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    config_class: ClassVar[type[hf.HFConfig]] = OPTConfig
    hf_base_prefix: ClassVar[str] = "model."
    position_offset: ClassVar[int] = 2
    tied_hf_tensors: ClassVar[Mapping[str, str]] = {
        "lm_head.weight": "model.decoder.embed_tokens.weight"
    }

    @classmethod
    def build(cls, config: OPTConfig, how: LayerOptions, key: PRNGKeyArray) -> CausalLMParts:
        c = config
        kt, kp, kh, kb = jax.random.split(key, 4)
        std = c.init_std

        def block(k: PRNGKeyArray) -> DecoderBlock:
            ka, km, kr = jax.random.split(k, 3)
            bias = c.enable_bias
            b = DecoderBlock(
                eqx.nn.LayerNorm(c.hidden_size),
                Attention(
                    c.hidden_size,
                    c.num_attention_heads,
                    qkv_bias=bias,
                    out_bias=bias,
                    recompute_scores=how.remat == "attention",
                    implementation=how.attention,
                    key=ka,
                ),
                eqx.nn.LayerNorm(c.hidden_size),
                MLP(
                    c.hidden_size,
                    c.ffn_dim,
                    activation=activation(c.activation_function),
                    use_bias=bias,
                    key=km,
                ),
            )
            return normal_init(b, std, key=kr)

        positions = eqx.nn.Embedding(
            c.max_position_embeddings + cls.position_offset, c.hidden_size, key=kp
        )
        return CausalLMParts(
            embed_tokens=token_embeddings(
                c, c.hidden_size, std, key=kt, padding_idx=c.token_id("pad_token_id")
            ),
            embed_positions=normal_init(positions, std, key=kp),
            blocks=make_stack(block, c.num_hidden_layers, scan_layers=how.scan_layers, key=kb),
            norm=eqx.nn.LayerNorm(c.hidden_size),
            lm_head=vocab_head(c, c.hidden_size, std, key=kh),
        )

    @classmethod
    def hf_tensors(cls, config: OPTConfig) -> list[hf.TensorMap]:
        """OPT's checkpoint names; PyTorch Linears are `(out, in)` like Equinox's."""
        d = "model.decoder."
        h = d + "layers.{i}."
        kinds = ("weight", "bias") if config.enable_bias else ("weight",)
        maps = [
            hf.vocab_rows(d + "embed_tokens.weight", "embed_tokens.weight", config),
            hf.same(d + "embed_positions.weight", "embed_positions.weight"),
            hf.same(d + "final_layer_norm.weight", "norm.weight"),
            hf.same(d + "final_layer_norm.bias", "norm.bias"),
        ]
        for kind in ("weight", "bias"):
            maps.append(hf.same(f"{h}self_attn_layer_norm.{kind}", f"attn_norm.{kind}"))
            maps.append(hf.same(f"{h}final_layer_norm.{kind}", f"mlp_norm.{kind}"))
        for theirs, ours in [
            ("self_attn.q_proj", "attn.q_proj"),
            ("self_attn.k_proj", "attn.k_proj"),
            ("self_attn.v_proj", "attn.v_proj"),
            ("self_attn.out_proj", "attn.o_proj"),
            ("fc1", "mlp.fc_in"),
            ("fc2", "mlp.fc_out"),
        ]:
            maps.extend(hf.same(f"{h}{theirs}.{kind}", f"{ours}.{kind}") for kind in kinds)
        if not config.tie_word_embeddings:
            maps.append(hf.vocab_rows("lm_head.weight", "lm_head.weight", config))
        return maps
