"""The accelerators' own attention kernels behind `rc.nn.attention`: cuDNN and Pallas.

`cudnn` is `jax.nn.dot_product_attention(implementation="cudnn")` (GPU). `pallas` is
the Pallas splash-attention kernel for TPU
(`jax.experimental.pallas.ops.tpu.splash_attention`, MaxText's default): causal,
sliding-window and soft-capped scores, segment ids and grouped heads, in blocks of
multiples of 128.

A Mosaic kernel cannot be partitioned by XLA, so on several devices the kernel runs
under `jax.shard_map` over the mesh the active step's `Parallelism` names (FSDP's
stored weights, sequence or context parallelism): the rows over `"data"` and the heads
over `"model"` where their counts divide. The zoo's decoders attend one row at a time
under `jax.vmap`, where the rows are invisible; a `custom_vmap` rule sees them, so the
shard_map splits them too. The backward pass is the kernel's own, run after its
forward again: a custom VJP wraps both so that `jax.vmap` reaches the rule (the
kernel's residuals cannot leave it), and the forward's output is all it keeps.

`*_refusal` say why a kernel does not apply to a call (None: it does); `"auto"` then
picks another implementation, and an explicit request is refused naming the reason.

No GPU compiler runs where a GPU is only planned for: under `planned_for("gpu")` a
step traced for CPU devices attends as it would on a GPU, except that where cuDNN's
kernel would run, the blockwise attention stands in for it. Both keep the same things
for the backward pass (queries, keys, values, the output and each query's log-sum-exp)
and never hold a whole score matrix, so the CPU compiler's memory is a GPU's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from ..parallel import _active
from ._blockwise import scale_of
from ._options import Options

__all__ = [
    "active_mesh",
    "cudnn",
    "cudnn_refusal",
    "pallas",
    "pallas_refusal",
    "planned_for",
    "platform",
    "refuse",
    "stand_in",
]

_DATA, _MODEL = "data", "model"
PALLAS_BLOCK = 128
"""Splash attention's blocks are multiples of this many tokens."""


def active_mesh() -> Mesh | None:
    """The mesh of the step being traced, when its parallelism names one."""
    active = _active.current()
    return None if active is None else active.mesh


_PLANNED: ContextVar[str | None] = ContextVar("redcoast_planned_platform", default=None)


@contextlib.contextmanager
def planned_for(where: str | None) -> Iterator[None]:
    """Trace attention as for `where` (`"gpu"`) while compiling for this machine's CPU:
    the planner's GPU estimate (see the module's docstring); `None` changes nothing."""
    token = _PLANNED.set(where)
    try:
        yield
    finally:
        _PLANNED.reset(token)


def stand_in() -> bool:
    """Whether an accelerator's kernel is only planned for: the blockwise attention
    runs in its place."""
    return _PLANNED.get() is not None


def platform() -> str:
    """The platform the computation is for: the one planned for (`planned_for`), else
    the active step's mesh's, else the device `jax.default_device` names, else JAX's
    default backend."""
    if (planned := _PLANNED.get()) is not None:
        return planned
    mesh = active_mesh()
    if mesh is not None:
        return mesh.devices.flat[0].platform
    device = jax.config.jax_default_device  # type: ignore[attr-defined]
    if isinstance(device, str):
        return device
    if device is not None:
        return device.platform
    return jax.default_backend()


def refuse(name: str, reason: str | None) -> None:
    """Raise a ValueError saying why `implementation=name` cannot run this call."""
    if reason is not None:
        raise ValueError(
            f"attention: implementation={name!r} {reason}. Use implementation='blockwise' "
            "(every option, any backend) or 'auto'."
        )


def cudnn_refusal(q: Array, k: Array, options: Options) -> str | None:
    """Why cuDNN's fused attention cannot run this call, or None."""
    if (where := platform()) != "gpu":
        return f"runs on GPU, and this computation is for {where}"
    if names := options.given("mask", "segment_ids", "kv_segment_ids", "bias", "softcap"):
        return f"takes no {', '.join(names)}"
    if q.dtype not in (jnp.float16, jnp.bfloat16) or k.dtype != q.dtype:
        return f"needs float16 or bfloat16 inputs, got {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > 128:
        return f"needs head_dim a multiple of 8 up to 128, got {q.shape[-1]}"
    return None


def cudnn(
    q: Array, k: Array, v: Array, *, causal: bool, window: int | None, scale: float | None
) -> Array:
    """cuDNN's fused attention over `(*batch, seq, heads, head_dim)` inputs."""
    flat = lambda x: x.reshape(-1, *x.shape[-3:])  # noqa: E731
    out = jax.nn.dot_product_attention(
        flat(q),
        flat(k),
        flat(v),
        scale=scale_of(q.shape[-1], scale),
        is_causal=causal,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn",
    )
    return out.reshape(q.shape)


def pallas_refusal(q: Array, k: Array, options: Options) -> str | None:
    """Why the splash-attention kernel cannot run this call, or None."""
    mesh = active_mesh()
    if (where := platform()) != "tpu":
        return f"runs on TPU, and this computation is for {where}"
    if names := options.given("mask", "bias"):
        return f"takes no {', '.join(names)}"
    seq, kv_seq = q.shape[-3], k.shape[-3]
    if seq % PALLAS_BLOCK or kv_seq % PALLAS_BLOCK:
        return (
            f"needs both lengths multiples of {PALLAS_BLOCK}, got {seq} queries and {kv_seq} keys"
        )
    if options.kv_segment_ids is not None and not options.causal:
        # A query whose document has no key would have no key to see: the kernel's
        # softmax is undefined there.
        return "takes kv_segment_ids only with causal=True"
    if mesh is None and jax.device_count() > 1:
        return (
            f"must be told how the batch is split on {jax.device_count()} devices: call "
            "it inside a redcoast step whose parallelism names the mesh (FSDP, sequence "
            "or context parallelism), or on one device"
        )
    return None


def pallas_block(n: int, given: int | None) -> int:
    """The splash kernel's block over `n` tokens: `given`, else the largest multiple of
    128 up to 512 that divides `n`."""
    if given is not None:
        return given
    return max(b for b in (128, 256, 384, 512) if n % b == 0)


def _splash_rows(
    q: Array,
    k: Array,
    v: Array,
    q_seg: Array | None,
    kv_seg: Array | None,
    *,
    causal: bool,
    window: int | None,
    softcap: float | None,
    scale: float,
    blocks: tuple[int, int],
) -> Array:
    """The splash kernel over rows `(b, t, h, d)` held on one device."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    seq, heads = q.shape[1], q.shape[2]
    kv_seq = k.shape[1]
    shape = (seq, kv_seq)
    if window is not None:
        one: Any = splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    elif causal:
        one = splash.CausalMask(shape)
    else:
        one = splash.FullMask(shape)
    bq, bkv = blocks
    sizes = splash.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([one] * heads),
        block_sizes=sizes,
        attn_logits_soft_cap=softcap,
        head_shards=1,
        q_seq_shards=1,
    )

    def row(q: Array, k: Array, v: Array, q_seg: Any, kv_seg: Any) -> Array:
        # The kernel scores q . k as given: the scale goes on the queries.
        q = (q.astype(jnp.float32) * scale).astype(q.dtype)
        heads_first = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731
        segments = None if q_seg is None else splash.SegmentIds(q=q_seg, kv=kv_seg)
        out = kernel(heads_first(q), heads_first(k), heads_first(v), segment_ids=segments)
        return heads_first(out)

    return jax.vmap(row)(q, k, v, q_seg, kv_seg)


def _sharded(fn: Any, mesh: Mesh | None, q: Array, k: Array, *rest: Any) -> Any:
    """`fn(q, k, *rest)` under `jax.shard_map` over `mesh`: rows over `"data"`, heads
    over `"model"`, where they divide; `fn` itself without a mesh."""
    if mesh is None:
        return fn(q, k, *rest)
    shape = dict(mesh.shape)
    rows = _DATA if shape.get(_DATA, 1) > 1 and q.shape[0] % shape[_DATA] == 0 else None
    n_model = shape.get(_MODEL, 1)
    split_heads = n_model > 1 and q.shape[2] % n_model == 0 and k.shape[2] % n_model == 0
    heads = _MODEL if split_heads else None

    def spec(x: Any) -> Any:
        if x is None:
            return None
        return P(rows, None, heads, None) if x.ndim == 4 else P(rows, None)

    args = (q, k, *rest)
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=tuple(spec(x) for x in args),
        out_specs=jax.tree.map(spec, jax.eval_shape(fn, q, k, *rest)),
        check_vma=False,
    )(*args)


def _with_rows(fn: Any) -> Any:
    """`fn` over arrays with a leading axis of rows, whose `jax.vmap` folds the vmapped
    axis into the rows (so the shard_map inside sees every row)."""

    @jax.custom_batching.custom_vmap
    def run(*args: Any) -> Any:
        return fn(*args)

    @run.def_vmap
    def rule(axis_size: int, in_batched: list[Any], *args: Any) -> tuple[Any, Any]:
        def fold(x: Any, batched: Any) -> Any:
            if x is None:
                return None
            if not batched:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            return x.reshape(axis_size * x.shape[1], *x.shape[2:])

        flat = [fold(x, b) for x, b in zip(args, in_batched, strict=True)]
        out = fn(*flat)
        unfold = lambda y: y.reshape(axis_size, -1, *y.shape[1:])  # noqa: E731
        return jax.tree.map(unfold, out), jax.tree.map(lambda _: True, out)

    return run


@functools.cache
def _splash_op(
    causal: bool,
    window: int | None,
    softcap: float | None,
    scale: float,
    blocks: tuple[int, int],
    mesh: Mesh | None,
) -> Any:
    """The kernel as a function of rows `(q, k, v, q_seg, kv_seg)`, with a VJP and a
    vmap rule; one per static configuration. `mesh` is read when the op is made: JAX
    may trace its parts again later (remat), outside the step's active context."""
    rows = functools.partial(
        _splash_rows, causal=causal, window=window, softcap=softcap, scale=scale, blocks=blocks
    )

    def forward(q: Array, k: Array, v: Array, q_seg: Any, kv_seg: Any) -> Array:
        return _sharded(rows, mesh, q, k, v, q_seg, kv_seg)

    def backward(q: Array, k: Array, v: Array, q_seg: Any, kv_seg: Any, g: Array) -> Any:
        def local(q: Array, k: Array, v: Array, q_seg: Any, kv_seg: Any, g: Array) -> Any:
            pullback = jax.vjp(lambda q, k, v: rows(q, k, v, q_seg, kv_seg), q, k, v)[1]
            return pullback(g)

        return _sharded(local, mesh, q, k, v, q_seg, kv_seg, g)

    forward_rows, backward_rows = _with_rows(forward), _with_rows(backward)

    @jax.custom_vjp
    def op(q: Array, k: Array, v: Array, q_seg: Any, kv_seg: Any) -> Array:
        return forward_rows(q, k, v, q_seg, kv_seg)

    def fwd(q: Array, k: Array, v: Array, q_seg: Any, kv_seg: Any) -> tuple[Array, Any]:
        return forward_rows(q, k, v, q_seg, kv_seg), (q, k, v, q_seg, kv_seg)

    def bwd(res: Any, g: Array) -> Any:
        dq, dk, dv = backward_rows(*res, g)
        return dq, dk, dv, None, None

    op.defvjp(fwd, bwd)
    return op


def pallas(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool,
    window: int | None,
    softcap: float | None,
    scale: float | None,
    segment_ids: Array | None,
    kv_segment_ids: Array | None,
    block_size: int | tuple[int, int] | None,
) -> Array:
    """The splash-attention kernel over `(*batch, seq, heads, head_dim)` inputs."""
    seq, kv_seq = q.shape[-3], k.shape[-3]
    given = (block_size, block_size) if not isinstance(block_size, tuple) else block_size
    blocks = (pallas_block(seq, given[0]), pallas_block(kv_seq, given[1]))
    for what, n, b in (("queries", seq, blocks[0]), ("keys", kv_seq, blocks[1])):
        if n % b or b % PALLAS_BLOCK:
            raise ValueError(
                f"attention: implementation='pallas' needs blocks of a multiple of "
                f"{PALLAS_BLOCK} {what} dividing the {n} {what}; got block_size={b}."
            )
    flat = lambda x: None if x is None else x.reshape(-1, *x.shape[-3:])  # noqa: E731
    q_seg = None if segment_ids is None else segment_ids.reshape(-1, seq)
    kv_seg = q_seg if kv_segment_ids is None else kv_segment_ids.reshape(-1, kv_seq)
    op = _splash_op(causal, window, softcap, scale_of(q.shape[-1], scale), blocks, active_mesh())
    return op(flat(q), flat(k), flat(v), q_seg, kv_seg).reshape(q.shape)
