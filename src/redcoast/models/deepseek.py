"""DeepSeek-V3 (DeepSeek-AI 2024) and the models built on its architecture (Moonshot
AI's Moonlight): multi-head latent attention and mixtures of experts with shared experts.

Multi-head latent attention is `mla.MLAttention`.

The first `first_k_dense_replace` layers have a SwiGLU MLP; every later one a mixture
of `n_routed_experts` experts of which each token uses `num_experts_per_tok`, chosen by
sigmoid scores with a bias within the `topk_group` best of `n_group` groups, plus
`n_shared_experts` every token uses (`moe.SparseMoE`). The two kinds are two stacks
(`DeepseekV3.blocks` and `DeepseekV3.moe_blocks`), each a tuple or, with
`scan_layers=True`, one scanned stack.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray, Real

from ..nn import (
    Implementation,
    normalise,
    table_dtype,
)
from ..parallel import fsdp
from . import hf
from ._stack import make_stack, run_stack
from .causal_lm import AbstractCausalLM, Blocks, CausalLMParts, LayerOptions
from .decoder import FULL, DecoderConfig
from .init import normal_init, token_embeddings, vocab_head
from .layers import SwiGLU, activation
from .mla import LatentCache, MLAttention, yarn_mscale
from .moe import Router, SparseMoE, route_layers

__all__ = ["DeepseekV3", "DeepseekV3Block", "DeepseekV3Config"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(DecoderConfig):
    """DeepSeek-V3's hyperparameters, named as in `transformers.DeepseekV3Config` (and
    its config.json); the defaults are DeepSeek-V3's (671B).

    `q_lora_rank` null gives the queries one `q_proj` (Moonlight). RoPE rotates the
    `qk_rope_head_dim` features each head adds to its key and query, in interleaved
    pairs with `rope_interleave`; YaRN's `mscale_all_dim` (DeepSeek-V3's 128k context)
    multiplies the softmax scale by `yarn_mscale(factor, mscale_all_dim) ** 2`, as
    transformers does. `head_dim` and `qk_head_dim`, which transformers derives, are
    written to config.json and not read from it.

    What transformers' `DeepseekV3ForCausalLM` does not build is refused: grouped keys
    (`num_key_value_heads` other than `num_attention_heads`), routing other than
    `topk_method="noaux_tc"` with `scoring_func="sigmoid"`, MoE layers other than every
    one from `first_k_dense_replace` on (`moe_layer_freq`), and quantized weights (the
    release's FP8 blocks: dequantize them first). The multi-token-prediction layers
    (`num_nextn_predict_layers`) are not part of the model, in transformers neither.

    Example:
        >>> config = DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...     moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        ...     num_key_value_heads=4, n_routed_experts=8, n_group=2, topk_group=1,
        ...     num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
        ...     q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
        >>> model = DeepseekV3(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "deepseek_v3"
    architecture: ClassVar[str] = "DeepseekV3ForCausalLM"
    sizes: ClassVar[tuple[str, ...]] = (
        *DecoderConfig.sizes,
        "moe_intermediate_size",
        "n_shared_experts",
        "n_routed_experts",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "n_group",
        "topk_group",
        "num_experts_per_tok",
    )
    divides: ClassVar[tuple[tuple[str, str], ...]] = (("n_group", "n_routed_experts"),)
    unread: ClassVar[dict[str, Any]] = {
        "mlp_bias": False,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
    }
    token_ids: ClassVar[Mapping[str, int | None]] = {
        "pad_token_id": None,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    max_position_embeddings: int = 4096
    rope_interleave: bool = True
    attention_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.kv_heads != self.num_attention_heads:
            raise ValueError(
                f"{name}: num_key_value_heads={self.num_key_value_heads} differs from "
                f"num_attention_heads={self.num_attention_heads}; multi-head latent "
                "attention makes a key and a value for every head, and transformers' "
                "DeepseekV3Attention cannot group them either. Set them equal."
            )
        if self.head_dim not in (None, self.qk_rope_head_dim):
            raise ValueError(
                f"{name}: head_dim={self.head_dim} is not qk_rope_head_dim="
                f"{self.qk_rope_head_dim}, which transformers makes it; leave it out."
            )
        if self.qk_rope_head_dim % 2 or self.first_k_dense_replace < 0:
            raise ValueError(
                f"{name}: qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE "
                f"rotates pairs) and first_k_dense_replace={self.first_k_dense_replace} "
                "at least 0."
            )
        if self.get_extra("quantization_config") is not None:
            raise ValueError(
                f"{name}: config.json has a quantization_config ("
                f"{self.get_extra('quantization_config')}); redcoast reads float weights. "
                "Dequantize the checkpoint first (DeepSeek's fp8_cast_bf16.py writes bf16)."
            )
        self.router  # noqa: B018 - checks the routing settings now
        self.softmax_scale  # noqa: B018 - and the scale's

    @property
    def head_size(self) -> int:
        """The width of each head's query and key: `qk_nope_head_dim + qk_rope_head_dim`."""
        return self.qk_head_dim

    @property
    def qk_head_dim(self) -> int:
        """The width of each head's query and key (transformers' `qk_head_dim`)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        """The rotated features of each query and key head: `qk_rope_head_dim`."""
        return self.qk_rope_head_dim

    @property
    def experts(self) -> tuple[int, int] | None:
        """`(n_routed_experts, num_experts_per_tok)` of the MoE layers."""
        return self.n_routed_experts, self.num_experts_per_tok

    @property
    def expert_size(self) -> int:
        """Each routed expert's intermediate size: `moe_intermediate_size`."""
        return self.moe_intermediate_size

    @property
    def dense_layers(self) -> int:
        """How many layers, the first ones, have a dense MLP."""
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def softmax_scale(self) -> float:
        """The attention scores' scale, as `DeepseekV3Attention.scaling`: `1 /
        sqrt(qk_head_dim)`, times `yarn_mscale(factor, mscale_all_dim) ** 2` when a
        scaled RoPE sets `mscale_all_dim`."""
        scale = self.qk_head_dim ** (-0.5)
        rope = dict(self.rope_scaling or {})
        mscale_all_dim = rope.get("mscale_all_dim") or 0
        if rope.get("rope_type", rope.get("type", "default")) != "default" and mscale_all_dim:
            if rope.get("factor") is None:
                raise ValueError(
                    f"{type(self).__name__}: rope_parameters has mscale_all_dim but no "
                    "factor, which DeepseekV3Attention reads with it."
                )
            mscale = yarn_mscale(float(rope["factor"]), float(mscale_all_dim))
            scale = scale * mscale * mscale
        return scale

    @property
    def router(self) -> Router:
        """How the MoE layers route: sigmoid scores plus a bias choose, within the
        `topk_group` best of `n_group` groups of experts, `num_experts_per_tok` experts
        weighted by their scores (normalised with `norm_topk_prob`) times
        `routed_scaling_factor`.

        Raises:
            ValueError: settings under which transformers' router cannot choose
                (fewer than 2 experts a group, more groups or experts than there are).
        """
        per_group = self.n_routed_experts // self.n_group
        if self.topk_group > self.n_group or per_group < 2:
            raise ValueError(
                f"{type(self).__name__}: topk_group={self.topk_group} of n_group="
                f"{self.n_group} groups of {per_group} experts; a group's score is its "
                "2 best experts' (transformers' DeepseekV3TopkRouter), so each group "
                "needs at least 2 experts and topk_group cannot exceed n_group."
            )
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(
                f"{type(self).__name__}: num_experts_per_tok={self.num_experts_per_tok} "
                f"exceeds the {self.topk_group * per_group} experts of the topk_group="
                f"{self.topk_group} groups a token may use."
            )
        return Router(
            scoring="sigmoid",
            normalize=self.norm_topk_prob,
            n_group=self.n_group,
            topk_group=self.topk_group,
            scale=self.routed_scaling_factor,
        )

    @classmethod
    def _normalise(cls, values: dict[str, Any]) -> dict[str, Any]:
        values = super()._normalise(values)
        # Derived by transformers' config from the head dimensions, whatever is stored.
        values.pop("head_dim", None)
        values.pop("qk_head_dim", None)
        return values

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["head_dim"] = self.qk_rope_head_dim
        out["qk_head_dim"] = self.qk_head_dim
        return dict(sorted(out.items()))


class DeepseekV3Block(eqx.Module):
    """A DeepSeek-V3 layer: `x + attn(attn_norm(x))`, then `x + mlp(mlp_norm(x))`, the
    MLP a SwiGLU (`mlp.gate_proj`, ...) or a mixture of experts (`moe.SparseMoE`).

    Attributes:
        attn_norm: transformers' `input_layernorm`.
        attn: the multi-head latent attention (`self_attn`).
        mlp_norm: transformers' `post_attention_layernorm`.
        mlp: the MLP.
    """

    attn_norm: eqx.nn.RMSNorm
    attn: MLAttention
    mlp_norm: eqx.nn.RMSNorm
    mlp: SwiGLU | SparseMoE

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"],
        cache: LatentCache | None = None,
        index: Int[Array, ""] | int = 0,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq hidden"], LatentCache | None]:
        """The layer on one sequence, as `layers.DecoderBlock.__call__`."""
        x, cache, _ = self.forward(x, positions, cache, index, segment_ids)
        return x, cache

    def forward(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"],
        cache: LatentCache | None = None,
        index: Int[Array, ""] | int = 0,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq hidden"], LatentCache | None, Float[Array, "seq experts"] | None]:
        """`__call__`, also returning the router's logits (`None` for a dense MLP)."""
        h = normalise(self.attn_norm, x)
        if cache is None:
            x = x + self.attn(h, positions, segment_ids)
        else:
            attn, cache = self.attn.cached(h, positions, cache, index)
            x = x + attn
        h = normalise(self.mlp_norm, x)
        if isinstance(self.mlp, SparseMoE):
            y, router = self.mlp.routed(h)
            return x + y, cache, router
        return x + self.mlp(h), cache, None


def _layer(c: DeepseekV3Config, moe: bool, how: LayerOptions, key: PRNGKeyArray) -> DeepseekV3Block:
    """One layer, initialised as transformers does: N(0, `initializer_range`) weights
    and experts, norms one, the routing bias zero."""
    ka, km, kr = jax.random.split(key, 3)
    attn = MLAttention(
        c.hidden_size,
        c.num_attention_heads,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        rope=c.rope_for(FULL),
        interleaved=c.rope_interleave,
        scale=c.softmax_scale,
        bias=c.attention_bias,
        recompute_scores=how.remat == "attention",
        implementation=how.attention,
        key=ka,
    )
    act = activation(c.activation_name)
    if moe:
        mlp: SwiGLU | SparseMoE = SparseMoE(
            c.hidden_size,
            c.moe_intermediate_size,
            num_experts=c.n_routed_experts,
            top_k=c.num_experts_per_tok,
            router=c.router,
            score_bias=True,
            shared_intermediate_size=c.moe_intermediate_size * c.n_shared_experts,
            activation=act,
            std=c.initializer_range,
            key=km,
        )
    else:
        mlp = SwiGLU(c.hidden_size, c.intermediate_size, activation=act, key=km)
    attn, mlp = normal_init((attn, mlp), c.initializer_range, key=kr)
    norm = functools.partial(eqx.nn.RMSNorm, c.hidden_size, eps=c.rms_norm_eps, use_bias=False)
    return DeepseekV3Block(norm(), attn, norm(), mlp)


Stack = tuple[DeepseekV3Block, ...] | DeepseekV3Block
"""Layers of one kind: a tuple, or one block whose arrays have a leading layer axis."""


def _stack(c: DeepseekV3Config, moe: bool, how: LayerOptions, key: PRNGKeyArray) -> Stack:
    n = c.num_hidden_layers - c.dense_layers if moe else c.dense_layers
    if n == 0:
        return ()
    layer = functools.partial(_layer, c, moe, how)
    return make_stack(layer, n, scan_layers=how.scan_layers, key=key)


def _stack_cache(blocks: Stack, max_len: int, dtype: DTypeLike) -> Any:
    if isinstance(blocks, tuple):
        return tuple(b.attn.init_cache(max_len, dtype) for b in blocks)
    return eqx.filter_vmap(lambda b: b.attn.init_cache(max_len, dtype))(blocks)


class DeepseekV3(AbstractCausalLM):
    """DeepSeek-V3 (and Moonlight) as an Equinox module, called on one sequence of ids.

    Constructed with `(config, *, scan_layers, remat, attention, key)` (see
    `AbstractCausalLM.__init__`). The layers are two stacks: `blocks`, the first
    `first_k_dense_replace` (dense MLPs), and `moe_blocks`, the rest (mixtures of
    experts), each a tuple or, with `scan_layers=True`, scanned; either may be empty.
    The cache of `init_cache` and `decode` is a pair, the two stacks' `LatentCache`s.
    `with_router_logits` gives the MoE layers' router logits beside the logits.

    Example:
        >>> model = DeepseekV3(config, key=jax.random.key(0))
        >>> model(jnp.arange(10)).shape
        (10, 128)
    """

    moe_blocks: Stack

    config_class: ClassVar[type[hf.HFConfig]] = DeepseekV3Config
    hf_base_prefix: ClassVar[str] = "model."
    tied_hf_tensors: ClassVar[Mapping[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(
        self,
        config: DeepseekV3Config,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        attention: Implementation = "auto",
        key: PRNGKeyArray,
    ):
        k_rest, k_moe = jax.random.split(key)
        super().__init__(
            config, scan_layers=scan_layers, remat=remat, attention=attention, key=k_rest
        )
        self.moe_blocks = _stack(
            config, True, LayerOptions(scan_layers, self.remat, attention), k_moe
        )

    @classmethod
    def build(cls, config: DeepseekV3Config, how: LayerOptions, key: PRNGKeyArray) -> CausalLMParts:
        """The embeddings, the dense layers (`blocks`), the final norm and the head; the
        constructor adds the MoE layers (`moe_blocks`)."""
        c = config
        kt, kh, kb = jax.random.split(key, 3)
        std = c.initializer_range
        return CausalLMParts(
            embed_tokens=token_embeddings(
                c, c.hidden_size, std, key=kt, padding_idx=c.token_id("pad_token_id")
            ),
            embed_positions=None,
            # DeepseekV3Blocks where the base class names DecoderBlocks: `_run_blocks`,
            # `init_cache` and `decode` below are this class's own.
            blocks=cast(Blocks, _stack(c, False, how, kb)),
            norm=eqx.nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps, use_bias=False),
            lm_head=vocab_head(c, c.hidden_size, std, key=kh),
        )

    def init_cache(self, max_len: int, dtype: DTypeLike | None = None) -> Any:
        """An empty latent cache for one sequence of up to `max_len` tokens: a pair, the
        dense and the MoE layers' (`LatentCache`s, a tuple or stacked as the layers)."""
        dtype = table_dtype(self.embed_tokens) if dtype is None else dtype
        return tuple(_stack_cache(b, max_len, dtype) for b in self._stacks())

    def decode(
        self,
        input_ids: Int[Array, " seq"],
        cache: Any,
        index: Int[Array, ""] | int,
        *,
        inputs_embeds: Float[Array, "seq hidden"] | None = None,
        bidirectional_groups: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq vocab"], Any]:
        """The forward pass of tokens that continue a cached sequence (see
        `AbstractCausalLM.decode`), on `init_cache`'s pair of caches."""
        positions = index + jnp.arange(input_ids.shape[0])
        x = self._embed(input_ids, positions, inputs_embeds)
        x, new, _ = self._run_blocks(x, positions, cache, index, None, bidirectional_groups)
        return self.output_head()(x), new

    def with_router_logits(
        self,
        input_ids: Int[Array, " seq"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq vocab"], Float[Array, "moe_layers seq experts"]]:
        """The logits and the router logits of each MoE layer (`moe_blocks`, the dense
        layers have none), before the sigmoid; `positions` and `segment_ids` as for
        calling the model.

        Raises:
            ValueError: the model has no MoE layer.
        """
        if isinstance(self.moe_blocks, tuple) and not self.moe_blocks:
            raise ValueError(
                f"{type(self).__name__} has no MoE layer (first_k_dense_replace >= "
                "num_hidden_layers), so no router logits; call the model itself."
            )
        positions = jnp.arange(input_ids.shape[0]) if positions is None else positions
        x = self._embed(input_ids, positions)
        x, _, routers = self._run_blocks(x, positions, None, 0, segment_ids)
        stacked = jnp.stack(routers) if isinstance(routers, tuple) else routers
        return self.output_head()(x), stacked

    def with_routing(
        self,
        input_ids: Int[Array, " seq"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> tuple[
        Float[Array, "seq vocab"],
        Float[Array, "moe_layers seq experts"],
        Int[Array, "moe_layers seq k"],
    ]:
        """`with_router_logits` and each MoE layer's chosen experts for every token (for
        `rc.models.routing_metrics`)."""
        logits, router = self.with_router_logits(
            input_ids, positions=positions, segment_ids=segment_ids
        )
        return logits, router, route_layers(self, router)

    def _stacks(self) -> tuple[Stack, Stack]:
        return cast(Stack, self.blocks), self.moe_blocks

    def _run_blocks(
        self,
        x: Float[Array, "seq hidden"],
        positions: Real[Array, " seq"],
        cache: Any,
        index: Int[Array, ""] | int,
        segment_ids: Int[Array, " seq"] | None = None,
        bidirectional_groups: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq hidden"], Any, Any]:
        """The dense then the MoE layers on `x`: the hidden states, the new pair of caches
        (`None` without a cache) and the MoE layers' router logits (a tuple or stacked);
        a `ValueError` for `bidirectional_groups` (the latent attention is causal only)."""
        if bidirectional_groups is not None:
            raise ValueError(f"{type(self).__name__} attends causally: no bidirectional_groups.")
        # The cached (decoding) path computes no gradients: nothing to rematerialise.
        policy = self.remat if cache is None else "none"
        use = fsdp.layouts(self)
        caches = (None, None) if cache is None else cache

        def layer(block: DeepseekV3Block, h: Array, c: Any) -> tuple[Array, Any]:
            h, c, router = block.forward(h, positions, c, index, segment_ids)
            return h, (c, router)

        new, routers = [], None
        for blocks, c, specs in zip(
            self._stacks(), caches, (use.blocks, use.moe_blocks), strict=True
        ):
            if isinstance(blocks, tuple):
                per = (None,) * len(blocks) if c is None else c
                x, outs = run_stack(blocks, x, per, layer, specs, policy)
                c, routers = tuple(o[0] for o in outs), tuple(o[1] for o in outs)
            else:
                x, (c, routers) = run_stack(blocks, x, c, layer, specs, policy)
            new.append(c)
        return x, None if cache is None else tuple(new), routers

    @classmethod
    def stored_config(cls, config: DeepseekV3Config, checkpoint: hf.SavedTensors) -> Any:
        """`HFModel.stored_config`; the multi-token-prediction layers stored after the last
        layer (`num_nextn_predict_layers` of them: DeepSeek-V3's layer 61) are skipped,
        as transformers skips them."""
        n = config.num_hidden_layers
        extra = config.get_extra("num_nextn_predict_layers", config.get_extra("num_mtp_layers"))
        prefixes = tuple(f"model.layers.{i}." for i in range(n, n + int(extra or 0)))
        if prefixes:
            checkpoint.used.update(k for k in checkpoint.where if k.startswith(prefixes))
        return super().stored_config(config, checkpoint)

    @classmethod
    def hf_tensors(cls, config: DeepseekV3Config) -> list[hf.TensorMap]:
        """The checkpoint's names, as transformers 5 saves them: the MoE layers' experts
        one tensor each (`mlp.experts.{e}.gate_proj.weight`), stacked here."""
        c = config
        maps = [
            hf.vocab_rows("model.embed_tokens.weight", "embed_tokens.weight", c),
            hf.same("model.norm.weight", "norm.weight"),
        ]
        if not c.tie_word_embeddings:
            maps.append(hf.vocab_rows("lm_head.weight", "lm_head.weight", c))
        layers = _layer_tensors(c)
        for stack, first, mlp in (
            ("blocks", 0, _dense_tensors()),
            ("moe_blocks", c.dense_layers, _moe_tensors(c)),
        ):
            maps += [
                dataclasses.replace(m, stack=stack, first_layer=first) for m in (*layers, *mlp)
            ]
        return maps


_H = "model.layers.{i}."


def _layer_tensors(c: DeepseekV3Config) -> list[hf.TensorMap]:
    """Every layer's norms and attention."""
    a = _H + "self_attn."
    maps = [
        hf.same(_H + "input_layernorm.weight", "attn_norm.weight"),
        hf.same(_H + "post_attention_layernorm.weight", "mlp_norm.weight"),
        hf.same(a + "kv_a_layernorm.weight", "attn.kv_a_layernorm.weight"),
    ]
    names = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    if c.q_lora_rank is None:
        names.append("q_proj")
    else:
        names += ["q_a_proj", "q_b_proj"]
        maps.append(hf.same(a + "q_a_layernorm.weight", "attn.q_a_layernorm.weight"))
    for name in names:
        maps.append(hf.same(f"{a}{name}.weight", f"attn.{name}.weight"))
        if c.attention_bias and name in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
            maps.append(hf.same(f"{a}{name}.bias", f"attn.{name}.bias"))
    return maps


def _dense_tensors() -> list[hf.TensorMap]:
    return [hf.same(f"{_H}mlp.{p}.weight", f"mlp.{p}.weight") for p in SWIGLU]


SWIGLU = ("gate_proj", "up_proj", "down_proj")
# transformers' expert projections -> SparseMoE's stacked arrays.
EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _moe_tensors(c: DeepseekV3Config) -> list[hf.TensorMap]:
    m = _H + "mlp."
    return [
        hf.same(m + "gate.weight", "mlp.gate.weight"),
        hf.same(m + "gate.e_score_correction_bias", "mlp.score_bias"),
        *(
            hf.experts(f"{m}experts.{{e}}.{p}.weight", f"mlp.{w}", c.n_routed_experts)
            for p, w in EXPERTS.items()
        ),
        *(hf.same(f"{m}shared_experts.{p}.weight", f"mlp.shared.{p}.weight") for p in SWIGLU),
    ]
