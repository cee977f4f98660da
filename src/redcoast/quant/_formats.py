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
    "quantize_blockwise",
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


def _torch_linspace(start: float, end: float, n: int) -> np.ndarray:
    """`torch.linspace(start, end, n, dtype=torch.float32)` bit for bit: a float32 step,
    and each value `start + i * step` (from `end` back in the upper half) rounded once,
    as PyTorch's CPU kernel computes it with fused multiply-adds. NumPy's float64
    linspace rounds a few of the dynamic code's levels one ulp the other way."""
    lo, hi = np.float32(start), np.float32(end)
    step = np.float64((hi - lo) / np.float32(n - 1))
    i = np.arange(n, dtype=np.float64)
    return np.where(i < n // 2, lo + i * step, hi - (n - 1 - i) * step).astype(np.float32)


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' 8-bit dynamic tree code (`functional.create_dynamic_map`), 256 sorted
    float32 levels, bit for bit.

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
        boundaries = _torch_linspace(0.1, 1.0, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = _torch_linspace(0.1, 1.0, additional_items + 1)
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


def _safe(absmax: Array) -> Array:
    # An all-zero block stores absmax 0 and codes for 0; scaling by 1 keeps it finite.
    return jnp.where(absmax == 0, 1.0, absmax)


def quantize_blockwise(
    x: Float[Array, " n"], block: int, code: np.ndarray
) -> tuple[UInt8[Array, " n"], Float[Array, " blocks"]]:
    """bitsandbytes' blockwise quantization, both of NF4's levels: each `block` of `x`
    (the last zero-padded) scaled by its absmax, as the indices of the nearest levels
    of the sorted `code`; and those absmaxes."""
    n_blocks = -(-x.shape[0] // block)
    padded = jnp.pad(x, (0, n_blocks * block - x.shape[0])).reshape(n_blocks, block)
    absmax = jnp.abs(padded).max(axis=1)
    # Times the reciprocal, as bitsandbytes' PyTorch kernels scale: a quotient can round the
    # other way, and a value on a midpoint between two levels then takes the other.
    scaled = padded * (1.0 / _safe(absmax))[:, None]
    return _nearest(scaled, code).reshape(-1)[: x.shape[0]], absmax


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

    Bit for bit, bitsandbytes 0.50's PyTorch kernels (`bitsandbytes/backends/default/
    ops.py`, the ops' `default` backend): `bitsandbytes::quantize_4bit` (codes and
    absmaxes), then `bitsandbytes::quantize_blockwise` (the second level's codes and
    scales, given the same offset). The offset, the absmaxes' float32 mean, is summed
    in XLA's order, not PyTorch's: within a few ulps, so one or two second-level codes
    in 10^5 land one level over. On CPU, `functional.quantize_4bit` runs that same
    `quantize_4bit` kernel (there is no other), but its nested `quantize_blockwise`
    runs the `cpu` backend's C kernel (`cquantize_blockwise_cpu_fp32`), whose search
    does not always find the nearest level: about 0.2% of the second-level codes are
    one level over (up to three for values within 1e-5 of zero, where levels crowd).

    Returns:
        `codes`: two 4-bit indices into `NF4_CODE` per byte, the first of each pair in
        the high nibble; `absmax_codes`: each 64-block's absmax minus their mean, as
        indices into `DYNAMIC_CODE` by 256-blocks; `absmax_scale`: each 256-block's
        absmax of those; `offset`: the mean absmax.
    """
    n_out, n_in = w.shape
    idx, absmax = quantize_blockwise(w.astype(jnp.float32).reshape(-1), NF4_BLOCK, NF4_CODE)
    pairs = idx.reshape(n_out, n_in // 2, 2)
    codes = (pairs[..., 0] << 4) | pairs[..., 1]
    offset = absmax.mean()
    absmax_codes, scale = quantize_blockwise(absmax - offset, DQ_BLOCK, DYNAMIC_CODE)
    return codes, absmax_codes.reshape(n_out, n_in // NF4_BLOCK), scale, offset


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
