"""LLaMA (Touvron et al. 2023): RoPE, RMSNorm, SwiGLU, grouped-query attention."""

import dataclasses
from typing import Any, ClassVar

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from ..nn import Implementation, Norm, RematPolicy, check_remat
from . import hf
from ._stack import make_stack
from .causal_lm import AbstractCausalLM, Blocks
from .init import normal_init, zero_unused_rows
from .layers import Attention, DecoderBlock, SwiGLU, activation


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(hf.HFConfig):
    """LLaMA's hyperparameters, named as in `transformers.LlamaConfig` (and its config.json).

    `rope_theta` is read from `rope_parameters` (transformers 5) or from the top level
    (transformers 4); only the default RoPE (no scaling) is implemented.

    Example:
        >>> config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...                      num_hidden_layers=2, num_attention_heads=4,
        ...                      num_key_value_heads=2)
        >>> model = Llama(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"
    sizes: ClassVar[tuple[str, ...]] = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    )
    # Each key/value head serves an equal group of query heads. The hidden size need
    # not divide by the heads: transformers takes head_dim = hidden // heads, as the zoo does.
    divides: ClassVar[tuple[tuple[str, str], ...]] = (
        ("num_key_value_heads", "num_attention_heads"),
    )

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        activation(self.hidden_act)

    @classmethod
    def _normalise(cls, values: dict[str, Any]) -> dict[str, Any]:
        for key in ("rope_parameters", "rope_scaling"):
            rope = values.pop(key, None)
            if rope is None:
                continue
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind != "default":
                raise ValueError(
                    f"LlamaConfig: {key} has rope_type={kind!r}; only the default RoPE "
                    "(rope_type='default', no scaling) is implemented."
                )
            if "rope_theta" in rope:
                values.setdefault("rope_theta", rope["rope_theta"])
        return values

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        # transformers 5 reads rope_parameters; transformers 4 reads rope_theta.
        out["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        return dict(sorted(out.items()))


class Llama(AbstractCausalLM):
    """LLaMA as an Equinox module, called on one unbatched sequence of token ids.

    Args:
        config: the hyperparameters.
        scan_layers: stack the layers and run them with `lax.scan` (faster compiles).
        remat: rematerialise each block in the backward pass: `"none"`, `"dots"`
            (keep the projections' outputs), `"attention"` (all but attention's scores)
            or `"full"` (see `rc.remat`).
        attention: how attention computes: `"auto"`, `"einsum"` (the score matrix
            written out), `"blockwise"` (flash-style blocks that never hold it),
            `"cudnn"` or `"pallas"` (see `rc.nn.attention`).
        key: for the random initialisation, as `transformers`': weights and embeddings
            N(0, `initializer_range`), zero biases, the padding token's embedding zero.

    Example:
        >>> config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...                      num_hidden_layers=2, num_attention_heads=4,
        ...                      num_key_value_heads=2)
        >>> model = Llama(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    config: LlamaConfig = eqx.field(static=True)
    embed_tokens: eqx.nn.Embedding
    embed_positions: eqx.nn.Embedding | None
    blocks: Blocks
    norm: Norm
    lm_head: eqx.nn.Linear | None
    remat: RematPolicy = eqx.field(static=True)

    config_class: ClassVar[type[hf.HFConfig]] = LlamaConfig
    hf_base_prefix: ClassVar[str] = "model."
    tied_hf_tensors: ClassVar[tuple[str, ...]] = ("lm_head.weight",)

    def __init__(
        self,
        config: LlamaConfig,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        attention: Implementation = "auto",
        key: PRNGKeyArray,
    ):
        c = config
        kt, kh, kb = jax.random.split(key, 3)
        head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
        std = c.initializer_range

        def block(k: PRNGKeyArray) -> DecoderBlock:
            ka, km, kr = jax.random.split(k, 3)
            b = DecoderBlock(
                eqx.nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps, use_bias=False),
                Attention(
                    c.hidden_size,
                    c.num_attention_heads,
                    num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
                    head_dim=head_dim,
                    rotary_dim=head_dim,
                    rope_base=c.rope_theta,
                    qkv_bias=c.attention_bias,
                    out_bias=c.attention_bias,
                    recompute_scores=remat == "attention",
                    implementation=attention,
                    key=ka,
                ),
                eqx.nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps, use_bias=False),
                SwiGLU(
                    c.hidden_size,
                    c.intermediate_size,
                    activation=activation(c.hidden_act),
                    use_bias=c.mlp_bias,
                    key=km,
                ),
            )
            return normal_init(b, std, key=kr)

        self.config = config
        self.remat = check_remat(remat)
        tokens = eqx.nn.Embedding(c.padded_vocab_size, c.hidden_size, key=kt)
        self.embed_tokens = zero_unused_rows(
            normal_init(tokens, std, key=kt), c.vocab_size, c.get_extra("pad_token_id")
        )
        self.embed_positions = None
        self.blocks = make_stack(block, c.num_hidden_layers, scan_layers=scan_layers, key=kb)
        self.norm = eqx.nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps, use_bias=False)
        head = eqx.nn.Linear(c.hidden_size, c.padded_vocab_size, use_bias=False, key=kh)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else zero_unused_rows(normal_init(head, std, key=kh), c.vocab_size)
        )

    @classmethod
    def hf_tensors(cls, config: LlamaConfig) -> list[hf.TensorMap]:
        """LLaMA's checkpoint names; PyTorch Linears are `(out, in)` like Equinox's."""
        h = "model.layers.{i}."
        maps = [
            hf.vocab_rows("model.embed_tokens.weight", "embed_tokens.weight", config),
            hf.same(h + "input_layernorm.weight", "attn_norm.weight"),
            hf.same(h + "post_attention_layernorm.weight", "mlp_norm.weight"),
            hf.same("model.norm.weight", "norm.weight"),
        ]
        projections = [("self_attn", "attn", p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [("mlp", "mlp", p) for p in ("gate_proj", "up_proj", "down_proj")]
        for theirs, ours, name in projections:
            has_bias = config.attention_bias if ours == "attn" else config.mlp_bias
            for kind in ("weight", "bias") if has_bias else ("weight",):
                maps.append(hf.same(f"{h}{theirs}.{name}.{kind}", f"{ours}.{name}.{kind}"))
        if not config.tie_word_embeddings:
            maps.append(hf.vocab_rows("lm_head.weight", "lm_head.weight", config))
        return maps
