"""How a checkpoint's tensors become a model's arrays and back: one `TensorMap` each.

Each architecture lists its maps (`hf_tensors`); `hf.load` and `hf.save` apply
them. Besides a tensor stored as the model stores it (`same`), there are GPT-2's
transposed `Conv1D` weights (`conv1d`), tables padded to a vocabulary multiple
(`vocab_rows`), fused projections split apart (`fused_qkv` and `fused_conv1d`,
GPT-2's `Conv1D`s; `split_rows`, Phi-3's fused Linears) and one tensor per expert
stacked on an expert axis (`experts`, Mixtral's).
"""

import dataclasses
from collections.abc import Callable

import numpy as np

from ._hf_config import HFConfig

__all__ = [
    "TensorMap",
    "conv1d",
    "experts",
    "fused_conv1d",
    "fused_qkv",
    "same",
    "split_rows",
    "vocab_rows",
]


def _one(x: np.ndarray) -> tuple[np.ndarray, ...]:
    return (x,)


def _first(xs: tuple[np.ndarray, ...]) -> np.ndarray:
    return xs[0]


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """How one checkpoint tensor becomes one or more arrays of the model, and back.

    Attributes:
        hf: the tensor's name in the checkpoint; `{i}` stands for the layer index.
        ours: dotted paths of the model's arrays it fills. In a per-layer map they are
            relative to one block (`attn.q_proj.weight`).
        to_ours: checkpoint tensor -> the arrays of `ours`, in order.
        to_hf: the arrays of `ours` -> the checkpoint tensor.
        stack: in a per-layer map, the model's field that holds the layers
            (`blocks`; an encoder-decoder has `encoder_blocks` and `decoder_blocks`).
        n_experts: for a tensor per expert (`{e}` in `hf`, see `experts`), how many:
            the model's array stacks them on an expert axis (after the layer axis of
            stacked layers).
        first_layer: in a per-layer map, the checkpoint's index of the stack's first
            layer (DeepSeek-V3's stack of MoE layers follows its dense layers).
    """

    hf: str
    ours: tuple[str, ...]
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]] = _one
    to_hf: Callable[[tuple[np.ndarray, ...]], np.ndarray] = _first
    stack: str = "blocks"
    n_experts: int = 0
    first_layer: int = 0

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    def name(self, layer: int | None, expert: int | None = None) -> str:
        """The checkpoint's name of this tensor in `layer` (and of `expert`)."""
        if layer is None and expert is None:
            return self.hf
        return self.hf.format(i=None if layer is None else layer + self.first_layer, e=expert)


def same(hf: str, ours: str) -> TensorMap:
    """A tensor stored as the model stores it (PyTorch `nn.Linear` is `(out, in)` too)."""
    return TensorMap(hf, (ours,))


def _transpose(x: np.ndarray) -> tuple[np.ndarray, ...]:
    return (np.ascontiguousarray(x.T),)


def _transpose_back(xs: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.ascontiguousarray(xs[0].T)


def conv1d(hf: str, ours: str) -> TensorMap:
    """GPT-2's `Conv1D` weight, stored `(in, out)`: transposed to Equinox's `(out, in)`."""
    return TensorMap(hf, (ours,), _transpose, _transpose_back)


def vocab_rows(hf: str, ours: str, config: HFConfig) -> TensorMap:
    """A tensor with a row per token: padded with zero rows up to the config's
    `padded_vocab_size` on loading, written back with `vocab_size` rows."""
    vocab, padded = int(getattr(config, "vocab_size")), config.padded_vocab_size  # noqa: B009

    def pad(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if x.shape[0] != vocab:
            raise ValueError(f"expected {vocab} rows (vocab_size), got {x.shape[0]}")
        return (np.concatenate([x, np.zeros((padded - vocab, *x.shape[1:]), x.dtype)]),)

    def unpad(xs: tuple[np.ndarray, ...]) -> np.ndarray:
        return xs[0][:vocab]

    return TensorMap(hf, (ours,), pad, unpad)


def _split_weight(n: int) -> Callable[[np.ndarray], tuple[np.ndarray, ...]]:
    def split(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if x.ndim != 2 or x.shape[1] % n:
            raise ValueError(f"expected (in, {n} * out), got shape {x.shape}")
        return tuple(np.ascontiguousarray(p) for p in np.split(x.T, n, axis=0))

    return split


def _join_weight(xs: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.ascontiguousarray(np.concatenate(xs, axis=0).T)


def _split_bias(n: int) -> Callable[[np.ndarray], tuple[np.ndarray, ...]]:
    def split(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if x.ndim != 1 or x.shape[0] % n:
            raise ValueError(f"expected ({n} * out,), got shape {x.shape}")
        return tuple(np.ascontiguousarray(p) for p in np.split(x, n, axis=0))

    return split


def _join_bias(xs: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.concatenate(xs, axis=0)


def fused_qkv(hf: str, q: str, k: str, v: str, *, bias: bool) -> TensorMap:
    """GPT-2's `c_attn`: Q, K and V in one Conv1D, split into three Linears.

    Separate projections are what the sharding rules recognise as attention, and
    they let each be split by heads on its own.
    """
    return fused_conv1d(hf, (q, k, v), bias=bias)


def fused_conv1d(hf: str, ours: tuple[str, ...], *, bias: bool) -> TensorMap:
    """A Conv1D of several equal projections side by side (GPT-2's `c_attn`: Q, K and V;
    its cross-attention's: K and V), split into one Linear each, and joined back."""
    n = len(ours)
    if bias:
        return TensorMap(hf, ours, _split_bias(n), _join_bias)
    return TensorMap(hf, ours, _split_weight(n), _join_weight)


def split_rows(hf: str, ours: tuple[str, ...], sizes: tuple[int, ...]) -> TensorMap:
    """A fused `(out_1 + out_2 + ..., in)` Linear weight (Phi-3's `qkv_proj` and
    `gate_up_proj`) split by rows into the model's separate Linears, and joined back.

    Separate projections are what the sharding rules split by heads (Q, K, V) or
    alike (gate and up); a fused one would be cut across its parts.
    """
    if len(ours) != len(sizes):
        raise ValueError(f"split_rows: {len(ours)} arrays but {len(sizes)} sizes")
    bounds = np.cumsum(sizes)[:-1]

    def split(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if x.ndim < 1 or x.shape[0] != sum(sizes):
            raise ValueError(
                f"expected {sum(sizes)} rows ({' + '.join(map(str, sizes))}), got shape {x.shape}"
            )
        return tuple(np.ascontiguousarray(p) for p in np.split(x, bounds, axis=0))

    def join(xs: tuple[np.ndarray, ...]) -> np.ndarray:
        return np.concatenate(xs, axis=0)

    return TensorMap(hf, ours, split, join)


def experts(hf: str, ours: str, n: int) -> TensorMap:
    """One tensor per expert (`...experts.{e}.w1.weight`, Mixtral's) stacked on the
    leading expert axis of one array of the model, and unstacked on saving."""
    if "{e}" not in hf:
        raise ValueError(f"experts: {hf!r} has no {{e}} for the expert index")
    return TensorMap(hf, (ours,), n_experts=n)
