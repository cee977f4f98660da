"""The blocks of `redcoast.nn`: projections, tables, norms and attention."""

import abc
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._remat import PROJECTION

__all__ = [
    "AbstractProjection",
    "AbstractQuantized",
    "AbstractTable",
    "Norm",
    "dense",
    "normalise",
    "table_dtype",
    "tied_logits",
]


class AbstractQuantized(eqx.Module):
    """A frozen Linear stored in a compact number format, standing where the Linear stood.

    It computes `x @ W^T + b` with `W` decoded inside the computation (never kept as
    a parameter), so `dense` and LoRA's adapters take it wherever they take a Linear.
    The sharding rules plan the Linear it stands for (`stand_in`) and split its own
    arrays from that Linear's spec (`specs_from`).
    """

    bias: eqx.AbstractVar[Array | None]

    @property
    @abc.abstractmethod
    def weight_shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for: `(*layers, out, in)`."""

    @abc.abstractmethod
    def over_tokens(self, x: Float[Array, "*tokens in"]) -> Float[Array, "*tokens out"]:
        """The layer on every row of `x` (features last), computing in `x`'s dtype."""

    @abc.abstractmethod
    def dequantized(self, dtype: DTypeLike | None = None) -> eqx.nn.Linear:
        """The plain Linear it decodes to (in the quantized weight's dtype by default)."""

    @abc.abstractmethod
    def stand_in(self) -> eqx.nn.Linear:
        """A Linear of its shapes and dtypes whose arrays take no memory, for planning."""

    @abc.abstractmethod
    def specs_from(self, linear: eqx.nn.Linear, sizes: dict[str, int]) -> tuple[Any, str]:
        """Its arrays' `PartitionSpec`s from the stand-in Linear's (a Linear of specs).

        Args:
            linear: `stand_in()` with a `PartitionSpec` in place of each array.
            sizes: the mesh's axis sizes, by name.

        Returns:
            The module with a spec in place of each array, and a note when a
            dimension the Linear splits had to stay whole ("" otherwise).
        """

    def __call__(
        self, x: Float[Array, " in_features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " out_features"]:
        """On one input vector, as `eqx.nn.Linear` (`key` is not used)."""
        return self.over_tokens(x)


class AbstractProjection(eqx.Module):
    """A module that stands where a block has a Linear, wrapping one (`base`).

    Adapters such as `rc.lora.LoRALinear` replace a block's Linear without the block
    knowing: `dense` hands them every token at once (`over_tokens`), so they keep the
    fast matmul path, and the sharding rules read `base` as the Linear it stands for.
    """

    base: eqx.AbstractVar[eqx.nn.Linear | AbstractQuantized]

    @abc.abstractmethod
    def over_tokens(self, x: Float[Array, "*tokens in"]) -> Float[Array, "*tokens out"]:
        """The module on every row of `x` (features last)."""


class AbstractTable(eqx.Module):
    """A module that stands where a model has its token table, wrapping one (`base`).

    Called on one id as `eqx.nn.Embedding` is; `logits` stands for the table as an
    output head tied to it, so a wrapper such as `rc.lora.LoRAEmbedding` changes
    the input and the tied head alike.
    """

    base: eqx.AbstractVar[eqx.nn.Embedding]

    @abc.abstractmethod
    def __call__(
        self, x: Int[Array, ""], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " features"]:
        """The row of token `x`."""

    @abc.abstractmethod
    def logits(self, h: Float[Array, "*tokens features"]) -> Float[Array, "*tokens vocab"]:
        """`h` against every row: the logits of a head tied to the table."""


def tied_logits(
    table: eqx.nn.Embedding | AbstractTable, h: Float[Array, "*tokens features"]
) -> Float[Array, "*tokens vocab"]:
    """The logits of an output head tied to `table`: `h` against each of its rows."""
    return table.logits(h) if isinstance(table, AbstractTable) else h @ table.weight.T


def table_dtype(table: eqx.nn.Embedding | AbstractTable) -> DTypeLike:
    """The dtype of the token table (the wrapped one's, for an `AbstractTable`)."""
    return (table.base if isinstance(table, AbstractTable) else table).weight.dtype


def dense(
    layer: eqx.nn.Linear | AbstractProjection | AbstractQuantized, x: Float[Array, "*tokens in"]
) -> Float[Array, "*tokens out"]:
    """`layer` on every row of `x`: `jax.vmap(layer)(x)` as one matmul over the rows.

    The token axes are flattened into one before the matmul (a free reshape), so
    `jax.grad` writes the weight gradient as `g^T x` (`g` the output's gradient)
    contracting that one axis: a matmul XLA:CPU runs on both operands as they lie.
    Contracting several token axes instead makes XLA first copy `g` (or `x`)
    transposed into a `(features, tokens)` matrix, and fuse into that copy the
    elementwise work that produces it. Under `jax.vmap` the batch axis is a second
    contracting axis of the batch's weight gradient, which XLA meets with such a
    copy; only JAX's own transformations of a `dot_general` are involved, so `dense`
    composes with every `jax.vmap`, `jax.grad` and `jax.jit`, to any order.

    Args:
        layer: the Linear (weight `(out, in)`, optional bias `(out,)`), or a module
            wrapping one (`AbstractProjection`) or standing for one
            (`AbstractQuantized`), which computes over the tokens itself.
        x: inputs, features last.

    Returns:
        `x @ layer.weight.T + layer.bias`.

    Example:
        >>> layer = eqx.nn.Linear(32, 64, key=jax.random.key(0))
        >>> dense(layer, jnp.ones((10, 32))).shape
        (10, 64)
    """
    if isinstance(layer, AbstractProjection | AbstractQuantized):
        return layer.over_tokens(x)
    rows = x.reshape(-1, x.shape[-1])
    y = jax.lax.dot_general(rows, layer.weight, (((1,), (1,)), ((), ())))
    # Named, so that remat's "dots" policy keeps the output by name (`PROJECTION`).
    y = checkpoint_name(y.reshape(*x.shape[:-1], y.shape[-1]), PROJECTION)
    return y if layer.bias is None else y + layer.bias


Norm = eqx.nn.LayerNorm | eqx.nn.RMSNorm


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _normalise(
    x: Array, weight: Array | None, bias: Array | None, eps: float, centre: bool
) -> Array:
    return _normalise_fwd(x, weight, bias, eps, centre)[0]


_NormResiduals = tuple[Array, Array | None, Array, Array | None, Array | None]


def _standardised(x: Array, mean: Array | None, rstd: Array) -> Array:
    x = x.astype(rstd.dtype)
    return (x if mean is None else x - mean) * rstd


def _normalise_fwd(
    x: Array, weight: Array | None, bias: Array | None, eps: float, centre: bool
) -> tuple[Array, _NormResiduals]:
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = xf.mean(-1, keepdims=True) if centre else None
    centred = xf if mean is None else xf - mean
    rstd = jax.lax.rsqrt((centred * centred).mean(-1, keepdims=True) + eps)
    y = centred * rstd
    if weight is not None:
        y = weight.astype(y.dtype) * y
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(x.dtype), (x, mean, rstd, weight, bias)


def _normalise_bwd(
    eps: float, centre: bool, res: _NormResiduals, g: Array
) -> tuple[Array, Array | None, Array | None]:
    del eps, centre
    x, mean, rstd, weight, bias = res
    xhat = _standardised(x, mean, rstd)
    g = g.astype(xhat.dtype)
    tokens = tuple(range(g.ndim - 1))
    a = g if weight is None else g * weight.astype(g.dtype)
    da = a - xhat * (a * xhat).mean(-1, keepdims=True)
    if mean is not None:
        da = da - a.mean(-1, keepdims=True)
    dw = None if weight is None else (g * xhat).sum(tokens).astype(weight.dtype)
    db = None if bias is None else g.sum(tokens).astype(bias.dtype)
    return (rstd * da).astype(x.dtype), dw, db


_normalise.defvjp(_normalise_fwd, _normalise_bwd)


def normalise(norm: Norm, x: Float[Array, "*tokens features"]) -> Float[Array, "*tokens features"]:
    """`norm` (a LayerNorm or RMSNorm) on every row of `x`, with a closed-form gradient.

    Equals `jax.vmap(norm)(x)`: computed in at least float32, returned in `x`'s
    dtype. The gradient is written out as one expression per row
    (`rstd * (a - mean(a) - xhat * mean(a * xhat))`, `a = g * weight`) instead of
    `jax.grad`'s trace of the mean, the variance and the square root. Between
    layers the residual stream's gradient is the previous one plus this term, and
    with `jax.grad`'s many small terms XLA fused the whole chain (one term from
    every later layer, up to 92 inputs) into each consumer and computed it again
    there; this one is kept once per layer.

    Args:
        norm: an `eqx.nn.LayerNorm` or `eqx.nn.RMSNorm` over the last axis.
        x: inputs, features last.

    Returns:
        The normalised rows, scaled and shifted by the norm's weight and bias.

    Example:
        >>> normalise(eqx.nn.LayerNorm(32), jnp.ones((10, 32))).shape
        (10, 32)
    """
    if norm.shape != x.shape[-1:]:
        raise ValueError(
            f"{type(norm).__name__} of shape {norm.shape} normalises the last axis; it got "
            f"an input of shape {x.shape}. Build it with shape (features,) = {x.shape[-1:]}."
        )
    centre = isinstance(norm, eqx.nn.LayerNorm)
    return _normalise(x, norm.weight, norm.bias, norm.eps, centre)
