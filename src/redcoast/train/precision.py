"""Precision policies: which dtype parameters are stored in and which dtype computes.

- `"fp32"`: parameters, optimizer state and compute in float32.
- `"bf16"` (mixed precision, Micikevicius et al. 2018): float32 master parameters
  and optimizer state; each step casts the floating parameters to bfloat16 before
  `loss_fn` sees the model, so matmuls run in bfloat16, and the cast's transpose
  hands float32 gradients to the float32 master weights. bfloat16 has float32's
  exponent range, so no loss scaling is needed.
- `"pure-bf16"`: parameters and optimizer state stored in bfloat16 (`fit` casts the
  model once, before `optimizer.init`), bfloat16 compute. Half the memory of
  `"bf16"` for weights and optimizer state, at the cost of updates rounded to
  bfloat16's 8-bit mantissa.

Losses and metrics a step returns are float32 under every policy. The zoo models
compute norms and softmax in float32 and return float32 logits, so a
cross-entropy on them is float32 too.
"""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import PyTree

from .._checks import check_choice
from ..nn import AbstractQuantized

Precision = Literal["fp32", "bf16", "pure-bf16"]
"""A precision policy (see the module docstring)."""
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "pure-bf16")

# What each policy stores the parameters in, and what it computes in.
_PARAM_DTYPE = {"fp32": jnp.float32, "bf16": jnp.float32, "pure-bf16": jnp.bfloat16}
_COMPUTE_DTYPE = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "pure-bf16": jnp.bfloat16}


def check_precision(precision: object) -> Precision:
    """`precision` itself if it is one of `PRECISIONS`, else a `ValueError` listing them
    and what each does: `check_precision("bf16")` is `"bf16"`."""
    return check_choice(
        "precision",
        precision,
        PRECISIONS,
        "'bf16' keeps float32 parameters and computes in bfloat16, 'pure-bf16' also "
        "stores parameters and optimizer state in bfloat16.",
    )


def param_dtype(precision: str) -> Any:
    """The dtype (`jnp.float32` or `jnp.bfloat16`) policy `precision` stores floating
    parameters in, and the optimizer state with them: bfloat16 for `"pure-bf16"` only."""
    return _PARAM_DTYPE[check_precision(precision)]


def compute_dtype(precision: str) -> Any:
    """The dtype (`jnp.float32` or `jnp.bfloat16`) policy `precision` runs the model in:
    float32 for `"fp32"` only."""
    return _COMPUTE_DTYPE[check_precision(precision)]


def cast(tree: PyTree, dtype: DTypeLike) -> PyTree:
    """`tree` with every floating-point array cast to `dtype`; other leaves untouched.

    Integer arrays (token tables' indices, step counters), keys and static fields
    keep their types, and so does a quantized Linear (`rc.quantize`): its float32
    scales are part of its format, and it computes in its input's dtype anyway.
    Under `jax.grad` the cast is differentiable: gradients flow back in the
    original dtype.

    Args:
        tree: a model, an optimizer state or any pytree.
        dtype: e.g. `jnp.bfloat16`.

    Returns:
        The same structure with floating arrays of `dtype`.

    Example:
        >>> model = rc.cast(model, jnp.bfloat16)   # what fit does for precision="pure-bf16"
    """

    def one(x: Any) -> Any:
        if isinstance(x, AbstractQuantized):
            return x
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, AbstractQuantized))


def for_compute(tree: PyTree, precision: str) -> PyTree:
    """`tree` in the dtype `precision` computes in: bfloat16 under the bf16 policies.

    Under `"fp32"` the tree is returned as it is, whatever its dtypes: the policy
    changes nothing that ran before policies existed.

    Args:
        tree: a model, or its floating arrays.
        precision: a policy.

    Returns:
        The tree to call.

    Example:
        >>> logits = jax.vmap(for_compute(model, "bf16"))(tokens)
    """
    return tree if check_precision(precision) == "fp32" else cast(tree, compute_dtype(precision))


def check_param_dtypes(params: PyTree, precision: str, *, where: str) -> None:
    """Raise unless every floating parameter has the dtype `precision` stores parameters in.

    Under `"fp32"` any dtype is accepted, as before policies existed.

    Args:
        params: the model's floating arrays.
        precision: a policy.
        where: the name of the caller, for the message.

    Raises:
        ValueError: naming the first parameter of the wrong dtype and the fix.

    Example:
        >>> check_param_dtypes(rc.cast(model, jnp.bfloat16), "pure-bf16", where="train_step")
    """
    if precision == "fp32":
        return
    want = jnp.dtype(param_dtype(precision))
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != want:
            fix = (
                "cast the model with rc.cast(model, jnp.bfloat16) before optimizer.init "
                "(fit does this itself)"
                if precision == "pure-bf16"
                else "keep float32 master parameters (rc.cast(model, jnp.float32)), or use "
                "precision='pure-bf16' for bfloat16 storage"
            )
            raise ValueError(
                f"{where}: precision={precision!r} stores parameters in {want}, but "
                f"model{jax.tree_util.keystr(path)} is {x.dtype}; {fix}."
            )
