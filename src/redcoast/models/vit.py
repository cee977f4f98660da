"""ViT (Dosovitskiy et al. 2021): an image as a sequence of patches, a CLS token,
learned positions, pre-LayerNorm encoder layers, a final LayerNorm and a pooler (if
the checkpoint has one); and the image classifier, a Linear on the CLS token.

The patch embedding is `transformers`' strided `Conv2d`, which the sharding rules
replicate as Megatron-LM's ViT does (a stem on the raw pixels); the layers are the
zoo's pre-norm `EncoderLayer`s, split as any attention and MLP.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jaxtyping import Array, Float, PRNGKeyArray, Shaped

from ..nn import RematPolicy, check_remat, dense, normalise
from ..parallel import fsdp
from ..parallel.place import placement_hint
from . import hf
from ._stack import Stack, make_stack, run_stack
from .init import normal_init
from .layers import MLP, activation
from .seq2seq import EncoderLayer, Seq2SeqAttention, in_stack


@dataclasses.dataclass(frozen=True, kw_only=True)
class ViTConfig(hf.HFConfig):
    """ViT's hyperparameters, named as in `transformers.ViTConfig` (and its config.json).

    `add_pooling_layer` is not in config.json (transformers' `ViTModel` takes it as an
    argument): loading sets it by whether the checkpoint stores the pooler, and
    `to_hf` writes the pooler's tensors when the model has one.

    Example:
        >>> config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...     intermediate_size=64, image_size=16, patch_size=4)
        >>> model = ViT(config, key=jax.random.key(0))
    """

    model_type: ClassVar[str] = "vit"
    architecture: ClassVar[str] = "ViTModel"
    sizes: ClassVar[tuple[str, ...]] = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "image_size",
        "patch_size",
        "num_channels",
        "pooler_output_size",
    )
    divides: ClassVar[tuple[tuple[str, str], ...]] = (
        ("num_attention_heads", "hidden_size"),
        ("patch_size", "image_size"),
    )

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    qkv_bias: bool = True
    pooler_output_size: int | None = None
    pooler_act: str = "tanh"
    add_pooling_layer: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(pooler_act=(self.pooler_act, "tanh"), qkv_bias=(self.qkv_bias, True))
        activation(self.hidden_act)

    def to_dict(self) -> dict[str, Any]:
        """The config.json object: without `add_pooling_layer`, which the tensors say."""
        out = super().to_dict()
        del out["add_pooling_layer"]
        return out

    @property
    def num_patches(self) -> int:
        """Patches per image: `(image_size / patch_size) ** 2`."""
        return (self.image_size // self.patch_size) ** 2


def blank_image(config: ViTConfig) -> Array:
    """One image of zeros of the config's size, made outside any trace (data to the rules)."""
    c = config
    return jnp.asarray(np.zeros((c.num_channels, c.image_size, c.image_size), np.float32))


def check_pixels(pixel_values: Array, config: Any, what: str = "pixel_values") -> None:
    """Raise a `ValueError` unless `pixel_values` is one float image of the config's size
    (`num_channels`, `image_size`: a `ViTConfig`'s, or a vision tower's)."""
    c = config
    model = type(config).__name__.removesuffix("Config")
    want = (c.num_channels, c.image_size, c.image_size)
    if not hasattr(pixel_values, "shape") or tuple(pixel_values.shape) != want:
        got = getattr(pixel_values, "shape", type(pixel_values).__name__)
        raise ValueError(
            f"{what} of shape {got}: {model} takes one image of shape {want} (channels, "
            "height, width), as transformers' image processors give; vmap over a batch, "
            f"and resize images to {c.image_size}x{c.image_size}."
        )
    if not jnp.issubdtype(pixel_values.dtype, jnp.floating):
        raise ValueError(
            f"{what} are {pixel_values.dtype}; {model} takes floating-point pixels. "
            "Convert the image, e.g. `x.astype(jnp.float32) / 255`, normalised as in training."
        )


class ViT(hf.HFModel):
    """ViT as an Equinox module (`transformers.ViTModel`), called on one image.

    Args:
        config: the hyperparameters.
        scan_layers: stack the layers and run them with `lax.scan`.
        remat: rematerialise each layer in the backward pass (see `rc.remat`).
        key: for the initialisation: weights N(0, `initializer_range`), zero biases.

    Example:
        >>> model = ViT(config, key=jax.random.key(0))
        >>> model(jnp.zeros((3, 16, 16))).shape   # CLS token + 16 patches
        (17, 32)
    """

    config: ViTConfig = eqx.field(static=True)
    remat: RematPolicy = eqx.field(static=True)
    patch_embed: eqx.nn.Conv2d
    cls_token: Float[Array, " hidden"]
    positions: Float[Array, "tokens hidden"]
    blocks: Stack
    norm: eqx.nn.LayerNorm
    pooler: eqx.nn.Linear | None

    config_class: ClassVar[type[hf.HFConfig]] = ViTConfig
    hf_base_prefix: ClassVar[str] = ""

    def __init__(
        self,
        config: ViTConfig,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        key: PRNGKeyArray,
    ):
        if not isinstance(config, ViTConfig):
            raise TypeError(
                f"ViT takes a ViTConfig, got {type(config).__name__}; build one with "
                "ViTConfig(...) or load a ViT folder with ViT.from_hf."
            )
        c = config
        d, std, eps = c.hidden_size, c.initializer_range, c.layer_norm_eps
        kp, kc, kpos, kb, kpool = jax.random.split(key, 5)
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

        p = c.patch_size
        conv = eqx.nn.Conv2d(c.num_channels, d, kernel_size=p, stride=p, key=kp)
        weight = std * jax.random.truncated_normal(kp, -2, 2, conv.weight.shape)
        self.config = config
        self.remat = check_remat(remat)
        self.patch_embed = eqx.tree_at(
            lambda m: (m.weight, m.bias), conv, (weight, jnp.zeros((d, 1, 1)))
        )
        self.cls_token = std * jax.random.truncated_normal(kc, -2, 2, (d,))
        self.positions = std * jax.random.truncated_normal(kpos, -2, 2, (c.num_patches + 1, d))
        self.blocks = make_stack(layer, c.num_hidden_layers, scan_layers=scan_layers, key=kb)
        self.norm = eqx.nn.LayerNorm(d, eps=eps)
        pooler = eqx.nn.Linear(d, c.pooler_output_size or d, key=kpool)
        self.pooler = normal_init(pooler, std, key=kpool) if c.add_pooling_layer else None

    def trace_call(self) -> Array:
        """The call the sharding rules trace when none is given: one image of zeros."""
        return self(blank_image(self.config))

    def __call__(
        self,
        pixel_values: Shaped[Array, "channels height width"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "tokens hidden"]:
        """The last hidden states (`last_hidden_state`): the CLS token's, then each patch's.

        Args:
            pixel_values: one image, `(num_channels, image_size, image_size)`, floats.
            key: accepted for the Equinox calling convention; unused (no dropout).

        Raises:
            ValueError: the image has another shape, or integer pixels.
        """
        del key
        check_pixels(pixel_values, self.config)
        use = fsdp.layouts(self)
        with placement_hint():
            conv = fsdp.gather(self.patch_embed, use.patch_embed)
            x = rearrange(conv(pixel_values.astype(self.dtype)), "d h w -> (h w) d")
            cls = fsdp.gather(self.cls_token, use.cls_token)
            x = jnp.concatenate([cls[None].astype(x.dtype), x]) + fsdp.gather(
                self.positions, use.positions
            )
            visible = jnp.ones((x.shape[0], x.shape[0]), bool)

            def layer(block: EncoderLayer, h: Array, _: None) -> tuple[Array, None]:
                return block(h, visible, None), None

            x, _ = run_stack(self.blocks, x, None, layer, use.blocks, self.remat)
            return normalise(fsdp.gather(self.norm, use.norm), x)

    def pooled(self, hidden: Float[Array, "tokens hidden"]) -> Float[Array, " pooled"]:
        """The pooler's output (`pooler_output`): `tanh(dense(h_CLS))`.

        Raises:
            ValueError: the model has no pooler.
        """
        if self.pooler is None:
            raise ValueError(
                "this ViT has no pooler (add_pooling_layer=False: its checkpoint stores "
                "none); use the CLS token's hidden state, `model(pixels)[0]`."
            )
        pooler = fsdp.gather(self.pooler, fsdp.layouts(self).pooler)
        return jnp.tanh(dense(pooler, hidden[:1]))[0]

    @property
    def dtype(self) -> jnp.dtype:
        """The parameters' dtype, which the pixels are cast to."""
        return self.patch_embed.weight.dtype

    @classmethod
    def stored_config(cls, config: ViTConfig, checkpoint: hf.SavedTensors) -> ViTConfig:
        """`config` without a pooler when the checkpoint stores none (a `ViTModel` made
        with `add_pooling_layer=False`)."""
        if "pooler.dense.weight" not in checkpoint:
            config = dataclasses.replace(config, add_pooling_layer=False)
        return super().stored_config(config, checkpoint)

    @classmethod
    def hf_tensors(cls, config: ViTConfig, prefix: str = "", ours: str = "") -> list[hf.TensorMap]:
        """`ViTModel`'s checkpoint names, each after `prefix`, and our paths, each after
        `ours`: the ViT inside a `VisionEncoderDecoderModel` is `encoder.` in both, the
        one inside a `ViTForImageClassification` `vit.`."""
        c = config
        d = c.hidden_size
        layer = "encoder.layer.{i}."

        def linear(name: str, mine: str) -> list[hf.TensorMap]:
            return [hf.same(f"{name}.{w}", f"{mine}.{w}") for w in ("weight", "bias")]

        def bias_in(x: np.ndarray) -> tuple[np.ndarray, ...]:
            return (x.reshape(d, 1, 1),)  # eqx.nn.Conv2d's bias broadcasts over the image

        def bias_out(xs: tuple[np.ndarray, ...]) -> np.ndarray:
            return xs[0].reshape(d)

        def batched(shape: tuple[int, ...]) -> hf.TensorMap:
            name = "cls_token" if len(shape) == 1 else "position_embeddings"
            mine = "cls_token" if len(shape) == 1 else "positions"
            return hf.TensorMap(
                f"{prefix}embeddings.{name}",
                (ours + mine,),
                lambda x: (np.ascontiguousarray(x.reshape(shape)),),
                lambda xs: xs[0].reshape((1,) * (3 - len(shape)) + shape),
            )

        blocks = [
            *linear(layer + "attention.attention.query", "attn.q_proj"),
            *linear(layer + "attention.attention.key", "attn.k_proj"),
            *linear(layer + "attention.attention.value", "attn.v_proj"),
            *linear(layer + "attention.output.dense", "attn.o_proj"),
            *linear(layer + "layernorm_before", "attn_norm"),
            *linear(layer + "layernorm_after", "mlp_norm"),
            *linear(layer + "intermediate.dense", "mlp.fc_in"),
            *linear(layer + "output.dense", "mlp.fc_out"),
        ]
        blocks = [dataclasses.replace(m, hf=prefix + m.hf) for m in blocks]
        patch = f"{prefix}embeddings.patch_embeddings.projection"
        return [
            hf.same(f"{patch}.weight", ours + "patch_embed.weight"),
            hf.TensorMap(f"{patch}.bias", (ours + "patch_embed.bias",), bias_in, bias_out),
            batched((d,)),
            batched((c.num_patches + 1, d)),
            *in_stack(blocks, ours + "blocks"),
            *linear(prefix + "layernorm", ours + "norm"),
            *(linear(prefix + "pooler.dense", ours + "pooler") if c.add_pooling_layer else []),
        ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ViTClassifierConfig(ViTConfig):
    """A ViT image classifier's hyperparameters (`transformers.ViTForImageClassification`):
    a `ViTConfig` and `num_labels` classes, which config.json gives as its labels
    (`id2label`, kept and written back) or as `num_labels`.

    Example:
        >>> config = ViTClassifierConfig(hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=4,
        ...     num_labels=10)
        >>> model = ViTClassifier(config, key=jax.random.key(0))
    """

    architecture: ClassVar[str] = "ViTForImageClassification"
    sizes: ClassVar[tuple[str, ...]] = (*ViTConfig.sizes, "num_labels")

    num_labels: int = 2
    add_pooling_layer: bool = False  # the classifier reads the CLS token, never a pooler

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(add_pooling_layer=(self.add_pooling_layer, False))
        labels = self.get_extra("id2label")
        if labels is not None and len(labels) != self.num_labels:
            raise ValueError(
                f"ViTClassifierConfig: num_labels={self.num_labels} but id2label names "
                f"{len(labels)} labels; give one label per class (or drop num_labels)."
            )

    @classmethod
    def _normalise(cls, values: dict[str, Any]) -> dict[str, Any]:
        values = super()._normalise(values)
        labels = values.get("id2label")
        if isinstance(labels, Mapping):  # transformers' num_labels is len(id2label)
            values.setdefault("num_labels", len(labels))
        return values


class ViTClassifier(hf.HFModel):
    """A ViT with a classification head, as `transformers.ViTForImageClassification`:
    called on one image, the logits of its `num_labels` classes, a Linear on the CLS
    token's final hidden state.

    Args:
        config: the hyperparameters.
        scan_layers: stack the layers and run them with `lax.scan`.
        remat: rematerialise each layer in the backward pass (see `rc.remat`).
        key: for the initialisation: the ViT's, and the head N(0,
            `initializer_range`) with a zero bias.

    Example:
        >>> model = ViTClassifier(config, key=jax.random.key(0))
        >>> model(jnp.zeros((3, 16, 16))).shape
        (10,)
        >>> model = rc.models.from_hf("vit-classifier")  # a ViTForImageClassification folder
    """

    config: ViTClassifierConfig = eqx.field(static=True)
    vit: ViT
    classifier: eqx.nn.Linear

    config_class: ClassVar[type[hf.HFConfig]] = ViTClassifierConfig
    hf_base_prefix: ClassVar[str] = ""

    def __init__(
        self,
        config: ViTClassifierConfig,
        *,
        scan_layers: bool = False,
        remat: str = "none",
        key: PRNGKeyArray,
    ):
        if not isinstance(config, ViTClassifierConfig):
            raise TypeError(
                f"ViTClassifier takes a ViTClassifierConfig, got {type(config).__name__}; "
                "build one with ViTClassifierConfig(..., num_labels=...) or load a "
                "ViTForImageClassification folder with rc.models.from_hf."
            )
        kv, kc = jax.random.split(key)
        head = eqx.nn.Linear(config.hidden_size, config.num_labels, key=kc)
        self.config = config
        self.vit = ViT(config, scan_layers=scan_layers, remat=remat, key=kv)
        self.classifier = normal_init(head, config.initializer_range, key=kc)

    def trace_call(self) -> Array:
        """The call the sharding rules trace when none is given: one image of zeros."""
        return self(blank_image(self.config))

    def __call__(
        self,
        pixel_values: Shaped[Array, "channels height width"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " labels"]:
        """The class logits of one image, in float32 (a cross-entropy on them is).

        Args:
            pixel_values: one image, `(num_channels, image_size, image_size)`, floats.
            key: accepted for the Equinox calling convention; unused (no dropout).

        Raises:
            ValueError: the image has another shape, or integer pixels.
        """
        del key
        hidden = self.vit(pixel_values)
        with placement_hint():
            head = fsdp.gather(self.classifier, fsdp.layouts(self).classifier)
            return dense(head, hidden[:1])[0].astype(jnp.float32)

    @classmethod
    def hf_tensors(cls, config: ViTClassifierConfig) -> list[hf.TensorMap]:
        """`ViTForImageClassification`'s checkpoint names: the ViT's under `vit.`, the
        head's `classifier.`."""
        return [
            *ViT.hf_tensors(config, prefix="vit.", ours="vit."),
            *(hf.same(f"classifier.{w}", f"classifier.{w}") for w in ("weight", "bias")),
        ]
