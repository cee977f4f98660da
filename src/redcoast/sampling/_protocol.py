"""What sampling needs of a model: a cached forward pass, its vocabulary and its positions."""

from typing import Any, Protocol, runtime_checkable

from jaxtyping import Array, Float, Int


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model `sample` and `generate` can continue prompts with.

    Every decoder of the zoo (`rc.models.AbstractCausalLM`) is one; a model of your own
    is one when it has these members. All of them act on one unbatched sequence:
    sampling vmaps them over the rows.

    Attributes:
        vocab_size: how many token ids the model knows: it samples from `[0, vocab_size)`.
        max_positions: the longest sequence the model allows (a learned position
            table), or `None` when there is no limit (rotary positions).

    Example:
        >>> class MyLM(eqx.Module):
        ...     vocab_size: int = eqx.field(static=True)
        ...     max_positions: int | None = eqx.field(static=True)
        ...     def __call__(self, input_ids): ...                  # (seq, vocab) logits
        ...     def init_cache(self, max_len): ...                  # any pytree of arrays
        ...     def decode(self, input_ids, cache, index): ...      # (logits, cache)
        >>> isinstance(MyLM(...), rc.sampling.CausalLM)
        True
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_positions(self) -> int | None: ...

    def __call__(self, input_ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        """Next-token logits at every position of one sequence (what `generate`'s
        `use_cache=False` runs at every step)."""
        ...

    def init_cache(self, max_len: int) -> Any:
        """An empty cache (a pytree of arrays) for one sequence of up to `max_len` tokens."""
        ...

    def decode(
        self, input_ids: Int[Array, " seq"], cache: Any, index: Int[Array, ""] | int
    ) -> tuple[Float[Array, "seq vocab"], Any]:
        """The logits of `input_ids`, which continue the `index` tokens held in `cache`
        (`input_ids[0]` sits at position `index`), and the cache holding them too."""
        ...
