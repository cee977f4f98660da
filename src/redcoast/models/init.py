"""Initialisation from scratch as `transformers` does it.

`transformers`' `PreTrainedModel._init_weights` draws every Linear (and GPT-2's
`Conv1D`) weight and every embedding from N(0, `initializer_range`), zeroes the
biases, sets norm scales to one and norm biases to zero. Equinox's own defaults
differ (uniform Linears, N(0, 1) embeddings); an embedding of N(0, 1) through a
tied head gives logits of standard deviation ~sqrt(hidden) and an initial loss
far above a uniform guess's ln(vocab). The zoo's constructors build their layers
with Equinox and redraw them here. Everything is drawn with `jax.random`, so it
works under `eqx.filter_vmap` (stacked layers) and `eqx.filter_eval_shape`
(abstract models, no memory).
"""

from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

_Tree = TypeVar("_Tree", bound=PyTree)


def _is_layer(x: object) -> bool:
    return isinstance(x, eqx.nn.Linear | eqx.nn.Embedding)


def _redraw(layer: object, std: float, key: PRNGKeyArray) -> object:
    if isinstance(layer, eqx.nn.Linear):
        weight = std * jax.random.normal(key, layer.weight.shape, layer.weight.dtype)
        bias = None if layer.bias is None else jnp.zeros_like(layer.bias)
        return eqx.tree_at(
            lambda m: (m.weight, m.bias), layer, (weight, bias), is_leaf=lambda x: x is None
        )
    if isinstance(layer, eqx.nn.Embedding):
        weight = std * jax.random.normal(key, layer.weight.shape, layer.weight.dtype)
        return eqx.tree_at(lambda m: m.weight, layer, weight)
    return layer


def normal_init(tree: _Tree, std: float, *, key: PRNGKeyArray) -> _Tree:
    """Redraw every `eqx.nn.Linear` and `eqx.nn.Embedding` weight in `tree` from N(0, std).

    Linear biases become zeros; everything else (norms: ones and zeros already) is
    kept. Each layer gets its own key, split from `key`.

    Args:
        tree: a module (or any pytree of modules).
        std: the standard deviation (`initializer_range`, OPT's `init_std`).
        key: for the draws.

    Returns:
        `tree` with its Linear and Embedding layers redrawn.

    Example:
        >>> mlp = MLP(32, 128, key=jax.random.key(0))
        >>> mlp = normal_init(mlp, 0.02, key=jax.random.key(1))
        >>> float(mlp.fc_in.weight.std())  # ~0.02
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_layer)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef, [_redraw(leaf, std, k) for leaf, k in zip(leaves, keys, strict=True)]
    )


_Table = TypeVar("_Table", eqx.nn.Embedding, eqx.nn.Linear)


def zero_unused_rows(table: _Table, vocab_size: int, padding_idx: int | None = None) -> _Table:
    """`table` (token embeddings or a vocabulary head) with the rows no token uses zeroed.

    Those are the rows padded past `vocab_size` for an even split (`vocab_multiple`),
    which loading a checkpoint also fills with zeros, and the padding token's row,
    which `transformers` zeroes (`nn.Embedding(..., padding_idx)`).

    Args:
        table: an Embedding, or a Linear with one output row per token.
        vocab_size: the real vocabulary; rows from here on are padding.
        padding_idx: the padding token's id, or `None`.

    Returns:
        The table with those rows zeroed.

    Example:
        >>> emb = eqx.nn.Embedding(256, 32, key=jax.random.key(0))
        >>> emb = zero_unused_rows(emb, vocab_size=250, padding_idx=1)
    """
    weight = table.weight.at[vocab_size:].set(0)
    if padding_idx is not None:
        weight = weight.at[padding_idx].set(0)
    return eqx.tree_at(lambda m: m.weight, table, weight)


def token_embeddings(
    config: Any, width: int, std: float, *, key: PRNGKeyArray, padding_idx: int | None = None
) -> eqx.nn.Embedding:
    """A token table of `config.padded_vocab_size` rows drawn from N(0, std), the rows no
    token uses zeroed (`zero_unused_rows`)."""
    table = eqx.nn.Embedding(config.padded_vocab_size, width, key=key)
    return zero_unused_rows(normal_init(table, std, key=key), config.vocab_size, padding_idx)


def vocab_head(
    config: Any, width: int, std: float, *, key: PRNGKeyArray, use_bias: bool = False
) -> eqx.nn.Linear | None:
    """A vocabulary head drawn from N(0, std), the rows no token uses zeroed; `None` when
    `config.tie_word_embeddings` (the logits come from the token table)."""
    if config.tie_word_embeddings:
        return None
    head = eqx.nn.Linear(width, config.padded_vocab_size, use_bias=use_bias, key=key)
    return zero_unused_rows(normal_init(head, std, key=key), config.vocab_size)
