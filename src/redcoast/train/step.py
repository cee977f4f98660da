"""The train step: the user's `loss_fn` and an optimizer composed into a pure, jitted function.

A step sees the *global* batch. Under `jax.jit` with `Auto` mesh axes the batch is
sharded `P("data")`, the parameters by their specs, and XLA's partitioner inserts
the collectives. Random bits drawn from the step key for the global batch shape
do not depend on how the batch is split over devices (JAX's partitionable
threefry), so one device, 8x1 and 2x4 meshes see the same dropout masks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray

from .._checks import check_positive
from .._progress import counted
from ..parallel._parallelism import (
    ContextOption,
    Parallelism,
    SequenceOption,
    check_options,
    with_parallelism,
)
from ..parallel.mesh import DATA, mesh_shape
from ..parallel.place import replicate_strays
from .precision import check_param_dtypes, check_precision, for_compute
from .trainable import Trainable, frozen_mask, trainable_mask

LossFn = Callable[[Any, Any, PRNGKeyArray], Any]
"""`(model, batch, key) -> loss` or `(loss, dict_of_scalars)`."""
PredFn = Callable[[Any, Any, PRNGKeyArray], Any]
"""`(model, batch, key) -> pytree of arrays with the batch on the leading axis`."""
TrainStepFn = Callable[[Any, Any, Any, PRNGKeyArray], tuple[Any, Any, dict[str, Array]]]
"""`(model, opt_state, batch, key) -> (model, opt_state, metrics)`."""

# Names the step, the evaluation and fit's log records write themselves; an aux
# scalar under one of them would overwrite it (a `step` aux made every record step 1).
_RESERVED = (
    "loss",
    "grad_norm",
    "lr",
    "skipped",
    "nonfinite",
    "weight",
    "step",
    "epoch",
    "steps_per_s",
    "examples_per_s",
    "step_s",
    "tokens_per_s",
    "mfu",
    "_step_tokens",
)
_T = TypeVar("_T")


def describe_shapes(tree: Any) -> str:
    """A compact description of a batch for error messages: `{'x': (8, 64), 'y': (8,)}`."""
    if isinstance(tree, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe_shapes(v)}" for k, v in tree.items()) + "}"
    if hasattr(tree, "shape"):
        return str(tuple(tree.shape))
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return "{" + ", ".join(f"{jax.tree_util.keystr(p)}: {np.shape(x)}" for p, x in leaves) + "}"


def batch_size(batch: Any, *, what: str = "batch") -> int:
    """The common leading-axis length of every array in `batch`.

    Args:
        batch: a pytree of arrays (normally the `dict` that `collate_fn` returns).
        what: how to name the batch in error messages.

    Returns:
        The batch size.

    Raises:
        ValueError: if the batch has no arrays, an array is a scalar, or the leading
            axes differ ("ragged").

    Example:
        >>> batch_size({"x": np.zeros((8, 3)), "y": np.zeros(8)})
        8
    """
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise ValueError(f"{what} holds no arrays: {batch!r}.")
    sizes = {np.shape(x)[0] if np.ndim(x) else -1 for x in leaves}
    if -1 in sizes or len(sizes) != 1:
        raise ValueError(
            f"{what} must hold arrays that share one leading (batch) axis; got shapes "
            f"{describe_shapes(batch)}."
        )
    return int(sizes.pop())


def split_loss(out: Any, batch: Any, name: str = "loss_fn") -> tuple[Array, dict[str, Array]]:
    """Check `loss_fn`'s return value and normalise it to `(float32 scalar, {name: scalar})`."""
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], Mapping):
            raise TypeError(
                f"{name} must return a scalar loss or a pair (loss, dict_of_scalars); it "
                f"returned a tuple of {len(out)} for a batch {describe_shapes(batch)}."
            )
        loss, aux = out
    else:
        loss, aux = out, {}
    if (
        not hasattr(loss, "shape")
        or loss.shape != ()
        or not jnp.issubdtype(loss.dtype, jnp.floating)
    ):
        got = (
            f"shape {tuple(loss.shape)} {loss.dtype}"
            if hasattr(loss, "shape")
            else type(loss).__name__
        )
        raise ValueError(
            f"{name} must return a scalar floating-point loss (reduce over the batch, e.g. "
            f".mean()); it returned {got} for a batch {describe_shapes(batch)}."
        )
    clean = {}
    for k, v in aux.items():
        if k in _RESERVED:
            raise ValueError(
                f"{name}'s aux dict uses the reserved name {k!r}, which the training loop "
                f"writes itself; rename it. Reserved: {', '.join(_RESERVED)}."
            )
        if jnp.shape(v) != ():
            raise ValueError(
                f"{name}'s aux dict must hold scalars; {k!r} has shape {tuple(jnp.shape(v))} "
                f"for a batch {describe_shapes(batch)}."
            )
        clean[str(k)] = jnp.asarray(v, jnp.float32)
    return loss.astype(jnp.float32), clean


def _micro_batches(batch: Any, n: int, mesh: Mesh | None) -> Any:
    """Split the leading axis into `n` micro-batches, strided so no data moves between devices.

    Row `j * n + i` goes to micro-batch `i`. Each data shard holds a contiguous block
    of rows, hence an equal share of every micro-batch; a contiguous split would put
    whole micro-batches on single devices and force an all-to-all.
    """
    size = batch_size(batch)
    n_data = 1 if mesh is None else mesh_shape(mesh)[0]
    if size % n or (size // n) % n_data:
        raise ValueError(
            f"a batch of {size} rows cannot be split into accumulate_grad_batches={n} "
            f"micro-batches over {counted(n_data, 'data shard')}: the batch size must be a "
            f"multiple of {n * n_data}; got a batch {describe_shapes(batch)}."
        )

    def split(x: Array) -> Array:
        y = x.reshape(size // n, n, *x.shape[1:]).swapaxes(0, 1)
        if mesh is not None:
            y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, DATA)))
        return y

    return jax.tree.map(split, batch)


def _learning_rate(
    new_state: Any, old_state: Any, schedule: Callable[[Any], Any] | None
) -> Array | None:
    """The learning rate this update used, or None when it cannot be known."""
    if schedule is not None:
        counts = [v for _, v in optax.tree_utils.tree_get_all_with_path(old_state, "count")]
        if not counts:
            raise ValueError(
                "schedule= needs the optimizer's step count, but the optimizer state has no "
                "'count' field; wrap the optimizer with optax.inject_hyperparams instead."
            )
        return jnp.asarray(schedule(counts[0]), jnp.float32)
    # inject_hyperparams stores the value it evaluated for this update in the new state.
    found = [
        v
        for _, v in optax.tree_utils.tree_get_all_with_path(new_state, "learning_rate")
        if eqx.is_array(v) and jnp.shape(v) == ()
    ]
    return jnp.asarray(found[0], jnp.float32) if len(found) == 1 else None


def _all_finite(loss: Array, grad_norm: Array, params: Any) -> Array:
    """Whether the loss, the gradient norm and every updated parameter are finite.

    The parameters are checked as well because a finite gradient can still give a
    non-finite update (an optimizer dividing by a vanishing second moment).
    """
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    for p in jax.tree_util.tree_leaves(params):
        ok = ok & jnp.isfinite(p).all()
    return ok


def _accumulated(
    grad_fn: Callable[..., Any],
    params: Any,
    micro: Any,
    key: Any,
    n_micro: int,
    axis_name: str | None,
) -> Any:
    """The mean of `grad_fn`'s `((loss, aux), grads)` over `n_micro` micro-batches, by `lax.scan`.

    Micro-batch `i` draws with `fold_in(key, i)`.
    """

    def body(acc: Any, xs: tuple[Array, Any]) -> tuple[Any, None]:
        i, b = xs
        out = grad_fn(params, b, jax.random.fold_in(key, i))
        return jax.tree.map(jnp.add, acc, out), None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, first, key)
    )
    if axis_name is not None:
        # The scan carry must have the vma type of the per-shard gradients.
        zeros = jax.tree.map(lambda z: jax.lax.pcast(z, axis_name, to="varying"), zeros)
    total = jax.lax.scan(body, zeros, (jnp.arange(n_micro), micro))[0]
    return jax.tree.map(lambda x: x / n_micro, total)


def _train_core(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    accumulate_grad_batches: int,
    mesh: Mesh | None,
    schedule: Callable[[Any], Any] | None,
    skip_nonfinite: bool,
    axis_name: str | None,
    precision: str,
    trainable: Trainable,
) -> Callable[..., tuple[Any, Any, dict[str, Array]]]:
    """The un-jitted step; `axis_name` set means "inside shard_map, pmean over it"."""
    n_micro = accumulate_grad_batches

    def step(
        model: Any,
        opt_state: Any,
        batch: Any,
        key: Any,
        parallelism: Parallelism | None = None,
    ) -> tuple[Any, Any, dict[str, Array]]:
        parallelism = parallelism or Parallelism()
        mask = trainable_mask(model, trainable)
        params, rest = eqx.partition(model, mask)
        # Frozen arrays are no argument of the differentiated function: no gradient.
        frozen, static = eqx.partition(rest, frozen_mask(model, mask))
        check_param_dtypes(params, precision, where="train_step")
        # Cast outside the gradient; frozen arrays may be stored in a lower precision.
        frozen_compute = for_compute(frozen, precision)
        if axis_name is not None:
            # Varying params make jax.grad return this shard's gradient rather than an
            # implicit psum, so the pmean below is the one reduction.
            params = jax.tree.map(lambda p: jax.lax.pcast(p, axis_name, to="varying"), params)

        def objective(p: Any, b: Any, k: Any) -> tuple[Array, dict[str, Array]]:
            # The cast sits inside the differentiated function, so its transpose turns
            # the bfloat16 gradients back into float32 ones for float32 master weights.
            compute = eqx.combine(for_compute(p, precision), frozen_compute, static)
            # Applied here, so gradients keep the model's structure (sequence
            # parallelism wraps projections) and FSDP knows the arrays loss_fn sees.
            with parallelism.applied(compute, b, mesh=mesh) as (compute, b):
                return split_loss(loss_fn(compute, b, k), b)

        grad_fn = jax.value_and_grad(objective, has_aux=True)
        if n_micro == 1:
            batch_size(batch)
            (loss, aux), grads = grad_fn(params, batch, key)
        else:
            # Under context parallelism the data axis splits sequences, not rows.
            rows_split = parallelism.context is None
            micro = _micro_batches(batch, n_micro, mesh if rows_split else None)
            (loss, aux), grads = _accumulated(grad_fn, params, micro, key, n_micro, axis_name)
        if axis_name is not None:
            loss, aux, grads = jax.lax.pmean((loss, aux, grads), axis_name)
            params = eqx.filter(model, mask)
        new_params, new_opt_state, metrics = _update(
            optimizer, params, opt_state, grads, loss, schedule, skip_nonfinite
        )
        metrics.update(aux)
        return eqx.combine(new_params, frozen, static), new_opt_state, metrics

    return step


def _update(
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    grads: Any,
    loss: Array,
    schedule: Callable[[Any], Any] | None,
    skip_nonfinite: bool,
) -> tuple[Any, Any, dict[str, Array]]:
    """The optimizer's update of `params`, kept or skipped, and the step's own metrics."""
    grad_norm = optax.tree.norm(grads).astype(jnp.float32)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    metrics = {"loss": loss, "grad_norm": grad_norm}
    lr = _learning_rate(new_opt_state, opt_state, schedule)
    if lr is not None:
        metrics["lr"] = lr
    ok = _all_finite(loss, grad_norm, new_params)
    metrics["nonfinite"] = 1.0 - ok.astype(jnp.float32)
    if skip_nonfinite:

        def keep(new: Any, old: Any) -> Any:
            return jnp.where(ok, new, old) if eqx.is_array(new) else new

        new_params = jax.tree.map(keep, new_params, params)
        new_opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        metrics["skipped"] = metrics["nonfinite"]
    return new_params, new_opt_state, metrics


def _repeated(core: Callable[..., Any], updates: int) -> Callable[..., Any]:
    """`core` applied `updates` times to the same batch, one update after another in a
    `lax.scan` (update `i` draws with `fold_in(key, i)`); the metrics are their means."""
    if updates == 1:
        return core

    def step(
        model: Any,
        opt_state: Any,
        batch: Any,
        key: Any,
        parallelism: Parallelism | None = None,
    ) -> tuple[Any, Any, dict[str, Array]]:
        arrays, static = eqx.partition((model, opt_state), eqx.is_array)

        def body(carry: Any, i: Array) -> tuple[Any, dict[str, Array]]:
            m, o = eqx.combine(carry, static)
            m, o, metrics = core(m, o, batch, jax.random.fold_in(key, i), parallelism)
            return eqx.filter((m, o), eqx.is_array), metrics

        arrays, metrics = jax.lax.scan(body, arrays, jnp.arange(updates))
        new_model, new_opt_state = eqx.combine(arrays, static)
        return new_model, new_opt_state, jax.tree.map(lambda x: x.mean(0), metrics)

    return step


def _shard_map_step(core: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """Run `core` per data shard under `jax.shard_map`, parameters replicated."""
    n_data, n_model = mesh_shape(mesh)
    if n_model != 1:
        raise ValueError(
            f"data_parallel='shard_map' replicates the model, so it needs a mesh with one "
            f"model shard; this mesh is {n_data}x{n_model}. Use data_parallel='jit'."
        )

    def step(
        model: Any,
        opt_state: Any,
        batch: Any,
        key: Any,
        parallelism: Parallelism | None = None,
    ) -> tuple[Any, Any, dict[str, Array]]:
        dynamic, static = eqx.partition((model, opt_state), eqx.is_array)

        def local(dyn: Any, b: Any, k: Any) -> tuple[Any, dict[str, Array]]:
            m, o = eqx.combine(dyn, static)
            # Each shard draws from its own stream; see train_step's note on randomness.
            k = jax.random.fold_in(k, jax.lax.axis_index(DATA))
            m, o, metrics = core(m, o, b, k, parallelism)
            return eqx.filter((m, o), eqx.is_array), metrics

        out_dyn, metrics = jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P(DATA), P()), out_specs=(P(), P())
        )(dynamic, batch, key)
        new_model, new_opt_state = eqx.combine(out_dyn, static)
        return new_model, new_opt_state, metrics

    return step


def _on_one_device(x: Any) -> bool:
    return isinstance(getattr(x, "sharding", None), SingleDeviceSharding)


def donating_jit(fn: Callable[..., _T]) -> Callable[..., _T]:
    """`eqx.filter_jit` of `fn(model, opt_state, ...)` donating the model and optimizer state.

    `filter_jit` donates either everything or everything but the first argument, so
    the non-donated arguments (positional and keyword) travel first, packed into a
    tuple. The returned
    function's `lower(model, opt_state, *rest)` gives the program a call with those
    arguments runs, as `eqx.filter_jit(...).lower` does (`.compile().compiled` is its
    `jax.stages.Compiled`: `memory_analysis()`, `as_text()`).
    """

    @eqx.filter_jit(donate="all-except-first")
    def jitted(rest: tuple[tuple[Any, ...], dict[str, Any]], model: Any, opt_state: Any) -> _T:
        return fn(model, opt_state, *rest[0], **rest[1])

    def run(how: Callable[..., Any], model: Any, opt_state: Any, rest: Any) -> Any:
        placed = (getattr(x, "sharding", None) for x in jax.tree.leaves(model))
        mesh = next((s.mesh for s in placed if isinstance(s, NamedSharding)), None)
        # optax makes its counters on the default device and the step returns them
        # replicated over the mesh; placed there first, the second call finds the
        # first call's program instead of compiling another.
        if isinstance(mesh, Mesh) and any(map(_on_one_device, jax.tree.leaves(opt_state))):
            opt_state = replicate_strays(opt_state, mesh)
        return how(rest, model, opt_state)

    @functools.wraps(fn)
    def call(model: Any, opt_state: Any, *rest: Any, **options: Any) -> _T:
        return run(jitted, model, opt_state, (rest, options))

    def lower(model: Any, opt_state: Any, *rest: Any, **options: Any) -> Any:
        return run(cast(Any, jitted).lower, model, opt_state, (rest, options))

    cast(Any, call).lower = lower
    return call


def _check_options(
    accumulate_grad_batches: Any,
    updates_per_batch: Any,
    data_parallel: str,
    mesh: Mesh | None,
    sequence_parallel: Any,
    context_parallel: Any,
) -> None:
    """`train_step`'s options, each wrong one an error naming it and what would work."""
    if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int):
        raise TypeError(
            f"accumulate_grad_batches must be an int, got {type(accumulate_grad_batches).__name__}."
        )
    if accumulate_grad_batches < 1:
        raise ValueError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}.")
    check_positive("updates_per_batch", updates_per_batch, optional=False)
    if data_parallel not in ("jit", "shard_map"):
        raise ValueError(f"data_parallel must be 'jit' or 'shard_map', got {data_parallel!r}.")
    if data_parallel == "shard_map" and mesh is None:
        raise ValueError("data_parallel='shard_map' needs mesh=make_mesh(1).")
    check_options(sequence_parallel, context_parallel)
    if data_parallel == "shard_map" and sequence_parallel is not False:
        raise ValueError(
            "data_parallel='shard_map' replicates the model, so there is no model axis to "
            "split the activations over: use data_parallel='jit' with sequence_parallel."
        )
    if data_parallel == "shard_map" and context_parallel:
        raise ValueError(
            "data_parallel='shard_map' splits the rows of the batch over the data axis by "
            "hand, so it cannot split the sequences too: use data_parallel='jit' with "
            "context_parallel."
        )


def train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    accumulate_grad_batches: int = 1,
    updates_per_batch: int = 1,
    mesh: Mesh | None = None,
    data_parallel: Literal["jit", "shard_map"] = "jit",
    schedule: Callable[[Any], Any] | None = None,
    skip_nonfinite: bool = False,
    precision: str = "fp32",
    trainable: Trainable = None,
    sequence_parallel: SequenceOption = False,
    context_parallel: ContextOption = False,
    parallelism: Parallelism | None = None,
    jit: bool = True,
) -> TrainStepFn:
    """Compose `loss_fn` and an optax optimizer into one training step.

    The step is pure: `(model, opt_state, batch, key) -> (model, opt_state, metrics)`,
    where `opt_state = optimizer.init(eqx.filter(model, rc.trainable_mask(model, trainable)))`
    (every floating array when `trainable` is None) and `batch` is the *global* batch.
    With `accumulate_grad_batches = n` the batch's leading axis is split into `n`
    micro-batches (row `j * n + i` into micro-batch `i`, so each device keeps its own
    rows) and their gradients are averaged inside one `lax.scan`; the optimizer, and
    its schedule, then count optimizer steps.

    Randomness: `loss_fn` receives `key` itself (or `fold_in(key, i)` for micro-batch
    `i`), and under `data_parallel="jit"` random bits it draws for the global batch
    are the same on every mesh layout. Under `"shard_map"` each data shard sees its
    own rows and `fold_in(key, shard_index)`: numbers equal the jit path exactly
    when `loss_fn` draws no random bits, and are equal in distribution otherwise.

    Args:
        loss_fn: `(model, batch, key) -> loss` or `(loss, dict_of_scalars)`; the loss is
            a floating-point scalar, the mean over the batch.
        optimizer: any `optax.GradientTransformation`. Wrap it in
            `optax.inject_hyperparams` to see the learning rate in the metrics.
        accumulate_grad_batches: number of micro-batches per optimizer step.
        updates_per_batch: optimizer steps taken on each batch, one after another
            (PPO's epochs, GRPO's `num_iterations`), in a `lax.scan` inside the one
            program; update `i` draws with `fold_in(key, i)`, and the metrics are the
            means over the updates.
        mesh: the `("data", "model")` mesh. Under `"jit"` it pins each micro-batch to
            `P(None, "data")`; under `"shard_map"` it is required.
        data_parallel: `"jit"` (XLA partitions the global step; any mesh) or
            `"shard_map"` (explicit per-device step and `pmean` of the gradients over
            `"data"`; the model is replicated, so the mesh needs one model shard).
        schedule: `count -> learning rate`, evaluated at the optimizer's step count to
            report `lr` when the optimizer does not expose it.
        skip_nonfinite: when the loss, the gradient norm or an updated parameter is
            not finite, keep the old model and optimizer state and report
            `skipped = 1`.
        precision: `"fp32"`; `"bf16"` (float32 master parameters and optimizer
            state, `loss_fn` sees the model cast to bfloat16, float32 gradients); or
            `"pure-bf16"` (parameters, optimizer state and compute in bfloat16; cast
            the model with `rc.cast(model, jnp.bfloat16)` before `optimizer.init`).
            See `redcoast.precision`.
        trainable: which arrays train (`rc.trainable_mask`): `None` for every
            floating-point array; a pytree of bools, a predicate on leaves, or path
            globs (`"*.q_proj.*"`). Only those get gradients, optimizer state and
            updates; the frozen ones are returned as they came, and may be stored in
            another precision (e.g. bfloat16 under `"fp32"`) -- the precision policy
            checks only trainable arrays.
        sequence_parallel: split the activations between tensor-parallel regions
            over the model axis too (`rc.SequenceParallel`), where the model's
            placement says, read at each call: `True`, `"keep gathered"` (keep each
            gathered input for the backward pass instead of gathering it again), or
            an `rc.SequenceParallel`. Numbers are unchanged.
        context_parallel: split every sequence of the batch over a mesh axis: `True`
            (the data axis of `mesh`, or of the model's, which then splits sequences
            instead of rows) or an `rc.ContextParallel`; the model's attention
            (`rc.nn.attention`) runs over the split. Numbers are unchanged.
        parallelism: instead of the two options, the `rc.Parallelism` read once from
            the placed model: under your own `jax.jit` of a `jit=False` step, where
            the traced arrays have no placement to read (FSDP's gathers included).
        jit: wrap the step in `eqx.filter_jit`, donating the model and optimizer
            state (pass fresh ones each call). With `jit=False` the plain function
            is returned, to compose into your own transformations.

    Returns:
        The step function. `metrics` holds float32 scalars: `loss` and `grad_norm`
        (averaged over micro-batches), `lr` when known, `nonfinite` (1 when the
        loss, the gradient norm or an updated parameter is not finite, else 0),
        `skipped` with `skip_nonfinite`, and the aux scalars `loss_fn` returned.

    Example:
        >>> step = train_step(loss_fn, optax.adamw(1e-3), accumulate_grad_batches=4)
        >>> opt_state = optax.adamw(1e-3).init(eqx.filter(model, eqx.is_inexact_array))
        >>> for i, batch in enumerate(batches):
        ...     key = jax.random.fold_in(jax.random.key(0), i)
        ...     model, opt_state, metrics = step(model, opt_state, batch, key)
    """
    _check_options(
        accumulate_grad_batches,
        updates_per_batch,
        data_parallel,
        mesh,
        sequence_parallel,
        context_parallel,
    )
    check_precision(precision)
    core = _train_core(
        loss_fn,
        optimizer,
        accumulate_grad_batches=accumulate_grad_batches,
        mesh=mesh if data_parallel == "jit" else None,
        schedule=schedule,
        skip_nonfinite=skip_nonfinite,
        axis_name=DATA if data_parallel == "shard_map" else None,
        precision=precision,
        trainable=trainable,
    )
    if data_parallel == "shard_map":
        assert mesh is not None
        core = _shard_map_step(core, mesh)
    core = _repeated(core, updates_per_batch)
    return with_parallelism(
        donating_jit(core) if jit else core,
        sequence_parallel=sequence_parallel,
        context_parallel=context_parallel,
        mesh=mesh,
        given=parallelism,
    )
