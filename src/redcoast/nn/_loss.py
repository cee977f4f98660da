"""Softmax cross-entropy in float32 that keeps no float32 copy of the logits."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._checks import typechecked

__all__ = ["cross_entropy"]


@typechecked
def cross_entropy(
    logits: Float[Array, "*batch vocab"], labels: Int[Array, "*batch"]
) -> Float[Array, "*batch"]:
    """Softmax cross-entropy of integer `labels`, in float32 from logits of any float dtype.

    The values and gradients of `optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), labels)`. The label's logit is picked by a sum over the
    vocabulary (every other term 0, so exact) rather than a gather: a reduction, which
    the compilers fuse with the conversion to float32 and the normalizer's, so no
    float32 copy of the `(..., vocab)` logits is kept. Gathered from the converted
    logits, the TPU compiler keeps that copy (4 bytes a logit, 1 GB for 4 x 2048 tokens
    of a 32000-token vocabulary) beside the bfloat16 logits. `rc.models.lm_loss` and
    the planner's losses use it.

    Args:
        logits: unnormalised scores, the vocabulary last.
        labels: the right class of each position, in `[0, vocab)`.

    Returns:
        The negative log-likelihood of each label, float32, of `labels`' shape.

    Raises:
        jaxtyping.TypeCheckError: labels whose shape is not the logits' without the
            vocabulary (naming the parameter and both shapes).

    Example:
        >>> nll = rc.nn.cross_entropy(logits, ids[:, 1:]).mean()
    """
    x = logits.astype(jnp.float32)
    label = jnp.where(labels[..., None] == jnp.arange(x.shape[-1]), x, 0.0).sum(-1)
    return jax.nn.logsumexp(x, axis=-1) - label
