"""A mixture's SwiGLU experts applied to the tokens routed to them, and only to those.

`experts(x, chosen, weights, w_gate, w_up, w_down)` is the routed part of a sparse
mixture of experts: token `t` goes to the experts `chosen[t]` (its `top_k`), each
applies `down(act(gate(x)) * up(x))`, and the results are summed with `weights[t]`.
The expert weights are stacked on a leading expert axis, `(experts, out, in)` as
PyTorch's Linears lie. Three dispatches compute it:

- `"dropless"` (the default): every routing `(t, e)` becomes a row, the rows are
  sorted by expert, and a grouped matmul applies each expert to its own rows --
  on TPU `jax.lax.ragged_dot_general`, which XLA:TPU runs as grouped kernels (its
  `cost_analysis` counts the weights' gradient as dense; the run skips the rows of
  other experts); elsewhere blocks of rows that each belong to one expert, run by a
  loop over each expert's blocks (XLA:CPU and XLA:GPU lower `ragged_dot` to one
  dense matmul per expert, masked: `experts` times the work). The FLOPs are those
  of the chosen experts, plus at most an eighth for the blocks' padding.
- a float `c` (a capacity factor, as Switch Transformer and GShard): each expert
  takes at most `ceil(c * tokens * top_k / experts)` routings of a sequence, in
  the order of the tokens; the routings over it are dropped (their share of the
  output is 0). Shapes are static: one batched matmul over `(experts, capacity)`.
- `"dense"`: every expert computes every token and the weights, zero outside a
  token's `top_k`, combine them: `experts / top_k` times the FLOPs, the same
  numbers. The sharding rules read the mixture in this form.

A model calls `experts` on one sequence under `jax.vmap`; a `custom_vmap` rule folds
the vmapped rows into one call, so that the rows of a whole batch are sorted and
dispatched together. Under a step's mesh (`rc.fit`, `rc.train_step`), the dispatch
runs under `jax.shard_map`: rows split over `"data"`, experts over `"model"`
(expert parallelism; within each expert, Megatron-style, when the experts do not
divide the model axis). Each device applies its own experts to the routings that
chose them, and one all-reduce over `"model"` sums the experts' outputs -- the
reduction a tensor-parallel MLP makes anyway: the tokens are already on every
device of the model axis, so no all-to-all is needed. The backward pass is written
out (a custom VJP, which also carries `jax.vmap` to the rule): the sorted rows'
activations are kept, nothing is recomputed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from ..parallel import _active
from . import _grouped
from ._grouped import Slots

__all__ = ["DISPATCHES", "GROUPED", "Dispatch", "experts"]

Dispatch = Literal["dropless", "dense"] | float
DISPATCHES = ("dropless", "dense")
GROUPED = ("auto", "ragged", "blocked")
"""How `"dropless"` runs its grouped matmuls: `"auto"` picks `"ragged"` on TPU."""

_DATA, _MODEL = "data", "model"


def experts(
    x: Float[Array, "*tokens hidden"],
    chosen: Int[Array, "*tokens k"],
    weights: Float[Array, "*tokens k"],
    w_gate: Float[Array, "experts ffn hidden"],
    w_up: Float[Array, "experts ffn hidden"],
    w_down: Float[Array, "experts hidden ffn"],
    *,
    activation: Callable[[Array], Array] = jax.nn.silu,
    dispatch: str | float = "dropless",
    grouped: str = "auto",
) -> Float[Array, "*tokens hidden"]:
    """The experts `chosen` for each token, applied to it and summed with `weights`.

    Args:
        x: the tokens (one sequence; `jax.vmap` it over a batch).
        chosen: each token's experts, indices into the expert axis.
        weights: each chosen expert's weight.
        w_gate: every expert's gate projection, `(experts, ffn, hidden)`.
        w_up: every expert's up projection, `(experts, ffn, hidden)`.
        w_down: every expert's down projection, `(experts, hidden, ffn)`.
        activation: of the gate projection.
        dispatch: `"dropless"`, `"dense"`, or a capacity factor (a positive float).
        grouped: `"dropless"`'s grouped matmul: `"ragged"` (`jax.lax.ragged_dot`),
            `"blocked"` (blocks of one expert's rows, a loop over those in use), or
            `"auto"` (ragged on TPU, blocked elsewhere).

    Returns:
        `sum_j weights[t, j] * expert_{chosen[t, j]}(x[t])` for every token `t`.

    Raises:
        ValueError: an unknown dispatch or grouped matmul, or shapes that disagree.

    Example:
        >>> y = experts(x, chosen, weights, moe.w1, moe.w3, moe.w2)
    """
    _check(x, chosen, weights, w_gate, w_up, w_down, dispatch, grouped)
    if dispatch == "dense" or _active.tracing_dataflow():
        return _dense(x, chosen, weights, w_gate, w_up, w_down, activation)
    if grouped == "auto":
        grouped = "ragged" if _platform() == "tpu" else "blocked"
    active = _active.current()
    mesh = None if active is None else active.mesh
    op = _op(activation, dispatch, grouped, mesh)
    lead = x.shape[:-1]
    rows = (x.reshape(1, -1, x.shape[-1]), chosen.reshape(1, -1, chosen.shape[-1]))
    y = op(*rows, weights.reshape(1, -1, weights.shape[-1]), w_gate, w_up, w_down)
    return y.reshape(*lead, x.shape[-1])


def _check_dispatch(dispatch: Any) -> None:
    """Raise a ValueError unless `dispatch` is one (see `experts`)."""
    if isinstance(dispatch, str):
        if dispatch not in DISPATCHES:
            raise ValueError(
                f"dispatch={dispatch!r}: use one of {', '.join(map(repr, DISPATCHES))} or a "
                "capacity factor (a float > 0, e.g. 1.25)."
            )
    elif not isinstance(dispatch, int | float) or isinstance(dispatch, bool) or dispatch <= 0:
        raise ValueError(f"dispatch={dispatch!r}: a capacity factor is a number > 0, e.g. 1.25.")


def _check(
    x: Any, chosen: Any, weights: Any, w1: Any, w3: Any, w2: Any, dispatch: Any, grouped: Any
) -> None:
    _check_dispatch(dispatch)
    if grouped not in GROUPED:
        raise ValueError(f"grouped={grouped!r}: use one of {', '.join(map(repr, GROUPED))}.")
    n, f, d = w1.shape
    if w3.shape != (n, f, d) or w2.shape != (n, d, f) or x.shape[-1] != d:
        raise ValueError(
            f"experts: w_gate {w1.shape}, w_up {w3.shape} must be (experts, ffn, hidden) and "
            f"w_down {w2.shape} (experts, hidden, ffn), with hidden = x's last axis {x.shape[-1]}."
        )
    if chosen.shape != weights.shape or chosen.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"experts: chosen {chosen.shape} and weights {weights.shape} must both be "
            f"(*tokens, top_k) with the tokens of x {x.shape}."
        )


def _platform() -> str:
    from ._kernels import platform

    return platform()


def _dense(
    x: Array, chosen: Array, weights: Array, w1: Array, w3: Array, w2: Array, act: Callable
) -> Array:
    """Every expert on every token, combined by the weights (zero outside the chosen)."""
    n = w1.shape[0]
    gate = (jax.nn.one_hot(chosen, n, dtype=weights.dtype) * weights[..., None]).sum(-2)
    h = act(jnp.einsum("...d,efd->...ef", x, w1)) * jnp.einsum("...d,efd->...ef", x, w3)
    y = jnp.einsum("...ef,edf->...ed", h, w2)
    return jnp.einsum("...ed,...e->...d", y, gate.astype(y.dtype))


# ---------------------------------------------------------------- one device's part


class _Saved(NamedTuple):
    """What the backward pass reads of the forward's work on one device."""

    slots: Slots
    h1: Array
    h3: Array
    ys: Array


def _local_forward(
    x: Array,
    chosen: Array,
    weights: Array,
    w1: Array,
    w3: Array,
    w2: Array,
    first: Array | int,
    n_experts: int,
    *,
    act: Callable,
    kind: str,
    capacity: float | None,
) -> tuple[Array, _Saved]:
    """This device's experts on the routings that chose them: `(rows, tokens, hidden)`."""
    rows, tokens, d = x.shape
    n = rows * tokens
    k = chosen.shape[-1]
    slots = _grouped.slots(chosen, first, w1.shape[0], n_experts, kind, capacity)
    tok = jnp.where(slots.assign < n * k, slots.assign // k, n)
    xs = jnp.concatenate([x.reshape(n, d), jnp.zeros((1, d), x.dtype)])[tok]
    g = slots.groups
    h1, h3 = g.mm(xs, w1), g.mm(xs, w3)
    ys = g.mm(act(h1) * h3, w2)
    wt = jnp.concatenate([weights.reshape(-1), jnp.zeros((1,), weights.dtype)])[slots.assign]
    contrib = (ys * wt[:, None].astype(ys.dtype)).astype(x.dtype)
    y = jnp.zeros((n + 1, d), x.dtype).at[tok].add(contrib)[:n]
    return y.reshape(rows, tokens, d), _Saved(slots, h1, h3, ys)


def _local_backward(
    x: Array,
    weights: Array,
    w1: Array,
    w3: Array,
    w2: Array,
    saved: _Saved,
    g: Array,
    *,
    act: Callable,
    k: int,
) -> tuple[Array, Array, Array, Array, Array]:
    """The gradients of `_local_forward`'s output: x, weights, w1, w3, w2."""
    rows, tokens, d = x.shape
    n = rows * tokens
    slots, h1, h3, ys = saved
    grp = slots.groups
    tok = jnp.where(slots.assign < n * k, slots.assign // k, n)
    wt = jnp.concatenate([weights.reshape(-1), jnp.zeros((1,), weights.dtype)])[slots.assign]
    gs = jnp.concatenate([g.reshape(n, d), jnp.zeros((1, d), g.dtype)])[tok]
    d_wt = jnp.sum(gs.astype(jnp.float32) * ys.astype(jnp.float32), -1)
    d_weights = jnp.zeros((n * k + 1,), jnp.float32).at[slots.assign].add(d_wt)[: n * k]
    gy = (gs * wt[:, None].astype(gs.dtype)).astype(ys.dtype)
    a, a_vjp = jax.vjp(act, h1)
    h = a * h3
    dh = grp.mm_t(gy, w2)
    dw2 = grp.outer(gy, h, w2.dtype)
    (dh1,) = a_vjp(dh * h3)
    dh3 = dh * a
    xs = jnp.concatenate([x.reshape(n, d), jnp.zeros((1, d), x.dtype)])[tok]
    dw1, dw3 = grp.outer(dh1, xs, w1.dtype), grp.outer(dh3, xs, w3.dtype)
    dxs = grp.mm_t(dh1, w1) + grp.mm_t(dh3, w3)
    dx = jnp.zeros((n + 1, d), jnp.float32).at[tok].add(dxs.astype(jnp.float32))[:n]
    return (
        dx.astype(x.dtype).reshape(x.shape),
        d_weights.astype(weights.dtype).reshape(weights.shape),
        dw1,
        dw3,
        dw2,
    )


# ---------------------------------------------------------------- over the mesh


class _Layout(NamedTuple):
    """How one call splits over the mesh: the rows' axis, the experts' split."""

    rows: str | None
    split: str | None  # "experts", "ffn" or None
    n_model: int


def _layout(mesh: Mesh | None, rows: int, n_experts: int, ffn: int) -> _Layout:
    if mesh is None:
        return _Layout(None, None, 1)
    shape = dict(mesh.shape)
    n_data, n_model = shape.get(_DATA, 1), shape.get(_MODEL, 1)
    row_axis = _DATA if n_data > 1 and rows % n_data == 0 else None
    if n_model > 1 and n_experts % n_model == 0:
        split = "experts"
    elif n_model > 1 and ffn % n_model == 0:
        split = "ffn"
    else:
        split = None
    return _Layout(row_axis, split, n_model)


def _weight_specs(lay: _Layout) -> tuple[P, P, P]:
    if lay.split == "experts":
        return P(_MODEL), P(_MODEL), P(_MODEL)
    if lay.split == "ffn":
        return P(None, _MODEL), P(None, _MODEL), P(None, None, _MODEL)
    return P(), P(), P()


def _first_expert(lay: _Layout, n_local: int) -> Array | int:
    """This device's first expert (inside `shard_map`)."""
    if lay.split == "experts":
        return jax.lax.axis_index(_MODEL) * n_local
    return 0


def _forward_on(
    mesh: Mesh | None, forward: Callable, treedefs: dict, *args: Array
) -> tuple[Array, Any]:
    """`forward` of rows on every device of `mesh`: the output summed over the experts'
    devices, and what each device saved (stacked over the devices)."""
    x, w1 = args[0], args[3]
    n_experts = w1.shape[0]
    if mesh is None:
        return forward(*args, 0, n_experts)
    lay = _layout(mesh, x.shape[0], n_experts, w1.shape[1])

    def body(x: Array, chosen: Array, weights: Array, w1: Array, w3: Array, w2: Array) -> Any:
        first = _first_expert(lay, w1.shape[0])
        y, saved = forward(x, chosen, weights, w1, w3, w2, first, n_experts)
        if lay.split is not None:
            y = jax.lax.psum(y, _MODEL)
        leaves, treedef = jax.tree.flatten(saved)
        treedefs[_signature(leaves)] = treedef
        return y, [leaf[None] for leaf in leaves]

    rows, every = P(lay.rows), P(tuple(mesh.axis_names))
    y, leaves = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows, rows, rows, *_weight_specs(lay)),
        out_specs=(rows, every),
        check_vma=False,
    )(*args)
    return y, _PerDevice(leaves)


def _backward_on(
    mesh: Mesh | None, act: Callable, treedefs: dict, res: Any, g: Array
) -> tuple[Array, ...]:
    """The gradients of `_forward_on`'s output: the inputs' summed over the experts'
    devices, the weights' over the rows' devices."""
    x, chosen, weights, w1, w3, w2, saved = res
    k = chosen.shape[-1]
    if mesh is None:
        return _local_backward(x, weights, w1, w3, w2, saved, g, act=act, k=k)
    lay = _layout(mesh, x.shape[0], w1.shape[0], w1.shape[1])

    def body(
        x: Array, weights: Array, w1: Array, w3: Array, w2: Array, leaves: Any, g: Array
    ) -> Any:
        leaves = [leaf[0] for leaf in leaves]
        local = jax.tree.unflatten(treedefs[_signature(leaves)], leaves)
        dx, dwt, dw1, dw3, dw2 = _local_backward(x, weights, w1, w3, w2, local, g, act=act, k=k)
        if lay.split is not None:
            dx, dwt = jax.lax.psum((dx, dwt), _MODEL)
        if lay.rows is not None:
            dw1, dw3, dw2 = jax.lax.psum((dw1, dw3, dw2), _DATA)
        return dx, dwt, dw1, dw3, dw2

    rows, every = P(lay.rows), P(tuple(mesh.axis_names))
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows, rows, *_weight_specs(lay), every, rows),
        out_specs=(rows, rows, *_weight_specs(lay)),
        check_vma=False,
    )(x, weights, w1, w3, w2, saved.leaves, g)


@functools.cache
def _op(act: Callable, dispatch: Dispatch, kind: str, mesh: Mesh | None) -> Any:
    """The dispatch of rows `(rows, tokens, ...)`, with its VJP and a vmap rule; one per
    static configuration. What each device saved is found again, in the backward pass,
    by the shapes of its arrays (`treedefs`)."""
    capacity = None if isinstance(dispatch, str) else float(dispatch)
    forward = functools.partial(_local_forward, act=act, kind=kind, capacity=capacity)
    treedefs: dict[Any, Any] = {}
    saving = functools.partial(_forward_on, mesh, forward, treedefs)
    forward_rows = _with_rows(lambda *a: saving(*a)[0], residuals=False)
    forward_saving = _with_rows(saving, residuals=True)
    backward_rows = _with_rows(functools.partial(_backward_on, mesh, act, treedefs), None)

    @jax.custom_vjp
    def op(x: Array, chosen: Array, weights: Array, w1: Array, w3: Array, w2: Array) -> Array:
        return forward_rows(x, chosen, weights, w1, w3, w2)

    def op_fwd(x: Array, chosen: Array, weights: Array, w1: Array, w3: Array, w2: Array) -> Any:
        y, saved = forward_saving(x, chosen, weights, w1, w3, w2)
        return y, (x, chosen, weights, w1, w3, w2, saved)

    def op_bwd(res: Any, g: Array) -> Any:
        dx, dwt, dw1, dw3, dw2 = backward_rows(res, g)
        return dx, None, dwt, dw1, dw3, dw2

    op.defvjp(op_fwd, op_bwd)
    return op


class _PerDevice(NamedTuple):
    """Each device's saved arrays, stacked on a leading axis of devices."""

    leaves: list[Array]


def _signature(leaves: list[Array]) -> tuple[Any, ...]:
    return tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


def _with_rows(fn: Callable[..., Any], residuals: bool | None) -> Callable[..., Any]:
    """`fn` over arrays with a leading axis of rows, whose `jax.vmap` folds the vmapped
    axis into the rows (so that a batch's rows are dispatched together).

    `residuals`: False, `fn` returns rows; True, `(rows, saved)` with `saved` kept as
    it is (it is read by the backward pass, whose own rule folds the same way);
    None, `fn(res, g)` is the backward pass, returning rows of every input's gradient
    but the weights', which are whole."""

    @jax.custom_batching.custom_vmap
    def run(*args: Any) -> Any:
        return fn(*args)

    @run.def_vmap
    def rule(axis_size: int, in_batched: list[Any], *args: Any) -> tuple[Any, Any]:
        def fold(x: Any, batched: Any) -> Any:
            if not batched:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            return x.reshape(axis_size * x.shape[1], *x.shape[2:])

        def unfold(y: Array) -> Array:
            return y.reshape(axis_size, -1, *y.shape[1:])

        if residuals is None:
            res, g = args
            x, chosen, weights, w1, w3, w2, saved = res
            res_b, g_b = in_batched
            xb, cb, wb, w1b, w3b, w2b, _ = res_b
            if any(jax.tree.leaves((w1b, w3b, w2b))):
                raise NotImplementedError(_BATCHED_WEIGHTS)
            flat = [fold(v, b) for v, b in ((x, xb), (chosen, cb), (weights, wb))]
            out = _with_rows(fn, None)((*flat, w1, w3, w2, saved), fold(g, g_b))
            dx, dwt, dw1, dw3, dw2 = out
            return (unfold(dx), unfold(dwt), dw1, dw3, dw2), (True, True, False, False, False)
        if any(in_batched[3:]):
            raise NotImplementedError(_BATCHED_WEIGHTS)
        flat = [fold(v, b) for v, b in zip(args[:3], in_batched[:3], strict=True)]
        out = _with_rows(fn, residuals)(*flat, *args[3:])
        if residuals:
            y, saved = out
            return (unfold(y), saved), (True, jax.tree.map(lambda _: False, saved))
        return unfold(out), True

    return run


_BATCHED_WEIGHTS = (
    "rc.nn.experts under jax.vmap over the expert weights themselves (a batch of "
    "mixtures): vmap the tokens only, or use dispatch='dense'."
)
