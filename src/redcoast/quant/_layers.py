"""Quantized frozen Linears, `NF4Linear` and `Int8Linear`, and `quantize` (see `redcoast.quant`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PyTree

from .._tree_paths import glob_matches, path_str, target_globs
from ..nn import AbstractProjection, AbstractQuantized, AbstractTable
from ..nn._remat import PROJECTION
from . import _formats

__all__ = [
    "FORMATS",
    "Format",
    "Int8Linear",
    "NF4Linear",
    "QuantTargets",
    "check_format",
    "dequantize",
    "quantize",
    "quantized",
    "quantized_weight",
]

Format = Literal["nf4", "int8"]
FORMATS: tuple[str, ...] = ("nf4", "int8")

QuantTargets = str | Sequence[str] | Callable[[str, eqx.nn.Linear], bool]
"""What `quantize` replaces: globs over the dotted paths of Linears, or a predicate
`(path, linear) -> bool`."""


def _mapped(fn: Callable[..., Any], leading: int) -> Callable[..., Any]:
    """`fn` of one matrix mapped over `leading` stacked axes (a scanned model's layers)."""
    for _ in range(leading):
        fn = jax.vmap(fn)
    return fn


def _abstract(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return np.broadcast_to(np.zeros((), dtype), shape)


MAX_TILES = 16
"""At most this many tiles of output rows per matmul: the decoded weight a quantized
Linear holds at once is 1/16 of it for large layers."""

MIN_TILE_ROWS = 128
"""No tile has fewer output rows than this (small layers decode whole, in one matmul)."""


def tiles(n_out: int) -> int:
    """How many tiles of output rows a weight of `n_out` rows decodes in: the largest
    power of two up to `MAX_TILES` that divides `n_out` into tiles of at least
    `MIN_TILE_ROWS` rows."""
    t = 1
    while t < MAX_TILES and n_out % (2 * t) == 0 and n_out // (2 * t) >= MIN_TILE_ROWS:
        t *= 2
    return t


@functools.partial(
    jax.checkpoint, static_argnums=(0,), policy=jax.checkpoint_policies.nothing_saveable
)
def _tile_product(decode: Callable[..., Array], rows: Array, *tile: Array) -> Array:
    """`rows @ W_tile^T`, the tile of rows decoded in `rows`' dtype; the backward pass
    decodes it again instead of keeping it."""
    w = decode(*tile, rows.dtype)
    return jax.lax.dot_general(rows, w, (((1,), (1,)), ((), ())))


@functools.partial(
    jax.checkpoint, static_argnums=(0, 1, 2), policy=jax.checkpoint_policies.nothing_saveable
)
def _product(
    row_arrays: Callable[..., tuple[Array, ...]],
    decode: Callable[..., Array],
    t: int,
    rows: Array,
    *arrays: Array,
) -> Array:
    """`rows @ W^T`, `W` decoded in `t` tiles of its output rows inside a loop, so that
    one tile of the decoded weight is in memory at a time, forward and backward.

    Tile `j` holds rows `j, j + t, j + 2t, ...` of `t` tiles: a split of the rows over
    devices (contiguous blocks) stays a split of every tile, and the loop runs over an
    axis no device splits.
    """
    by_row = row_arrays(*arrays)
    if t == 1:
        return _tile_product(decode, rows, *by_row)
    stacked = [rearrange(a, "(o t) ... -> t o ...", t=t) for a in by_row]
    _, ys = jax.lax.scan(lambda _, tile: (None, _tile_product(decode, rows, *tile)), None, stacked)
    return rearrange(ys, "t n o -> n (o t)")


class _Quantized(AbstractQuantized):
    """What both formats share: the matmul, the bias, the shapes and the dtype kept."""

    bias: Array | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    dtype: str = eqx.field(static=True)

    def _arrays(self) -> tuple[Any, ...]:
        raise NotImplementedError

    @staticmethod
    def _by_row(*arrays: Any) -> tuple[Array, ...]:
        """One layer's arrays as arrays of one row per output row (tiles slice them)."""
        raise NotImplementedError

    @staticmethod
    def _decode_rows(*arrays: Any) -> Array:
        """Rows of the weight in the dtype given last, from `_by_row`'s arrays' rows."""
        raise NotImplementedError

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """`(*layers, out, in)`: the shape of the weight it stands for."""
        return (*self._arrays()[0].shape[:-2], self.out_features, self.in_features)

    def over_tokens(self, x: Float[Array, "*tokens in"]) -> Float[Array, "*tokens out"]:
        """`x @ W^T + b` on every row of `x`, `W` decoded in `x`'s dtype inside the matmul,
        tile by tile of its output rows (see `tiles`)."""
        if self._arrays()[0].ndim != 2:
            raise ValueError(
                f"{type(self).__name__} holds {self.weight_shape[:-2]} stacked layers; call "
                "it on one layer's slice (as a scan over the layers does), or dequantize it."
            )
        rows = x.reshape(-1, x.shape[-1])
        t = tiles(self.out_features)
        y = _product(self._by_row, self._decode_rows, t, rows, *self._arrays())
        y = checkpoint_name(y.reshape(*x.shape[:-1], self.out_features), PROJECTION)
        return y if self.bias is None else y + self.bias.astype(y.dtype)

    def dequantized(self, dtype: DTypeLike | None = None) -> eqx.nn.Linear:
        """The plain Linear it decodes to, in `dtype` (by default the weight's own)."""
        leading = len(self.weight_shape) - 2
        dtype = jnp.dtype(self.dtype if dtype is None else dtype)
        decode = lambda *a: self._decode_rows(*self._by_row(*a), dtype)  # noqa: E731
        w = _mapped(decode, leading)(*self._arrays())
        linear = eqx.nn.Linear(
            self.in_features,
            self.out_features,
            use_bias=self.bias is not None,
            key=jax.random.key(0),
        )
        return eqx.tree_at(lambda m: (m.weight, m.bias), linear, (w, self.bias), is_leaf=_none)

    def stand_in(self) -> eqx.nn.Linear:
        """A Linear of the weight's shape and dtype over zero-stride arrays (no memory)."""
        linear = eqx.nn.Linear(
            self.in_features,
            self.out_features,
            use_bias=self.bias is not None,
            key=jax.random.key(0),
        )
        w = _abstract(self.weight_shape, jnp.dtype(self.dtype))
        b = None if self.bias is None else _abstract(self.bias.shape, self.bias.dtype)
        return eqx.tree_at(lambda m: (m.weight, m.bias), linear, (w, b), is_leaf=_none)


def _none(x: Any) -> bool:
    return x is None


def _axis_size(entry: Any, sizes: dict[str, int]) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    return int(np.prod([sizes[n] for n in names if n is not None]))


def _entries(spec: P, ndim: int) -> list[Any]:
    return [*spec, *([None] * (ndim - len(spec)))]


def _trim(entries: list[Any]) -> P:
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return P(*entries)


class NF4Linear(_Quantized):
    """A frozen Linear in 4-bit NormalFloat with double-quantized scales (QLoRA).

    As bitsandbytes' `Linear4bit(quant_type="nf4", compress_statistics=True)`
    (Dettmers et al. 2023, arXiv 2305.14314): each block of 64 weights along a row
    stores 4-bit indices into `NF4_CODE` and one absmax; the absmaxes, their mean
    subtracted, are stored as 8-bit indices into bitsandbytes' dynamic code, one
    float32 scale per 256 of them. About 4.13 bits per weight.

    Attributes:
        codes: `(*layers, out, in // 2)` uint8, two indices a byte (high nibble first).
        absmax_codes: `(*layers, out, in // 64)` uint8.
        absmax_scale: `(*layers, ceil(out * in / 16384))` float32.
        offset: `(*layers,)` float32, the mean absmax.
        bias: the Linear's bias, kept as it was.
    """

    codes: Array
    absmax_codes: Array
    absmax_scale: Array
    offset: Array

    def _arrays(self) -> tuple[Any, ...]:
        return (self.codes, self.absmax_codes, self.absmax_scale, self.offset)

    @staticmethod
    def _by_row(*arrays: Any) -> tuple[Array, ...]:
        codes, absmax_codes, absmax_scale, offset = arrays
        return codes, _formats.nf4_absmax(absmax_codes, absmax_scale, offset)

    @staticmethod
    def _decode_rows(*arrays: Any) -> Array:
        return _formats.nf4_rows(*arrays)

    def specs_from(self, linear: eqx.nn.Linear, sizes: dict[str, int]) -> tuple[Any, str]:
        """Codes and block absmaxes split as the weight's rows and, when whole blocks of
        64 fall to each shard, its columns; the second level is split only on layers."""
        shape = self.weight_shape
        nd = len(shape)
        *lead, rows, cols = _entries(linear.weight, nd)  # type: ignore[arg-type]
        note = ""
        if cols is not None and (shape[-1] // _formats.NF4_BLOCK) % _axis_size(cols, sizes):
            note = (
                f"input dimension {shape[-1]} is {shape[-1] // _formats.NF4_BLOCK} blocks of "
                f"{_formats.NF4_BLOCK}, which do not divide into {_axis_size(cols, sizes)} "
                "shards: kept whole (a block never straddles shards)"
            )
            cols = None
        blocks = _trim([*lead, rows, cols])
        spec = eqx.tree_at(
            lambda m: (m.codes, m.absmax_codes, m.absmax_scale, m.offset, m.bias),
            self,
            (blocks, blocks, _trim([*lead, None]), _trim(list(lead)), linear.bias),
            is_leaf=_none,
        )
        return spec, note


class Int8Linear(_Quantized):
    """A frozen Linear in int8 with one float32 scale per output channel.

    `W ~ codes * scale[:, None]`, `scale = absmax(row) / 127`: the weight half of
    LLM.int8()'s vector-wise quantization (Dettmers et al. 2022), without its outlier
    decomposition of activations.

    Attributes:
        codes: `(*layers, out, in)` int8.
        scale: `(*layers, out)` float32.
        bias: the Linear's bias, kept as it was.
    """

    codes: Array
    scale: Array

    def _arrays(self) -> tuple[Any, ...]:
        return (self.codes, self.scale)

    @staticmethod
    def _by_row(*arrays: Any) -> tuple[Array, ...]:
        return arrays

    @staticmethod
    def _decode_rows(*arrays: Any) -> Array:
        return _formats.dequantize_int8(*arrays)

    def specs_from(self, linear: eqx.nn.Linear, sizes: dict[str, int]) -> tuple[Any, str]:
        """Codes split as the weight; each row's scale with the rows."""
        *lead, rows, _ = _entries(linear.weight, len(self.weight_shape))  # type: ignore[arg-type]
        spec = eqx.tree_at(
            lambda m: (m.codes, m.scale, m.bias),
            self,
            (linear.weight, _trim([*lead, rows]), linear.bias),
            is_leaf=_none,
        )
        return spec, ""


def quantized(linear: eqx.nn.Linear, format: str, path: str = "the Linear") -> _Quantized:
    """`linear` (weight `(*layers, out, in)`) quantized to `format`, its bias kept.

    Raises:
        ValueError: an unknown format, or for NF4 an input dimension that is not a
            multiple of the block of 64.
    """
    return quantized_weight(linear.weight, format, bias=linear.bias, path=path)


def quantized_weight(
    w: Array | np.ndarray, format: str, *, bias: Array | None = None, path: str = "the Linear"
) -> _Quantized:
    """The quantized Linear of weight `w` `(*layers, out, in)` and `bias` (see `quantized`)."""
    check_format(format)
    *layers, n_out, n_in = w.shape
    shapes = {"in_features": n_in, "out_features": n_out, "dtype": jnp.dtype(w.dtype).name}
    if format == "int8":
        codes, scale = jax.jit(_mapped(_formats.quantize_int8, len(layers)))(w)
        return Int8Linear(bias=bias, codes=codes, scale=scale, **shapes)
    if n_in % _formats.NF4_BLOCK:
        raise ValueError(
            f"{path} has input dimension {n_in} (weight {tuple(w.shape)}), not a multiple of "
            f"NF4's block of {_formats.NF4_BLOCK} weights: its blocks would straddle rows. "
            "Leave it out of the targets (or quantize it to 'int8', which has no blocks)."
        )
    codes, absmax_codes, absmax_scale, offset = jax.jit(
        _mapped(_formats.quantize_nf4, len(layers))
    )(w)
    return NF4Linear(
        bias=bias,
        codes=codes,
        absmax_codes=absmax_codes,
        absmax_scale=absmax_scale,
        offset=offset,
        **shapes,
    )


def check_format(format: Any) -> None:
    """A `ValueError` naming `format` unless it is one of `FORMATS`."""
    if format not in FORMATS:
        raise ValueError(
            f"unknown quantization format {format!r}; use one of {list(FORMATS)} ('nf4': QLoRA's "
            "4-bit NormalFloat with double-quantized scales, 'int8': 8 bits per channel)."
        )


_LAYERS = eqx.nn.Linear | AbstractQuantized | AbstractProjection | AbstractTable


def _chosen(found: list[tuple[str, Any]], targets: QuantTargets) -> list[bool]:
    """Which of `found` to quantize; a clear error for every target that cannot be."""
    adapters = [p for p, x in found if isinstance(x, AbstractProjection | AbstractTable)]
    done = [p for p, x in found if isinstance(x, AbstractQuantized)]
    linears = [p for p, x in found if isinstance(x, eqx.nn.Linear)]
    if callable(targets):
        chosen = [isinstance(x, eqx.nn.Linear) and bool(targets(p, x)) for p, x in found]
    else:
        globs = target_globs(targets)

        def hit(p: str) -> bool:
            return any(glob_matches(p, g) for g in globs)

        wrapped = [p for p in adapters if hit(p) or hit(p + ".base")]
        if wrapped:
            raise ValueError(
                f"quantize: {wrapped[:6]} are wrapped by adapters (LoRALinear / LoRAEmbedding), "
                "whose arrays train; a weight that trains is never quantized. Quantize the "
                "base model first, then apply LoRA: rc.lora.apply(rc.quantize(model, ...), ...)."
            )
        again = [p for p in done if hit(p)]
        if again:
            raise ValueError(
                f"quantize: {again[:6]} are already quantized; dequantize them first "
                "(layer.dequantized()) or leave them out of the targets."
            )
        unmatched = [g for g in globs if not any(glob_matches(p, g) for p in linears)]
        if unmatched:
            raise ValueError(
                f"quantize target(s) {unmatched} match no eqx.nn.Linear of the model. Targets "
                f"are globs over their dotted paths, such as {linears[:4]}; a bare name like "
                "'q_proj' matches every path ending in it."
            )
        chosen = [isinstance(x, eqx.nn.Linear) and hit(p) for p, x in found]
    if not any(chosen):
        raise ValueError(f"targets select no eqx.nn.Linear of the model; they are {linears[:6]}.")
    return chosen


def quantize(model: PyTree, targets: QuantTargets, format: str = "nf4") -> PyTree:
    """Replace the Linears `targets` selects with frozen quantized ones.

    Args:
        model: any Equinox model; its `eqx.nn.Linear` layers (the zoo's projections
            are such Linears, stacked ones included) can be targets.
        targets: globs over their dotted paths (`"blocks.*.attn.q_proj"`); a bare
            name matches every path ending in it (`["q_proj", "v_proj"]`); or a
            predicate `(path, linear) -> bool`.
        format: `"nf4"` (`NF4Linear`, QLoRA's) or `"int8"` (`Int8Linear`).

    Returns:
        The model with the targets quantized; the rest is the same objects. Apply
        LoRA to it with `rc.lora.apply`; `rc.lora.merge` decodes the bases again.

    Raises:
        ValueError: an unknown format; a glob that matches no Linear; a target
            inside a LoRA adapter (its arrays train), or already quantized; for NF4,
            an input dimension that is not a multiple of 64.

    Example:
        >>> model = rc.quantize(model, ["q_proj", "k_proj", "v_proj", "o_proj"], "nf4")
        >>> model = rc.lora.apply(model, ["q_proj", "v_proj"], rank=8, key=key)
    """
    check_format(format)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: isinstance(x, _LAYERS)
    )
    found = [(path_str(p), x) for p, x in flat]
    chosen = _chosen(found, targets)
    leaves = [
        quantized(x, format, p) if pick else x for (p, x), pick in zip(found, chosen, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def dequantize(model: PyTree, dtype: DTypeLike | None = None) -> PyTree:
    """`model` with every quantized Linear decoded back to a plain `eqx.nn.Linear`.

    Args:
        model: a model with `NF4Linear` or `Int8Linear` layers (a LoRA adapter's
            base among them: `rc.lora.merge` folds the adapters in as well).
        dtype: of the decoded weights; by default each weight's dtype before
            quantization.

    Returns:
        The same model with plain Linears where quantized ones were.

    Example:
        >>> plain = rc.quant.dequantize(model)
    """
    is_quantized = lambda x: isinstance(x, AbstractQuantized)  # noqa: E731
    return jax.tree.map(
        lambda x: x.dequantized(dtype) if is_quantized(x) else x, model, is_leaf=is_quantized
    )
