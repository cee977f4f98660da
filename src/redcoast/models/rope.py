"""Rotary position embeddings (Su et al. 2021) and their scalings, as `transformers` has them.

A `RoPE` is static data of a model: the inverse frequencies of its rotary features,
computed from a config.json's `rope_parameters` (or `rope_scaling`) exactly as
`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` computes them -- the same
formulas, in float32 where it uses float32 -- for the types `default`, `linear`,
`dynamic` (NTK), `yarn`, `longrope` and `llama3` (`rope_from_parameters`). Two of
them depend on the sequence: `dynamic` raises the base once the sequence is longer
than `max_position_embeddings`, `longrope` switches to its long factors once it is
longer than `original_max_position_embeddings`; both read the length as the largest
position + 1, as `transformers` does, so the cached and uncached passes agree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Real

__all__ = ["ROPE_TYPES", "RoPE", "rope_from_parameters"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
"""The `rope_type` values implemented (transformers' names)."""

# The keys each type reads, besides rope_type and rope_theta; any other key is an error
# rather than a setting silently ignored.
_KEYS: dict[str, set[str]] = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "longrope": {"short_factor", "long_factor", "factor", "original_max_position_embeddings"}
    | {"attention_factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


def _f32(x: Any) -> np.ndarray:
    return np.asarray(x, np.float32)


@dataclasses.dataclass(frozen=True)
class RoPE:
    """The rotation of one attention layer's queries and keys: static and hashable.

    Attributes:
        rotary_dim: how many features of each head rotate (the first ones).
        inv_freq: the inverse frequency of each pair of features (`rotary_dim // 2`).
        attention_scaling: multiplies cos and sin (`yarn`'s and `longrope`'s
            attention factor), so the scores by its square.
        interleaved: rotate pairs `(0, 1), (2, 3), ...` (GPT-J) instead of the halves
            `(i, i + rotary_dim / 2)` (GPT-NeoX, LLaMA).
        long_inv_freq: `longrope`'s frequencies for sequences longer than
            `original_max_position_embeddings`.
        original_max_position_embeddings: `longrope`'s switch-over length.
        dynamic: `(rope_theta, factor, max_position_embeddings)` of dynamic NTK
            scaling, whose base grows with sequences longer than the last.
    """

    rotary_dim: int
    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    interleaved: bool = False
    long_inv_freq: tuple[float, ...] | None = None
    original_max_position_embeddings: int | None = None
    dynamic: tuple[float, float, int] | None = None

    @classmethod
    def default(cls, rotary_dim: int, base: float = 10000.0, *, interleaved: bool = False) -> RoPE:
        """The unscaled rotation with frequency base `base` (`rope_theta`)."""
        return cls(rotary_dim, _default_inv_freq(base, rotary_dim), interleaved=interleaved)

    def frequencies(self, positions: Real[Array, " seq"]) -> Float[Array, " pairs"]:
        """The inverse frequencies used for a sequence at `positions`."""
        inv = jnp.asarray(self.inv_freq, jnp.float32)
        if self.long_inv_freq is None and self.dynamic is None:
            return inv
        length = jnp.max(positions).astype(jnp.float32) + 1
        if self.long_inv_freq is not None:
            assert self.original_max_position_embeddings is not None
            long = jnp.asarray(self.long_inv_freq, jnp.float32)
            return jnp.where(length > self.original_max_position_embeddings, long, inv)
        assert self.dynamic is not None
        base, factor, limit = self.dynamic
        dim = self.rotary_dim
        grown = base * ((factor * length / limit) - (factor - 1)) ** (dim / (dim - 2))
        exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
        # Within the trained length the base is unchanged: the default frequencies exactly.
        return jnp.where(length > limit, 1.0 / (grown**exponents), inv)

    def cos_sin(
        self, positions: Real[Array, " seq"], dtype: DTypeLike
    ) -> tuple[Float[Array, "seq pairs"], Float[Array, "seq pairs"]]:
        """cos and sin of every position's angles, scaled, in `dtype` (as transformers)."""
        angles = positions.astype(jnp.float32)[:, None] * self.frequencies(positions)[None, :]
        scale = self.attention_scaling
        return (jnp.cos(angles) * scale).astype(dtype), (jnp.sin(angles) * scale).astype(dtype)

    def __call__(
        self, x: Float[Array, "seq heads head_dim"], positions: Real[Array, " seq"]
    ) -> Float[Array, "seq heads head_dim"]:
        """`x` with its first `rotary_dim` features of each head rotated by position."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        cos, sin = self.cos_sin(positions, x.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.interleaved:
            even, odd = rot[..., 0::2], rot[..., 1::2]
            rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
            rotated = rotated.reshape(rot.shape)
        else:
            half = self.rotary_dim // 2
            first, second = rot[..., :half], rot[..., half:]
            rotated = jnp.concatenate(
                [first * cos - second * sin, second * cos + first * sin], axis=-1
            )
        return jnp.concatenate([rotated, rest], axis=-1)


def _default_inv_freq(base: float, dim: int) -> tuple[float, ...]:
    exponents = _f32(np.arange(0, dim, 2)) / _f32(dim)
    return tuple(float(v) for v in _f32(1.0) / (_f32(base) ** exponents))


def _check_keys(kind: str, params: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(params) - _KEYS[kind] - {"rope_type", "type", "rope_theta"})
    if unknown:
        raise ValueError(
            f"{where}: rope_type={kind!r} does not take {unknown}; redcoast would ignore "
            f"them and compute another model. The keys it reads: {sorted(_KEYS[kind])}."
        )


def rope_from_parameters(
    params: Mapping[str, Any] | None,
    *,
    rope_theta: float,
    rotary_dim: int,
    max_position_embeddings: int,
    original_max_position_embeddings: int | None = None,
    where: str = "rope_parameters",
) -> RoPE:
    """A `RoPE` from a config's rope parameters, as transformers' `ROPE_INIT_FUNCTIONS`.

    Args:
        params: `rope_type` and its settings (`factor`, `low_freq_factor`, ...), or
            `None` for the default rotation.
        rope_theta: the frequency base.
        rotary_dim: how many features of each head rotate.
        max_position_embeddings: the config's; `dynamic` scaling starts past it, and
            `yarn`, `llama3` and `longrope` take it as the original length when the
            parameters do not say.
        original_max_position_embeddings: a top-level original length (Phi-3's), which
            takes precedence over the parameters' own (as in transformers).
        where: names the setting in errors.

    Returns:
        The rotation.

    Raises:
        ValueError: a `rope_type` not implemented, a key the type does not read, or a
            required key missing; the message names it.

    Example:
        >>> rope = rope_from_parameters(
        ...     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        ...      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        ...     rope_theta=500000.0, rotary_dim=128, max_position_embeddings=131072)
    """
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"{where}: rope_type={kind!r} is not implemented; redcoast implements "
            f"{', '.join(ROPE_TYPES)} (as transformers computes them)."
        )
    _check_keys(kind, params, where)
    dim = rotary_dim

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise ValueError(f"{where}: rope_type={kind!r} needs {key!r}.")
        return params[key]

    original = int(
        original_max_position_embeddings
        or params.get("original_max_position_embeddings")
        or max_position_embeddings
    )
    default = _default_inv_freq(rope_theta, dim)
    if kind == "default":
        return RoPE(dim, default)
    if kind == "linear":
        inv = _f32(default) / _f32(need("factor"))
        return RoPE(dim, tuple(map(float, inv)))
    if kind == "dynamic":
        factor = float(need("factor"))
        return RoPE(dim, default, dynamic=(float(rope_theta), factor, max_position_embeddings))
    if kind == "llama3":
        return RoPE(dim, _llama3(default, params, need, original))
    if kind == "yarn":
        return _yarn(params, need, rope_theta, dim, max_position_embeddings, original)
    return _longrope(params, need, rope_theta, dim, max_position_embeddings, original)


def _llama3(default: tuple[float, ...], params: Any, need: Any, original: int) -> tuple[float, ...]:
    inv = _f32(default)
    factor, low, high = need("factor"), need("low_freq_factor"), need("high_freq_factor")
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = _f32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / _f32(factor), inv).astype(np.float32)
    smooth = ((_f32(original) / wavelen - _f32(low)) / _f32(high - low)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / _f32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return tuple(float(v) for v in _f32(np.where(medium, smoothed, scaled)))


def _yarn(
    params: Mapping[str, Any], need: Any, base: float, dim: int, limit: int, original: int
) -> RoPE:
    # JSON numbers may be ints: floats from here on.
    factor = float(params.get("factor") or limit / original)
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, float(mscale)) / get_mscale(
                factor, float(mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = _f32(1 - _f32(ramp))
    pos_freqs = _f32(base) ** (_f32(np.arange(0, dim, 2)) / _f32(dim))
    extrapolation = _f32(1.0) / pos_freqs
    interpolation = _f32(1.0) / (_f32(factor) * pos_freqs)
    inv = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return RoPE(dim, tuple(float(v) for v in _f32(inv)), attention_scaling=float(attention_factor))


def _longrope(
    params: Mapping[str, Any], need: Any, base: float, dim: int, limit: int, original: int
) -> RoPE:
    factor = params.get("factor") or limit / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    shape = _f32(np.arange(0, dim, 2)) / _f32(dim)
    powers = _f32(base) ** shape

    def inv(key: str) -> tuple[float, ...]:
        factors = _f32(need(key))
        if factors.shape != (dim // 2,):
            raise ValueError(
                f"rope_parameters: {key} has {factors.size} values; a rotary dimension of "
                f"{dim} needs {dim // 2}."
            )
        return tuple(float(v) for v in _f32(1.0) / (factors * powers))

    return RoPE(
        dim,
        inv("short_factor"),
        attention_scaling=float(attention_factor),
        long_inv_freq=inv("long_factor"),
        original_max_position_embeddings=int(original),
    )


def rotate(
    x: Float[Array, "seq heads head_dim"],
    positions: Real[Array, " seq"],
    *,
    rotary_dim: int,
    base: float = 10000.0,
    interleaved: bool = False,
) -> Float[Array, "seq heads head_dim"]:
    """Rotary position embedding (Su et al. 2021) on the first `rotary_dim` features of each head.

    The default, unscaled rotation; `RoPE` is the general one.

    Args:
        x: queries or keys, split into heads.
        positions: the position of each token.
        rotary_dim: how many features of each head rotate (GPT-J rotates part of a head).
        base: the frequency base.
        interleaved: rotate pairs `(0, 1), (2, 3), ...` (GPT-J) instead of the halves
            `(i, i + rotary_dim / 2)` (GPT-NeoX, LLaMA).

    Returns:
        `x` with its first `rotary_dim` features rotated.
    """
    return RoPE.default(rotary_dim, base, interleaved=interleaved)(x, positions)
