"""A diffusion transformer conditioned on text (Peebles & Xie 2023's DiT, adaLN-Zero),
its noise schedule and a deterministic DDIM sampler (Song et al. 2021).

The image is cut into patches by a strided convolution (a stem the sharding rules keep
whole), the timestep and the prompt (the mean of its tokens' embeddings) make one
conditioning vector, and each block's LayerNorms are shifted, scaled and gated by a
Linear of it, zero at initialisation so that each block starts as the identity. With
`prompt_tokens`, the prompt's tokens also join the patches in the attention. The
attention and MLP are the zoo's, split Megatron's way by the rules.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..nn import dense
from .layers import MLP, gelu_tanh
from .seq2seq import Seq2SeqAttention


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiTConfig:
    """The DiT's sizes.

    Attributes:
        image_size: height and width of the (square) images.
        patch_size: side of a patch; divides `image_size`.
        channels: image channels.
        hidden_size: width of the transformer.
        num_layers: blocks.
        num_heads: attention heads; divide `hidden_size`.
        vocab_size: prompt token ids are `[0, vocab_size)`; id 0 is padding.
        timesteps: steps of the forward (noising) process.
        prompt_tokens: the prompt's tokens also join the patches in every block's
            attention (the DiT paper's in-context conditioning, beside adaLN), so that
            each patch can read each word, not only their mean.
    """

    image_size: int = 16
    patch_size: int = 2
    channels: int = 3
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    vocab_size: int = 32
    timesteps: int = 1000
    prompt_tokens: bool = False

    def __post_init__(self) -> None:
        for big, small in (("image_size", "patch_size"), ("hidden_size", "num_heads")):
            if getattr(self, big) % getattr(self, small):
                raise ValueError(
                    f"DiTConfig: {big}={getattr(self, big)} is not a multiple of "
                    f"{small}={getattr(self, small)}; choose sizes that divide."
                )


def _sincos_positions(side: int, hidden: int) -> Float[Array, "patches hidden"]:
    """The DiT paper's 2-D sine-cosine table: a quarter of the features each for sin and
    cos of the row and of the column; the initial value of the learned positions."""
    quarter = hidden // 4
    freqs = 1.0 / 10_000 ** (jnp.arange(quarter) / quarter)
    rows, cols = jnp.meshgrid(jnp.arange(side), jnp.arange(side), indexing="ij")
    ay = rearrange(rows, "h w -> (h w) 1") * freqs
    ax = rearrange(cols, "h w -> (h w) 1") * freqs
    table = jnp.concatenate([jnp.sin(ay), jnp.cos(ay), jnp.sin(ax), jnp.cos(ax)], axis=1)
    return jnp.pad(table, ((0, 0), (0, hidden - 4 * quarter)))


def _check_images(config: DiTConfig, images: Array, batched: bool) -> None:
    """Refuse images that are not float arrays of the config's (channels, size, size)."""
    want = (config.channels, config.image_size, config.image_size)
    shape = tuple(images.shape)
    if shape[int(batched) :] != want or len(shape) != 3 + batched:
        raise ValueError(
            f"DiT: images of shape {shape}; this DiT takes "
            f"{'(batch, ' if batched else '('}{', '.join(map(str, want))}) channels first "
            "(DiTConfig's channels and image_size): resize or transpose them."
        )
    if not jnp.issubdtype(images.dtype, jnp.floating):
        raise ValueError(
            f"DiT: images of dtype {images.dtype}; pass floating-point pixels "
            "(for example uint8 scaled to [-1, 1] as float32)."
        )


def _modulate(
    x: Float[Array, "seq hidden"], shift: Float[Array, " hidden"], scale: Float[Array, " hidden"]
) -> Float[Array, "seq hidden"]:
    mean, var = jnp.mean(x, -1, keepdims=True), jnp.var(x, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * (1 + scale) + shift


class DiTBlock(eqx.Module):
    """adaLN-Zero: attention and MLP on the modulated norm, each output gated."""

    modulation: eqx.nn.Linear
    attn: Seq2SeqAttention
    mlp: MLP

    def __init__(self, hidden: int, heads: int, *, key: PRNGKeyArray):
        km, ka, kf = jax.random.split(key, 3)
        zero = eqx.nn.Linear(hidden, 6 * hidden, key=km)
        self.modulation = jax.tree.map(jnp.zeros_like, zero)
        head_dim = hidden // heads
        self.attn = Seq2SeqAttention(
            hidden, heads, head_dim, use_bias=True, scale=head_dim**-0.5, key=ka
        )
        self.mlp = MLP(hidden, 4 * hidden, activation=gelu_tanh, key=kf)

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        c: Float[Array, " hidden"],
        visible: Bool[Array, " seq"],
    ) -> Float[Array, "seq hidden"]:
        """The block on `x`, each position attending to the `visible` ones."""
        mod = dense(self.modulation, jax.nn.silu(c)[None])[0]
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod, 6)
        h = _modulate(x, shift1, scale1)
        mask = jnp.broadcast_to(visible, (x.shape[0], x.shape[0]))
        x = x + gate1 * self.attn(h, self.attn.keys_values(h), mask)
        return x + gate2 * self.mlp(_modulate(x, shift2, scale2))


class DiT(eqx.Module):
    """A text-conditioned DiT predicting the noise in one image.

    The learned positions start as the paper's 2-D sine-cosine table. Images of another
    shape than `(channels, image_size, image_size)`, or not floating point, are refused.

    Args:
        config: the sizes.
        key: for the initialisation.

    Example:
        >>> model = DiT(DiTConfig(), key=jax.random.key(0))
        >>> model(jnp.zeros((3, 16, 16)), jnp.array(500), jnp.array([4, 9, 0])).shape
        (3, 16, 16)
    """

    config: DiTConfig = eqx.field(static=True)
    patch_embed: eqx.nn.Conv2d
    positions: Float[Array, "patches hidden"]
    words: eqx.nn.Embedding
    time_in: eqx.nn.Linear
    time_out: eqx.nn.Linear
    blocks: tuple[DiTBlock, ...]
    final_modulation: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, config: DiTConfig, *, key: PRNGKeyArray):
        c, d = config, config.hidden_size
        keys = jax.random.split(key, 7)
        self.config = config
        self.patch_embed = eqx.nn.Conv2d(
            c.channels, d, c.patch_size, stride=c.patch_size, key=keys[0]
        )
        self.positions = _sincos_positions(c.image_size // c.patch_size, d)
        self.words = eqx.nn.Embedding(c.vocab_size, d, key=keys[2])
        self.time_in = eqx.nn.Linear(d, 4 * d, key=keys[3])
        self.time_out = eqx.nn.Linear(4 * d, d, key=keys[4])
        block_keys = jax.random.split(keys[5], c.num_layers)
        self.blocks = tuple(DiTBlock(d, c.num_heads, key=k) for k in block_keys)
        final = eqx.nn.Linear(d, 2 * d, key=keys[6])
        self.final_modulation = jax.tree.map(jnp.zeros_like, final)
        out = eqx.nn.Linear(d, c.patch_size**2 * c.channels, key=keys[6])
        self.out = jax.tree.map(jnp.zeros_like, out)

    def condition(self, t: Int[Array, ""], prompt: Int[Array, " words"]) -> Float[Array, " hidden"]:
        """The conditioning vector: the timestep's embedding plus the prompt's (the mean
        of its non-padding tokens' embeddings)."""
        half = self.config.hidden_size // 2
        freqs = jnp.exp(-jnp.log(10_000.0) * jnp.arange(half) / half)
        angles = t.astype(jnp.float32) * freqs
        emb = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)])[None]
        time = dense(self.time_out, jax.nn.silu(dense(self.time_in, emb)))[0]
        real = (prompt != 0).astype(jnp.float32)
        text = (jax.vmap(self.words)(prompt) * real[:, None]).sum(0) / jnp.maximum(real.sum(), 1)
        return time + text

    def __call__(
        self,
        image: Array,
        t: Int[Array, ""],
        prompt: Int[Array, " words"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "channels height width"]:
        """The predicted noise in `image` (float, `(channels, image_size, image_size)`), a
        noised image at step `t` of `prompt`.

        Raises:
            ValueError: `image` of another shape or not floating point.
        """
        del key
        c = self.config
        _check_images(c, image, batched=False)
        p, side = c.patch_size, c.image_size // c.patch_size
        x = rearrange(self.patch_embed(image), "d h w -> (h w) d") + self.positions
        patches = x.shape[0]
        visible = jnp.ones(patches, bool)  # the keys each position attends to
        if c.prompt_tokens:  # the words after the patches, their padding never read
            x = jnp.concatenate([x, jax.vmap(self.words)(prompt)])
            visible = jnp.concatenate([visible, prompt != 0])
        cond = self.condition(t, prompt)
        for block in self.blocks:
            x = block(x, cond, visible)
        x = x[:patches]
        shift, scale = jnp.split(dense(self.final_modulation, jax.nn.silu(cond)[None])[0], 2)
        x = dense(self.out, _modulate(x, shift, scale))
        return rearrange(x, "(h w) (p q c) -> c (h p) (w q)", h=side, p=p, q=p)


def alphas_cumprod(timesteps: int) -> Float[Array, " timesteps"]:
    """DDPM's linear schedule (Ho et al. 2020), `prod(1 - beta)` with beta from 1e-4 to
    0.02 for 1000 steps, scaled by `1000 / timesteps` so that any number of steps ends
    in (nearly) pure noise, where the sampler starts."""
    scale = 1000 / timesteps
    betas = jnp.linspace(1e-4 * scale, 0.02 * scale, timesteps)
    return jnp.cumprod(1.0 - betas)


def noise_prediction_loss(
    model: DiT,
    images: Array,
    prompts: Int[Array, "batch words"],
    key: PRNGKeyArray,
) -> Float[Array, ""]:
    """The standard DDPM loss: the mean squared error of the predicted noise.

    Args:
        model: the DiT.
        images: float `(batch, channels, image_size, image_size)`, clean.
        prompts: their token ids, one prompt per row, padded with 0.
        key: draws the steps and the noise.

    Raises:
        ValueError: images of another shape or not floating point.
    """
    _check_images(model.config, images, batched=True)
    kt, kn = jax.random.split(key)
    a = alphas_cumprod(model.config.timesteps)
    t = jax.random.randint(kt, (images.shape[0],), 0, model.config.timesteps)
    noise = jax.random.normal(kn, images.shape, images.dtype)
    abar = a[t][:, None, None, None]
    noised = jnp.sqrt(abar) * images + jnp.sqrt(1 - abar) * noise
    return jnp.mean((jax.vmap(model)(noised, t, prompts) - noise) ** 2)


def ddim_sample(
    model: DiT, prompts: Int[Array, "batch words"], key: PRNGKeyArray, *, steps: int = 50
) -> Float[Array, "batch c h w"]:
    """Images for `prompts` by DDIM with eta 0: deterministic given `key` (the start noise).

    Args:
        model: the trained DiT.
        prompts: token ids, one prompt per row, padded with 0.
        key: draws the starting noise.
        steps: denoising steps, spread evenly over the model's timesteps.
    """
    c = model.config
    a = alphas_cumprod(c.timesteps)
    ts = jnp.linspace(c.timesteps - 1, 0, steps).round().astype(jnp.int32)
    x = jax.random.normal(key, (prompts.shape[0], c.channels, c.image_size, c.image_size))

    def step(x: Array, i: Array) -> tuple[Array, None]:
        t, prev = ts[i], jnp.where(i + 1 < steps, ts[jnp.minimum(i + 1, steps - 1)], -1)
        eps = jax.vmap(model, in_axes=(0, None, 0))(x, t, prompts)
        abar, abar_prev = a[t], jnp.where(prev >= 0, a[jnp.maximum(prev, 0)], 1.0)
        x0 = (x - jnp.sqrt(1 - abar) * eps) / jnp.sqrt(abar)
        return jnp.sqrt(abar_prev) * x0 + jnp.sqrt(1 - abar_prev) * eps, None

    x, _ = jax.lax.scan(step, x, jnp.arange(steps))
    return x
