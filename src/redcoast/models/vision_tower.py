"""The vision towers of today's vision-language models: CLIP's (Radford et al. 2021) and
SigLIP's (Zhai et al. 2023) vision transformers, `transformers`' `CLIPVisionModel` and
`SiglipVisionModel`.

Both are a ViT: the image cut into patches by a strided convolution, learned
positions, pre-norm encoder layers (the zoo's `EncoderLayer`s, split by the rules as
any attention and MLP). CLIP adds a class token and a LayerNorm before the layers,
and norms only the class token's state at the end (its pooled output); SigLIP has no
class token, norms every state at the end, and pools them with one attention query
(its `head`, which vision-language models leave out).

A vision-language model reads a tower's hidden states after some layer
(`hidden_states`, numbered as `transformers` numbers them: 0 is the embeddings), and
runs only the layers that reach it.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jaxtyping import Array, Float, PRNGKeyArray, Shaped

from ..nn import RematPolicy, check_remat, normalise
from ..parallel import fsdp
from ..parallel.place import placement_hint
from . import hf
from ._stack import Stack, make_stack, run_stack
from .init import normal_init
from .layers import MLP, activation
from .seq2seq import EncoderLayer, Seq2SeqAttention, in_stack
from .vit import check_pixels

_PARAMS = ("weight", "bias")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionTowerConfig(hf.HFConfig):
    """What CLIP's and SigLIP's vision configs share, named as in their config.json."""

    sizes: ClassVar[tuple[str, ...]] = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "image_size",
        "patch_size",
        "num_channels",
    )
    divides: ClassVar[tuple[tuple[str, str], ...]] = (
        ("num_attention_heads", "hidden_size"),
        ("patch_size", "image_size"),
    )

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    attention_dropout: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        activation(self.hidden_act)
        self._require(attention_dropout=(float(self.attention_dropout), 0.0))

    @property
    def num_patches(self) -> int:
        """Patches per image: `(image_size / patch_size) ** 2`."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def class_token(self) -> bool:
        """Whether a class token leads the patches (CLIP)."""
        return False

    @property
    def std(self) -> float:
        """The standard deviation of the random initialisation."""
        return 0.02


@dataclasses.dataclass(frozen=True, kw_only=True)
class CLIPVisionConfig(VisionTowerConfig):
    """CLIP's vision transformer (`transformers.CLIPVisionConfig`, `clip_vision_model`).

    Example:
        >>> config = CLIPVisionConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4)
        >>> CLIPVision(config, key=jax.random.key(0))(jnp.zeros((3, 16, 16))).shape
        (17, 32)
    """

    model_type: ClassVar[str] = "clip_vision_model"
    architecture: ClassVar[str] = "CLIPVisionModel"

    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02

    @property
    def class_token(self) -> bool:
        return True

    @property
    def std(self) -> float:
        return self.initializer_range


@dataclasses.dataclass(frozen=True, kw_only=True)
class SiglipVisionConfig(VisionTowerConfig):
    """SigLIP's vision transformer (`transformers.SiglipVisionConfig`,
    `siglip_vision_model`); `vision_use_head` keeps its attention-pooling head.

    Example:
        >>> config = SiglipVisionConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4)
        >>> SiglipVision(config, key=jax.random.key(0))(jnp.zeros((3, 16, 16))).shape
        (16, 32)
    """

    model_type: ClassVar[str] = "siglip_vision_model"
    architecture: ClassVar[str] = "SiglipVisionModel"

    vision_use_head: bool = True


class AttentionPool(eqx.Module):
    """SigLIP's head: one learned query attends to every state, then an MLP with a
    residual: `transformers`' `SiglipMultiheadAttentionPoolingHead`."""

    probe: Float[Array, " hidden"]
    attn: Seq2SeqAttention
    norm: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, config: VisionTowerConfig, *, key: PRNGKeyArray):
        c = config
        d, heads = c.hidden_size, c.num_attention_heads
        kp, ka, km, kr = jax.random.split(key, 4)
        attn = Seq2SeqAttention(
            d, heads, d // heads, use_bias=True, scale=(d // heads) ** -0.5, key=ka
        )
        mlp = MLP(d, c.intermediate_size, activation=activation(c.hidden_act), key=km)
        self.attn, self.mlp = normal_init((attn, mlp), c.std, key=kr)
        self.probe = jax.random.normal(kp, (d,))
        self.norm = eqx.nn.LayerNorm(d, eps=c.layer_norm_eps)

    def __call__(self, x: Float[Array, "tokens hidden"]) -> Float[Array, " hidden"]:
        visible = jnp.ones((1, x.shape[0]), bool)
        h = self.attn(self.probe[None].astype(x.dtype), self.attn.keys_values(x), visible)
        return (h + self.mlp(normalise(self.norm, h)))[0]


class VisionTower(hf.HFModel):
    """A vision transformer called on one image: CLIP's or SigLIP's (the subclasses).

    Args:
        config: the hyperparameters.
        scan_layers: stack the layers and run them with `lax.scan`.
        remat: rematerialise each layer in the backward pass (see `rc.remat`).
        key: for the initialisation: weights N(0, 0.02) (CLIP: `initializer_range`),
            zero biases.
    """

    config: VisionTowerConfig = eqx.field(static=True)
    remat: RematPolicy = eqx.field(static=True)
    patch_embed: eqx.nn.Conv2d
    cls_token: Float[Array, " hidden"] | None
    positions: Float[Array, "tokens hidden"]
    pre_norm: eqx.nn.LayerNorm | None
    blocks: Stack
    post_norm: eqx.nn.LayerNorm
    head: AttentionPool | None

    config_class: ClassVar[type[hf.HFConfig]]
    hf_base_prefix: ClassVar[str] = ""
    # Checkpoints written before transformers 5 keep the tower under `vision_model.`.
    hf_aliases: ClassVar[tuple[tuple[str, str], ...]] = (("", "vision_model."),)

    def __init__(
        self,
        config: VisionTowerConfig,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        key: PRNGKeyArray,
    ):
        want = self.config_class
        if not isinstance(config, want):
            raise TypeError(
                f"{type(self).__name__} takes a {want.__name__}, got {type(config).__name__}; "
                f"build one with {want.__name__}(...) or load a folder with rc.models.from_hf."
            )
        c = config
        d, eps, std = c.hidden_size, c.layer_norm_eps, c.std
        kp, kc, kpos, kb, kh = jax.random.split(key, 5)
        head_dim = d // c.num_attention_heads

        def layer(k: PRNGKeyArray) -> EncoderLayer:
            ka, kf, kr = jax.random.split(k, 3)
            attn = Seq2SeqAttention(
                d,
                c.num_attention_heads,
                head_dim,
                use_bias=True,
                scale=head_dim**-0.5,
                recompute_scores=remat == "attention",
                key=ka,
            )
            mlp = MLP(d, c.intermediate_size, activation=activation(c.hidden_act), key=kf)
            attn, mlp = normal_init((attn, mlp), std, key=kr)
            norms = eqx.nn.LayerNorm(d, eps=eps), eqx.nn.LayerNorm(d, eps=eps)
            return EncoderLayer(norms[0], attn, norms[1], mlp, post_norm=False)

        p, cls = c.patch_size, c.class_token
        conv = eqx.nn.Conv2d(c.num_channels, d, kernel_size=p, stride=p, use_bias=not cls, key=kp)
        conv = eqx.tree_at(lambda m: m.weight, conv, std * jax.random.normal(kp, conv.weight.shape))
        self.config = config
        self.remat = check_remat(remat)
        self.patch_embed = conv
        self.cls_token = std * jax.random.normal(kc, (d,)) if cls else None
        self.positions = std * jax.random.normal(kpos, (c.num_patches + cls, d))
        self.pre_norm = eqx.nn.LayerNorm(d, eps=eps) if cls else None
        self.blocks = make_stack(layer, c.num_hidden_layers, scan_layers=scan_layers, key=kb)
        self.post_norm = eqx.nn.LayerNorm(d, eps=eps)
        use_head = getattr(c, "vision_use_head", False)
        self.head = AttentionPool(c, key=kh) if use_head else None

    def trace_call(self) -> Array:
        """The call the sharding rules trace when none is given: one image of zeros."""
        c = self.config
        shape = (c.num_channels, c.image_size, c.image_size)
        return self(jnp.asarray(np.zeros(shape, np.float32)))

    def __call__(
        self,
        pixel_values: Shaped[Array, "channels height width"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "tokens hidden"]:
        """The last hidden states (`last_hidden_state`): SigLIP's normed, CLIP's not
        (CLIP norms only its pooled class token).

        Args:
            pixel_values: one image, `(num_channels, image_size, image_size)`, floats.
            key: accepted for the Equinox calling convention; unused (no dropout).

        Raises:
            ValueError: the image has another shape, or integer pixels.
        """
        del key
        (last,) = self.hidden_states(pixel_values, [-1])
        if self.cls_token is not None:
            return last
        with placement_hint():
            return normalise(fsdp.gather(self.post_norm, fsdp.layouts(self).post_norm), last)

    def hidden_states(
        self, pixel_values: Shaped[Array, "channels height width"], layers: Sequence[int]
    ) -> list[Float[Array, "tokens hidden"]]:
        """The hidden states `transformers`' `hidden_states[i]` holds, for each `i` of
        `layers`: 0 the embeddings (CLIP's after its first LayerNorm), `i` the output of
        layer `i`, negative counting from the end (-1 the last layer's, before the final
        norm). Only the layers up to the deepest asked for run.

        Raises:
            ValueError: the image has another shape or integer pixels, or a layer is
                out of range.
        """
        check_pixels(pixel_values, self.config)
        n = self.config.num_hidden_layers
        bad = [i for i in layers if not -n - 1 <= i <= n]
        if bad or not layers:
            raise ValueError(
                f"layers {list(layers)}: the tower has {n} layers, so hidden states "
                f"{-n - 1} to {n} (0 the embeddings, -1 the last layer's); give at least one."
            )
        wanted = [i % (n + 1) for i in layers]
        deepest = max(wanted)
        use = fsdp.layouts(self)
        with placement_hint():
            x = self._embed(pixel_values, use)
            visible = jnp.ones((x.shape[0], x.shape[0]), bool)

            def layer(block: EncoderLayer, h: Array, _: None) -> tuple[Array, Array]:
                h = block(h, visible, None)
                return h, h

            blocks, blocks_use = _first_layers(self.blocks, use.blocks, deepest)
            outs: Any = ()
            if deepest:
                _, outs = run_stack(blocks, x, None, layer, blocks_use, self.remat)
            return [x if i == 0 else outs[i - 1] for i in wanted]

    def pooled(self, hidden: Float[Array, "tokens hidden"]) -> Float[Array, " hidden"]:
        """The pooled output (`pooler_output`) of the last hidden states: CLIP's class
        token after the final LayerNorm, SigLIP's attention pooling.

        Raises:
            ValueError: a SigLIP tower without its head (`vision_use_head=False`).
        """
        use = fsdp.layouts(self)
        if self.cls_token is not None:
            return normalise(fsdp.gather(self.post_norm, use.post_norm), hidden[:1])[0]
        if self.head is None:
            raise ValueError(
                "this SigLIP tower has no head (vision_use_head=False), so no pooled "
                "output; use its hidden states, `model(pixels)`."
            )
        return fsdp.gather(self.head, use.head)(hidden)

    def _embed(self, pixel_values: Array, use: Any) -> Float[Array, "tokens hidden"]:
        conv = fsdp.gather(self.patch_embed, use.patch_embed)
        x = rearrange(conv(pixel_values.astype(self.dtype)), "d h w -> (h w) d")
        if self.cls_token is not None:
            cls = fsdp.gather(self.cls_token, use.cls_token)
            x = jnp.concatenate([cls[None].astype(x.dtype), x])
        x = x + fsdp.gather(self.positions, use.positions).astype(x.dtype)
        if self.pre_norm is not None:
            x = normalise(fsdp.gather(self.pre_norm, use.pre_norm), x)
        return x

    @property
    def dtype(self) -> jnp.dtype:
        """The parameters' dtype, which the pixels are cast to."""
        return self.patch_embed.weight.dtype

    @classmethod
    def hf_tensors(
        cls, config: VisionTowerConfig, prefix: str = "", ours: str = ""
    ) -> list[hf.TensorMap]:
        """The tower's checkpoint names, each after `prefix`, and our paths, each after
        `ours` (a vision-language model's `vision_tower.` in both)."""
        c = config
        d = c.hidden_size

        def linear(name: str, mine: str) -> list[hf.TensorMap]:
            return [hf.same(f"{name}.{w}", f"{mine}.{w}") for w in _PARAMS]

        layer = prefix + "encoder.layers.{i}."
        blocks = [
            *linear(layer + "self_attn.q_proj", "attn.q_proj"),
            *linear(layer + "self_attn.k_proj", "attn.k_proj"),
            *linear(layer + "self_attn.v_proj", "attn.v_proj"),
            *linear(layer + "self_attn.out_proj", "attn.o_proj"),
            *linear(layer + "layer_norm1", "attn_norm"),
            *linear(layer + "layer_norm2", "mlp_norm"),
            *linear(layer + "mlp.fc1", "mlp.fc_in"),
            *linear(layer + "mlp.fc2", "mlp.fc_out"),
        ]
        embed = prefix + "embeddings."
        maps = [
            hf.same(embed + "patch_embedding.weight", ours + "patch_embed.weight"),
            hf.same(embed + "position_embedding.weight", ours + "positions"),
            *in_stack(blocks, ours + "blocks"),
            *linear(prefix + "post_layernorm", ours + "post_norm"),
        ]
        if c.class_token:
            maps += [
                hf.same(embed + "class_embedding", ours + "cls_token"),
                *linear(prefix + "pre_layrnorm", ours + "pre_norm"),
            ]
        else:
            maps.append(
                hf.TensorMap(
                    embed + "patch_embedding.bias",
                    (ours + "patch_embed.bias",),
                    lambda x: (x.reshape(d, 1, 1),),  # eqx's Conv2d bias broadcasts
                    lambda xs: xs[0].reshape(d),
                )
            )
        if getattr(c, "vision_use_head", False):
            head, mine = prefix + "head.", ours + "head."
            qkv = tuple(f"{mine}attn.{p}_proj" for p in "qkv")
            maps += [
                hf.TensorMap(
                    head + "probe",
                    (mine + "probe",),
                    lambda x: (x.reshape(d),),
                    lambda xs: xs[0].reshape(1, 1, d),
                ),
                *(
                    hf.split_rows(
                        head + f"attention.in_proj_{w}", tuple(f"{p}.{w}" for p in qkv), (d,) * 3
                    )
                    for w in _PARAMS
                ),
                *linear(head + "attention.out_proj", mine + "attn.o_proj"),
                *linear(head + "layernorm", mine + "norm"),
                *linear(head + "mlp.fc1", mine + "mlp.fc_in"),
                *linear(head + "mlp.fc2", mine + "mlp.fc_out"),
            ]
        return maps


class CLIPVision(VisionTower):
    """CLIP's vision transformer, `transformers.CLIPVisionModel`, on one image.

    Example:
        >>> tower = rc.models.from_hf("clip-vision")      # a CLIPVisionModel folder
        >>> hidden = tower(pixels)                        # (1 + patches, hidden)
        >>> tower.pooled(hidden)                          # pooler_output
    """

    config_class: ClassVar[type[hf.HFConfig]] = CLIPVisionConfig


class SiglipVision(VisionTower):
    """SigLIP's vision transformer, `transformers.SiglipVisionModel`, on one image.

    Example:
        >>> tower = rc.models.from_hf("siglip-vision")    # a SiglipVisionModel folder
        >>> hidden = tower(pixels)                        # (patches, hidden), normed
    """

    config_class: ClassVar[type[hf.HFConfig]] = SiglipVisionConfig

    @classmethod
    def stored_config(cls, config: SiglipVisionConfig, checkpoint: hf.SavedTensors) -> Any:
        """`config` without the head when the checkpoint stores none."""
        return super().stored_config(stored_tower(config, checkpoint), checkpoint)


def stored_tower(config: Any, checkpoint: hf.SavedTensors, prefix: str = "") -> Any:
    """A tower's `config` as the checkpoint stores it under `prefix`: a SigLIP tower
    without its head when the checkpoint stores none (a vision-language model's)."""
    if getattr(config, "vision_use_head", False) and f"{prefix}head.probe" not in checkpoint:
        config = dataclasses.replace(config, vision_use_head=False)
    return config


def _first_layers(blocks: Stack, use: Any, k: int) -> tuple[Stack, Any]:
    """The first `k` layers of a stack and their FSDP layouts."""
    if isinstance(blocks, tuple):
        return blocks[:k], use[:k]
    return jax.tree.map(lambda a: a[:k] if eqx.is_array(a) else a, blocks), use
