"""What a call of `rc.nn.attention` asks beside `q`, `k` and `v`, as one value that its
implementations (einsum, blockwise, the kernels) read."""

from __future__ import annotations

import dataclasses

from jaxtyping import Array

__all__ = ["Options"]


@dataclasses.dataclass(frozen=True)
class Options:
    """Which keys each query sees, and what changes the scores.

    Attributes:
        causal: each query sees its own and earlier positions.
        mask: which keys each query sees, broadcasting to `(*batch, seq, kv_seq)`.
        window: with `causal`, only the `window` most recent positions.
        segment_ids: each query's document, `(*batch, seq)`.
        kv_segment_ids: each key's document, when not the queries' own.
        bias: added to the scores, `(*batch, heads, seq, kv_seq)` broadcasting.
        softcap: scores become `softcap * tanh(scores / softcap)`.
    """

    causal: bool = False
    mask: Array | None = None
    window: int | None = None
    segment_ids: Array | None = None
    kv_segment_ids: Array | None = None
    bias: Array | None = None
    softcap: float | None = None

    def given(self, *names: str) -> list[str]:
        """Which of `names` this call sets (not None, not False)."""
        # `is`, not `in (None, False)`: `in` compares with `==`, elementwise on an array.
        return [n for n in names if getattr(self, n) is not None and getattr(self, n) is not False]
