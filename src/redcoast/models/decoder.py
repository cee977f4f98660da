"""The one decoder of today's checkpoints: LLaMA's shape with its variants as options.

LLaMA 1-3, Qwen 2/2.5/3, Mistral, Mixtral, Gemma 2/3 and Phi-3 are the same
decoder -- token embeddings, pre-norm blocks of grouped-query attention with rotary
positions and a gated MLP, a final RMSNorm and a vocabulary head -- differing where
a flag says so. `DecoderConfig` holds the shared hyperparameters (named as in
`transformers`' configs) and says, property by property, how a family differs:

| option | families |
|---|---|
| `rope_scaling` (`linear`, `dynamic`, `yarn`, `longrope`, `llama3`) | Llama 3.x, Phi-3 |
| `has_qkv_bias`, `has_o_bias`, `has_mlp_bias` | Qwen 2 (Q/K/V), LLaMA, Qwen 3, Gemma |
| `qk_norm`: RMSNorm of each query and key head | Qwen 3, Gemma 3 |
| `layer_types` / a sliding window per layer | Mistral, Qwen, Gemma 2/3, Phi-3 |
| `norm_offset`: norms scale by `1 + weight` | Gemma |
| `post_norms`: a norm after attention and after the MLP | Gemma |
| `embed_scale`, `attn_scale`, `attn_softcap`, `final_softcap` | Gemma |
| `experts`: a sparse mixture of experts for the MLP | Mixtral |
| `fused_projections`: `qkv_proj` and `gate_up_proj` in the checkpoint | Phi-3 |

`Decoder` builds a model from any of them and maps it to the checkpoint's tensors;
a family is a config class (its fields, defaults and what it refuses) and a
subclass of `Decoder` naming it. Layers whose attention differs (Gemma's local and
global layers, Qwen's windows above `max_window_layers`) get their window and
rotation at the call: a tuple of layers each its own, scanned layers by
`lax.switch` on the layer's kind.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..nn import Implementation
from . import hf
from ._stack import make_stack
from .causal_lm import AbstractCausalLM, CausalLMParts, LayerOptions
from .init import normal_init, token_embeddings, vocab_head
from .layers import (
    AnyNorm,
    Attention,
    DecoderBlock,
    LayerAttention,
    OffsetRMSNorm,
    SwiGLU,
    activation,
)
from .moe import Router, SparseMoE, route_layers
from .rope import RoPE, rope_from_parameters

__all__ = ["Decoder", "DecoderConfig"]

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


def _freeze(value: Any) -> Any:
    """A JSON value made hashable: objects become sorted (key, value) tuples, lists tuples."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(settings: dict[str, Any] | None) -> dict[str, Any]:
    """The rope settings as a JSON object (tuples of numbers as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (settings or {}).items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig(hf.HFConfig):
    """The hyperparameters every family shares, named as in `transformers`' configs.

    RoPE: `rope_theta` and `rope_scaling` (`rope_type` and its settings, or `None`
    for the default rotation) are read from config.json's `rope_parameters`
    (transformers 5) or `rope_scaling` and `rope_theta` (transformers 4), and written
    as `rope_parameters`. A family overrides the properties below where it differs.
    """

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
    # not divide by the heads: head_dim says each head's width.
    divides: ClassVar[tuple[tuple[str, str], ...]] = (
        ("num_key_value_heads", "num_attention_heads"),
    )
    # The theta transformers takes when config.json names none.
    default_theta: ClassVar[float] = 10000.0
    # Whether the family rotates part of each head (`partial_rotary_factor`, Phi-3).
    partial_rotation: ClassVar[bool] = False
    # config.json keys this family's transformers class does not read, with the value
    # that means what it computes anyway: another value asks for a variant neither
    # transformers nor redcoast implements, an error rather than a model ignoring it.
    unread: ClassVar[dict[str, Any]] = {"mlp_bias": False, "attention_bias": False}
    token_ids: ClassVar[Mapping[str, int | None]] = {
        "pad_token_id": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }

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
    rope_scaling: Any = None
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every family compares and hashes as this class does: set before the family's
        # own @dataclass runs, which keeps an `__eq__` and `__hash__` a class defines.
        super().__init_subclass__(**kwargs)
        cls.__eq__ = DecoderConfig.__eq__  # type: ignore[method-assign]
        cls.__hash__ = DecoderConfig.__hash__  # type: ignore[method-assign]

    def _key(self) -> tuple[Any, ...]:
        return (type(self), *(_freeze(getattr(self, f.name)) for f in dataclasses.fields(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DecoderConfig) and self._key() == other._key()

    def __hash__(self) -> int:
        # JSON objects and lists (`rope_scaling`, `layer_types`) are kept as given and
        # hashed frozen: a config is static data of a model.
        return hash(self._key())

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        names = {f.name for f in dataclasses.fields(self)}
        for key, value in self.unread.items():
            got = self.get_extra(key, value)
            if key not in names and got != value:
                raise ValueError(
                    f"{name}: {key}={got!r} asks for a variant of {self.model_type} that "
                    f"transformers' {self.architecture} does not build (it ignores {key}) "
                    f"and neither does redcoast; only {key}={value!r} is this model."
                )
        if self.partial_rotary_factor != 1.0 and not self.partial_rotation:
            raise ValueError(
                f"{name}: partial_rotary_factor={self.partial_rotary_factor} is not "
                f"implemented for {self.model_type} (its rotation covers whole heads)."
            )
        activation(self.activation_name)
        for kind in self.layer_types_resolved:
            if kind not in LAYER_TYPES:
                raise ValueError(
                    f"{type(self).__name__}: layer_types has {kind!r}; the layer types are "
                    f"{', '.join(LAYER_TYPES)}."
                )
        self.layer_attention()  # every rotation and window, checked now

    # ------------------------------------------------------------------ options

    @property
    def activation_name(self) -> str:
        """The MLP's activation (`hidden_act`; Gemma: `hidden_activation`)."""
        return self.hidden_act

    @property
    def head_size(self) -> int:
        """Each head's width: `head_dim`, or `hidden_size // num_attention_heads`."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `num_key_value_heads`, or as many as query heads."""
        return self.num_key_value_heads or self.num_attention_heads

    # What a family has or not, whatever its config says (the options that follow a
    # config.json field are the properties below).
    qk_norm: ClassVar[bool] = False
    norm_offset: ClassVar[bool] = False
    # A mixture's tensors in the checkpoint: `{layer}{experts_prefix}gate.weight` and
    # `...experts.{e}.{name}.weight` for the gate, up and down projections.
    experts_prefix: ClassVar[str] = "block_sparse_moe."
    expert_names: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")
    post_norms: ClassVar[bool] = False
    fused_projections: ClassVar[bool] = False

    @property
    def has_qkv_bias(self) -> bool:
        """The Q, K and V projections have biases (`attention_bias`, where the family has it)."""
        return bool(getattr(self, "attention_bias", False))

    @property
    def has_o_bias(self) -> bool:
        """The output projection has a bias (`attention_bias`, where the family has it)."""
        return bool(getattr(self, "attention_bias", False))

    @property
    def has_mlp_bias(self) -> bool:
        """The MLP's projections have biases."""
        return False

    @property
    def embed_scale(self) -> float | None:
        """The token embeddings' scale (Gemma: `sqrt(hidden_size)`), or `None`."""
        return None

    @property
    def attn_scale(self) -> float | None:
        """The attention scores' scale; `None` for `1 / sqrt(head_dim)`."""
        return None

    @property
    def attn_softcap(self) -> float | None:
        """Attention scores' soft cap, or `None`."""
        return None

    @property
    def final_softcap(self) -> float | None:
        """The logits' soft cap, or `None`."""
        return None

    @property
    def experts(self) -> tuple[int, int] | None:
        """`(num_experts, top_k)` of a mixture-of-experts MLP, or `None` for a dense one."""
        return None

    @property
    def expert_size(self) -> int:
        """Each expert's intermediate size (Qwen3-MoE: `moe_intermediate_size`)."""
        return self.intermediate_size

    @property
    def router(self) -> Router:
        """How a mixture's router picks the experts (Mixtral's: softmax, renormalised)."""
        return Router()

    @property
    def rotary_dim(self) -> int:
        """How many features of each head rotate (all but Phi-3's `partial_rotary_factor`)."""
        return self.head_size

    @property
    def layer_types_resolved(self) -> tuple[str, ...]:
        """Each layer's `full_attention` or `sliding_attention`."""
        return (FULL,) * self.num_hidden_layers

    def listed_layer_types(self) -> tuple[str, ...] | None:
        """config.json's `layer_types` (Qwen, Gemma), one per layer, or `None` without it."""
        listed = getattr(self, "layer_types", None)
        if listed is not None and len(listed) != self.num_hidden_layers:
            raise ValueError(
                f"{type(self).__name__}: layer_types has {len(listed)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}; give one per layer."
            )
        return None if listed is None else tuple(listed)

    @property
    def window(self) -> int | None:
        """The sliding window of `sliding_attention` layers (and of every layer, for
        families whose windows are not per layer)."""
        return None

    def rope_for(self, layer_type: str) -> RoPE:
        """The rotation of layers of `layer_type`."""
        del layer_type
        return rope_from_parameters(
            _thaw(self.rope_scaling),
            rope_theta=self.rope_theta,
            rotary_dim=self.rotary_dim,
            max_position_embeddings=self.max_position_embeddings,
            where=f"{type(self).__name__}: rope_parameters",
        )

    def layer_attention(self) -> tuple[LayerAttention, ...]:
        """Each layer's window and rotation (computed once per config)."""
        return _layer_attention(self)

    def _layer_attention(self) -> tuple[LayerAttention, ...]:
        kinds = {}
        for kind in dict.fromkeys(self.layer_types_resolved):
            window = self.window if kind == SLIDING else None
            if kind == SLIDING and window is None:
                raise ValueError(
                    f"{type(self).__name__}: layer_types has sliding_attention layers but "
                    "sliding_window is null (or use_sliding_window is false); transformers "
                    "cannot build their mask either. Set sliding_window, or make them "
                    "full_attention."
                )
            kinds[kind] = LayerAttention(window, self.rope_for(kind))
        return tuple(kinds[t] for t in self.layer_types_resolved)

    # ------------------------------------------------------------------ config.json

    @classmethod
    def _normalise(cls, values: dict[str, Any]) -> dict[str, Any]:
        new, old = values.pop("rope_parameters", None), values.pop("rope_scaling", None)
        params = dict(old or new or {})
        cls._read_rope(params, values)
        return values

    @classmethod
    def _read_rope(cls, params: dict[str, Any], values: dict[str, Any]) -> None:
        """`rope_parameters` (one object) into the fields `rope_theta` and `rope_scaling`."""
        if "type" in params:
            params.setdefault("rope_type", params.pop("type"))
        theta = params.pop("rope_theta", values.get("rope_theta", cls.default_theta))
        values["rope_theta"] = float(theta)
        if "partial_rotary_factor" in params:
            values.setdefault("partial_rotary_factor", params.pop("partial_rotary_factor"))
        kind = params.get("rope_type", "default")
        values["rope_scaling"] = None if kind == "default" and len(params) <= 1 else params

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("rope_scaling", None)
        if not self.partial_rotation:
            out.pop("partial_rotary_factor", None)
        if out.get("head_dim") is None:  # some transformers classes read it without a default
            out.pop("head_dim", None)
        # transformers 5 reads rope_parameters; transformers 4 reads rope_theta.
        out["rope_parameters"] = self._rope_parameters()
        return dict(sorted(out.items()))

    def _rope_parameters(self) -> dict[str, Any]:
        return {"rope_theta": self.rope_theta, "rope_type": "default", **_thaw(self.rope_scaling)}


@functools.lru_cache(maxsize=64)
def _layer_attention(config: DecoderConfig) -> tuple[LayerAttention, ...]:
    return config._layer_attention()


def _norm(c: DecoderConfig, features: int) -> AnyNorm:
    if c.norm_offset:
        return OffsetRMSNorm(features, eps=c.rms_norm_eps)
    return eqx.nn.RMSNorm(features, eps=c.rms_norm_eps, use_bias=False)


def _block(
    c: DecoderConfig, k: PRNGKeyArray, *, remat: str, attention: Implementation
) -> DecoderBlock:
    """One layer of the decoder, initialised as `transformers` initialises it."""
    ka, km, kr = jax.random.split(k, 3)
    first = c.layer_attention()[0]
    attn = Attention(
        c.hidden_size,
        c.num_attention_heads,
        num_kv_heads=c.kv_heads,
        head_dim=c.head_size,
        rope=first.rope,
        window=first.window,
        qkv_bias=c.has_qkv_bias,
        out_bias=c.has_o_bias,
        qk_norm=functools.partial(_norm, c) if c.qk_norm else None,
        scale=c.attn_scale,
        softcap=c.attn_softcap,
        recompute_scores=remat == "attention",
        implementation=attention,
        key=ka,
    )
    act = activation(c.activation_name)
    if c.experts is None:
        mlp: SwiGLU | SparseMoE = SwiGLU(
            c.hidden_size, c.intermediate_size, activation=act, use_bias=c.has_mlp_bias, key=km
        )
    else:
        n, top_k = c.experts
        mlp = SparseMoE(
            c.hidden_size,
            c.expert_size,
            num_experts=n,
            top_k=top_k,
            router=c.router,
            activation=act,
            std=c.initializer_range,
            key=km,
        )
    attn, mlp = normal_init((attn, mlp), c.initializer_range, key=kr)
    post = c.post_norms
    return DecoderBlock(
        _norm(c, c.hidden_size),
        attn,
        _norm(c, c.hidden_size),
        mlp,
        post_attn_norm=_norm(c, c.hidden_size) if post else None,
        post_mlp_norm=_norm(c, c.hidden_size) if post else None,
    )


class Decoder(AbstractCausalLM):
    """A decoder of `DecoderConfig`'s family, called on one unbatched sequence of token ids.

    Constructed with `(config, *, scan_layers, remat, attention, key)` (see
    `AbstractCausalLM.__init__`). Initialised as `transformers` does: weights, experts
    and embeddings N(0, `initializer_range`), zero biases, norms one (Gemma's
    `1 + weight` norms zero), the padding token's embedding zero. Built through a
    family's class: `Llama`, `Qwen2`, `Qwen3`, `Mistral`, `Mixtral`, `Gemma2`, `Gemma3`,
    `Phi3`.
    """

    config_class: ClassVar[type[hf.HFConfig]] = DecoderConfig
    hf_base_prefix: ClassVar[str] = "model."
    tied_hf_tensors: ClassVar[Mapping[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    @classmethod
    def build(cls, config: DecoderConfig, how: LayerOptions, key: PRNGKeyArray) -> CausalLMParts:
        c = config
        kt, kh, kb = jax.random.split(key, 3)
        std = c.initializer_range
        block = functools.partial(_block, c, remat=how.remat, attention=how.attention)
        return CausalLMParts(
            embed_tokens=token_embeddings(
                c, c.hidden_size, std, key=kt, padding_idx=c.token_id("pad_token_id")
            ),
            embed_positions=None,
            blocks=make_stack(block, c.num_hidden_layers, scan_layers=how.scan_layers, key=kb),
            norm=_norm(c, c.hidden_size),
            lm_head=vocab_head(c, c.hidden_size, std, key=kh),
        )

    def layer_attention(self) -> tuple[LayerAttention, ...]:
        """Each layer's window and rotation, from the config."""
        return self.config.layer_attention()

    @property
    def embedding_scale(self) -> float | None:
        return self.config.embed_scale

    @property
    def logit_softcap(self) -> float | None:
        return self.config.final_softcap

    def with_router_logits(
        self,
        input_ids: Int[Array, " seq"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq vocab"], Float[Array, "layers seq experts"]]:
        """The logits and every layer's router logits, for `rc.models.load_balancing_loss`;
        `positions` and `segment_ids` as for calling the model.

        Raises:
            ValueError: the model has no mixture of experts.

        Example:
            >>> logits, router = jax.vmap(model.with_router_logits)(ids)
        """
        if self.config.experts is None:
            raise ValueError(
                f"{type(self).__name__} has no mixture of experts, so no router logits; "
                "call the model itself."
            )
        positions = jnp.arange(input_ids.shape[0]) if positions is None else positions
        x = self._embed(input_ids, positions)
        x, _, routers = self._run_blocks(x, positions, None, 0, segment_ids)
        stacked = routers if not isinstance(routers, tuple) else jnp.stack(routers)
        return self.output_head()(x), stacked

    def with_routing(
        self,
        input_ids: Int[Array, " seq"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> tuple[
        Float[Array, "seq vocab"], Float[Array, "layers seq experts"], Int[Array, "layers seq k"]
    ]:
        """`with_router_logits` and every layer's chosen experts for every token (for
        `rc.models.routing_metrics`).

        Example:
            >>> logits, router, chosen = jax.vmap(model.with_routing)(ids)
        """
        logits, router = self.with_router_logits(
            input_ids, positions=positions, segment_ids=segment_ids
        )
        return logits, router, route_layers(self, router)

    @classmethod
    def hf_tensors(cls, config: DecoderConfig) -> list[hf.TensorMap]:
        """The checkpoint's names (LLaMA's, with each family's variants); PyTorch Linears
        are `(out, in)` like Equinox's."""
        c = config
        h = "model.layers.{i}."
        maps = [
            hf.vocab_rows("model.embed_tokens.weight", "embed_tokens.weight", c),
            hf.same("model.norm.weight", "norm.weight"),
            hf.same(h + "input_layernorm.weight", "attn_norm.weight"),
        ]
        if c.post_norms:
            maps += [
                hf.same(h + "post_attention_layernorm.weight", "post_attn_norm.weight"),
                hf.same(h + "pre_feedforward_layernorm.weight", "mlp_norm.weight"),
                hf.same(h + "post_feedforward_layernorm.weight", "post_mlp_norm.weight"),
            ]
        else:
            maps.append(hf.same(h + "post_attention_layernorm.weight", "mlp_norm.weight"))
        a = h + "self_attn."
        q, kv = c.num_attention_heads * c.head_size, c.kv_heads * c.head_size
        projections = [("o_proj", c.has_o_bias)]
        if c.fused_projections:
            names = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight")
            maps.append(hf.split_rows(a + "qkv_proj.weight", names, (q, kv, kv)))
        else:
            projections += [(p, c.has_qkv_bias) for p in ("q_proj", "k_proj", "v_proj")]
        for name, bias in projections:
            for kind in ("weight", "bias") if bias else ("weight",):
                maps.append(hf.same(f"{a}{name}.{kind}", f"attn.{name}.{kind}"))
        if c.qk_norm:
            maps += [hf.same(f"{a}{n}.weight", f"attn.{n}.weight") for n in ("q_norm", "k_norm")]
        maps += cls._mlp_tensors(c, h)
        if not c.tie_word_embeddings:
            maps.append(hf.vocab_rows("lm_head.weight", "lm_head.weight", c))
        return maps

    @staticmethod
    def _mlp_tensors(c: DecoderConfig, h: str) -> list[hf.TensorMap]:
        if c.experts is not None:
            m = h + c.experts_prefix
            n = c.experts[0]
            return [
                hf.same(m + "gate.weight", "mlp.gate.weight"),
                *(
                    hf.experts(f"{m}experts.{{e}}.{theirs}.weight", f"mlp.{ours}", n)
                    for theirs, ours in zip(c.expert_names, ("w1", "w3", "w2"), strict=True)
                ),
            ]
        maps = [hf.same(h + "mlp.down_proj.weight", "mlp.down_proj.weight")]
        if c.fused_projections:
            names = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
            inner = c.intermediate_size
            return [*maps, hf.split_rows(h + "mlp.gate_up_proj.weight", names, (inner, inner))]
        maps += [hf.same(f"{h}mlp.{p}.weight", f"mlp.{p}.weight") for p in ("gate_proj", "up_proj")]
        if c.has_mlp_bias:
            maps += [
                hf.same(f"{h}mlp.{p}.bias", f"mlp.{p}.bias")
                for p in ("gate_proj", "up_proj", "down_proj")
            ]
        return maps
