"""The number formats: NF4 with double-quantized scales (QLoRA), and int8 per channel.

Everything here works on one weight matrix `(out, in)` at a time; the layers in
`_layers.py` map it over a stacked layer axis. Blocks run along the input
dimension of each output row (the row-major order of `(out, in)`, as bitsandbytes
flattens a weight), so a split of the output rows never cuts a block.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

__all__ = [
    "DQ_BLOCK",
    "DYNAMIC_CODE",
    "NF4_BLOCK",
    "NF4_CODE",
    "dequantize_int8",
    "dequantize_nf4",
    "dynamic_map",
    "nf4_absmax",
    "nf4_rows",
    "quantize_int8",
    "quantize_nf4",
]

NF4_BLOCK = 64
"""Weights per NF4 absmax scale (QLoRA's block size)."""

DQ_BLOCK = 256
"""Absmax scales per second-level scale in double quantization (QLoRA's)."""

NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)
"""The 16 levels of 4-bit NormalFloat (Dettmers et al. 2023, Appendix E; bitsandbytes)."""


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' 8-bit dynamic tree code (`create_dynamic_map`), 256 sorted float32 levels.

    A dynamic exponent and a fraction (Dettmers 2015, arXiv 1511.04561): more levels
    near zero. bitsandbytes quantizes QLoRA's absmax scales with it.
    """
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = (
            2 ** (i + non_sign_bits - max_exponent_bits) + 1
            if signed
            else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        )
        boundaries = np.linspace(0.1, 1, fraction_items, dtype=np.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = np.linspace(0.1, 1, additional_items + 1, dtype=np.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        # bitsandbytes scales these by its loop's last exponent, 10 ** 0.
        data += means.tolist()
        if signed:
            data += (-means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return np.sort(np.array(data, np.float32))


DYNAMIC_CODE = dynamic_map()
"""The signed 8-bit dynamic code of the second quantization level."""


def _select16(idx: Array, code: np.ndarray) -> Array:
    """`code[idx]` for a 16-level code, as a tree of selects on the index's bits (as
    bitsandbytes' kernels decode NF4): elementwise, so it fuses into whatever reads
    it, where a gather from the table is a separate, slower op on TPUs."""
    levels = [jnp.float32(v) for v in code]
    for bit in range(4):
        on = (idx & (1 << bit)) != 0
        levels = [jnp.where(on, hi, lo) for lo, hi in zip(levels[0::2], levels[1::2], strict=True)]
    return levels[0]


def _nearest(x: Array, code: np.ndarray) -> Array:
    """The index of the level of the sorted `code` nearest to each value of `x`."""
    mids = jnp.asarray((code[1:] + code[:-1]) / 2)
    return jnp.searchsorted(mids, x, side="left").astype(jnp.uint8)


def _absmax_blocks(x: Float[Array, " n"], block: int) -> tuple[Array, Array]:
    """`x` cut into blocks (the last zero-padded) and each block's absolute maximum."""
    n_blocks = -(-x.shape[0] // block)
    padded = jnp.pad(x, (0, n_blocks * block - x.shape[0])).reshape(n_blocks, block)
    return padded, jnp.abs(padded).max(axis=1)


def _safe(absmax: Array) -> Array:
    # An all-zero block stores absmax 0 and codes for 0; dividing by 1 keeps it finite.
    return jnp.where(absmax == 0, 1.0, absmax)


def quantize_nf4(
    w: Float[Array, "out in"],
) -> tuple[
    UInt8[Array, "out in_half"],
    UInt8[Array, "out in_blocks"],
    Float[Array, " dq_blocks"],
    Float[Array, ""],
]:
    """NF4 with double quantization, as bitsandbytes' `quantize_4bit(..., "nf4",
    compress_statistics=True)`.

    Returns:
        `codes`: two 4-bit indices into `NF4_CODE` per byte, the first of each pair in
        the high nibble; `absmax_codes`: each 64-block's absmax minus their mean, as
        indices into `DYNAMIC_CODE` by 256-blocks; `absmax_scale`: each 256-block's
        absmax of those; `offset`: the mean absmax.
    """
    n_out, n_in = w.shape
    w = w.astype(jnp.float32)
    blocks = w.reshape(n_out, n_in // NF4_BLOCK, NF4_BLOCK)
    absmax = jnp.abs(blocks).max(axis=2)
    idx = _nearest(blocks / _safe(absmax)[..., None], NF4_CODE).reshape(n_out, n_in // 2, 2)
    codes = (idx[..., 0] << 4) | idx[..., 1]
    offset = absmax.mean()
    centred, scale = _absmax_blocks((absmax - offset).reshape(-1), DQ_BLOCK)
    q = _nearest(centred / _safe(scale)[:, None], DYNAMIC_CODE).reshape(-1)
    absmax_codes = q[: absmax.size].reshape(absmax.shape)
    return codes.astype(jnp.uint8), absmax_codes, scale, offset


def nf4_absmax(
    absmax_codes: UInt8[Array, "out in_blocks"],
    absmax_scale: Float[Array, " dq_blocks"],
    offset: Float[Array, ""],
) -> Float[Array, "out in_blocks"]:
    """The first-level absmax scales back from their double quantization (float32)."""
    per_block = jnp.repeat(absmax_scale, DQ_BLOCK)[: absmax_codes.size].reshape(absmax_codes.shape)
    return jnp.asarray(DYNAMIC_CODE)[absmax_codes] * per_block + offset


def dequantize_nf4(
    codes: UInt8[Array, "out in_half"],
    absmax_codes: UInt8[Array, "out in_blocks"],
    absmax_scale: Float[Array, " dq_blocks"],
    offset: Float[Array, ""],
    dtype: jnp.dtype,
) -> Float[Array, "out in"]:
    """The weight `(out, in)` in `dtype` from `quantize_nf4`'s arrays (products in float32)."""
    return nf4_rows(codes, nf4_absmax(absmax_codes, absmax_scale, offset), dtype)


def nf4_rows(
    codes: UInt8[Array, "rows in_half"], absmax: Float[Array, "rows in_blocks"], dtype: jnp.dtype
) -> Float[Array, "rows in"]:
    """Rows of the weight in `dtype` from their codes and their blocks' absmax scales
    (`nf4_absmax`): any subset of rows decodes alone, since no block crosses a row."""
    n_rows, half = codes.shape
    idx = jnp.stack([codes >> 4, codes & 0xF], axis=-1).reshape(n_rows, half * 2)
    values = _select16(idx, NF4_CODE).reshape(n_rows, -1, NF4_BLOCK)
    return (values * absmax[..., None]).reshape(n_rows, half * 2).astype(dtype)


def quantize_int8(w: Float[Array, "out in"]) -> tuple[Array, Float[Array, " out"]]:
    """Symmetric int8 per output channel: `codes = round(w / s)` in [-127, 127],
    `s = absmax(row) / 127` (LLM.int8()'s vector-wise weight quantization)."""
    w = w.astype(jnp.float32)
    scale = jnp.abs(w).max(axis=1) / 127.0
    codes = jnp.clip(jnp.round(w / _safe(scale)[:, None]), -127, 127).astype(jnp.int8)
    return codes, scale


def dequantize_int8(
    codes: Array, scale: Float[Array, " out"], dtype: jnp.dtype
) -> Float[Array, "out in"]:
    """The weight `(out, in)` in `dtype` from `quantize_int8`'s arrays."""
    return (codes.astype(jnp.float32) * scale[:, None]).astype(dtype)
