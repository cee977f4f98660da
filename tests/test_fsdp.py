"""Models that do not fit one device: FSDP from the plan, sharded initialisation.

FSDP (`fsdp=` on the plan) adds the data axis to every weight; these tests check
that the step it gives equals the unsharded step, that the parameters and the
optimizer state really are divided by every device, that a model built by
`sharded_init` holds only its shards and equals the model built whole, and that
checkpoints move between FSDP and tensor-parallel layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import hlo
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc

IDS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (8, 16)), jnp.int32)
LLAMA = rc.models.LlamaConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
GPT2 = rc.models.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4)


def make(arch: str, scan_layers: bool) -> Callable[[jax.Array], rc.models.AbstractCausalLM]:
    if arch == "llama":
        return lambda k: rc.models.Llama(LLAMA, scan_layers=scan_layers, key=k)
    return lambda k: rc.models.GPT2(GPT2, scan_layers=scan_layers, key=k)


def loss_fn(model: rc.models.AbstractCausalLM, batch: dict, key: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


def arrays(tree: object) -> list[jax.Array]:
    return jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))


def specs_of(tree: object) -> list[P]:
    return [x.sharding.spec for x in arrays(tree)]


def local_bytes(tree: object) -> int:
    """Bytes of `tree` that device 0 holds."""
    return sum(x.addressable_shards[0].data.nbytes for x in arrays(tree))


def run_steps(
    model: object,
    mesh: object | None,
    n: int = 3,
    optimizer: optax.GradientTransformation | None = None,
    opt_state: object | None = None,
) -> tuple[object, object, list]:
    optimizer = optax.adamw(1e-2) if optimizer is None else optimizer
    # The step as fit runs it: jitted, donating.
    step = rc.train_step(loss_fn, optimizer, mesh=mesh)
    if opt_state is None:
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    state = opt_state
    batch = {"ids": IDS}
    if mesh is not None:
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    losses = []
    for i in range(n):
        model, state, metrics = step(model, state, batch, jax.random.key(i))
        losses.append(float(metrics["loss"]))
    return model, state, losses


@pytest.mark.parametrize(
    ("arch", "n_model", "scan_layers"),
    [
        pytest.param("llama", 1, True, marks=pytest.mark.slow),
        ("llama", 2, True),
        pytest.param("gpt2", 1, False, marks=pytest.mark.slow),
        pytest.param("gpt2", 4, False, marks=pytest.mark.slow),
    ],
    ids=["fsdp-llama-scan", "tp2xfsdp-llama-scan", "fsdp-gpt2", "tp4xfsdp-gpt2"],
)
def test_fsdp_train_steps_equal_the_unsharded_steps(
    arch: str, n_model: int, scan_layers: bool
) -> None:
    mesh = rc.make_mesh(n_model)
    n_data = 8 // n_model
    whole = make(arch, scan_layers)(jax.random.key(0))
    placed = rc.place(
        make(arch, scan_layers)(jax.random.key(0)),
        mesh,
        example_call=lambda m: loss_fn(m, {"ids": IDS}, jax.random.key(0)),
        fsdp=True,
    )
    # Every weight of the model names the data axis (these shapes all divide).
    assert all("data" in str(spec) for spec in specs_of(placed))
    total = sum(x.nbytes for x in arrays(whole))
    assert local_bytes(placed) <= 1.10 * total / 8

    # SGD with momentum: Adam divides by the root of tiny second moments, which
    # turns a rounding difference of a near-zero gradient into a visible one.
    optimizer = optax.sgd(0.5, momentum=0.9)
    layout = specs_of(placed)
    want, _, want_losses = run_steps(whole, None, optimizer=optimizer)
    got, got_state, got_losses = run_steps(placed, mesh, optimizer=optimizer)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for g, w in zip(arrays(got), arrays(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert specs_of(got) == layout  # the step keeps the layout
    # The optimizer's momentum is divided by every device too, not gathered.
    moments = [x for x in arrays(got_state) if x.ndim > 0]
    assert sum(x.addressable_shards[0].data.nbytes for x in moments) <= 1.10 * total / 8
    assert n_data * n_model == 8


def data_all_gathers(compiled_text: str, mesh: object) -> list[hlo.Collective]:
    return [
        c
        for c in hlo.collectives(compiled_text, mesh)
        if c.op == "all-gather" and c.axis in ("data", "both")
    ]


@pytest.mark.slow  # the FSDP steps' equality above is its fast sibling
@pytest.mark.parametrize(
    "scan_layers", [pytest.param(True, id="scan"), pytest.param(False, id="unrolled")]
)
def test_a_step_jitted_by_plain_jax_jit_gathers_as_redcoasts_own_step(scan_layers: bool) -> None:
    """A user's own jax.jit of the plain step, given the Parallelism read from the model."""
    mesh = rc.make_mesh(1)  # 8 data shards: every weight split over the data axis
    batch = jax.device_put({"ids": IDS}, NamedSharding(mesh, P("data")))
    key = jax.random.key(0)
    model = rc.place(
        make("gpt2", scan_layers)(jax.random.key(0)),
        mesh,
        example_call=lambda m: loss_fn(m, batch, key),
        fsdp=True,
    )
    parallelism = rc.Parallelism.of(model)
    assert parallelism.fsdp is not None
    optimizer = optax.sgd(0.5)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    core = rc.train_step(loss_fn, optimizer, mesh=mesh, jit=False, parallelism=parallelism)
    params, static = eqx.partition(model, eqx.is_array)

    def run(p, s, b, k):
        m, s, metrics = core(eqx.combine(p, static), s, b, k)
        return eqx.filter(m, eqx.is_array), s, metrics

    # A user's own jax.jit of the plain step, and the jit redcoast's step wraps it in.
    user = jax.jit(run).lower(params, state, batch, key).compile()
    ours = eqx.filter_jit(core, donate="all-except-first").lower(model, state, batch, key)
    user_found = hlo.collectives(user.as_text(), mesh)
    ours_found = hlo.collectives(ours.compile().compiled.as_text(), mesh)  # equinox wraps it
    assert hlo.summarize(user_found) == hlo.summarize(ours_found)

    # Every all-gather over the data axis rebuilds a weight (one layer's slice of a
    # stacked one): the activations stay split over the data axis.
    whole = [x.shape for x in arrays(model)]
    weights = set(whole) | {shape[1:] for shape in whole}
    gathered = data_all_gathers(user.as_text(), mesh)
    assert gathered
    assert all(c.dims and set(c.dims) <= weights for c in gathered), gathered

    # The same numbers as redcoast's own jitted step (which donates what it is given).
    got_params, _, got = user(params, state, batch, key)
    step = rc.train_step(loss_fn, optimizer, mesh=mesh)
    want_model, _, want = step(model, state, batch, key)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-6)
    for g, w in zip(arrays(got_params), arrays(want_model), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
    # The trained model is laid out as it was, and its structure never changed.
    assert rc.Parallelism.of(want_model).fsdp == parallelism.fsdp
    assert jax.tree.structure(want_model) == jax.tree.structure(model)


SEQ2SEQ = {
    "t5": lambda scan_layers: rc.models.T5(
        rc.models.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
        scan_layers=scan_layers,
        key=jax.random.key(0),
    ),
    "bart": lambda scan_layers: rc.models.BART(
        rc.models.BARTConfig(
            vocab_size=128,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=32,
        ),
        scan_layers=scan_layers,
        key=jax.random.key(0),
    ),
}
SEQ2SEQ_BATCH = {
    "src": IDS[:, :12],
    "mask": jnp.asarray(np.arange(12)[None, :] < np.arange(5, 13)[:, None], jnp.int32),
    "tgt": IDS[:, 8:],
}


def seq2seq_loss(model: rc.models.AbstractSeq2SeqLM, batch: dict, key: jax.Array) -> jax.Array:
    logits = jax.vmap(lambda s, a, t: model(s, t, attention_mask=a))(
        batch["src"], batch["mask"], batch["tgt"][:, :-1]
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt"][:, 1:]).mean()


# In `nox -s slow`; the decoders' FSDP steps above are the fast sibling.
@pytest.mark.parametrize(
    ("arch", "scan_layers"),
    [
        pytest.param("t5", True, marks=pytest.mark.slow),
        pytest.param("bart", True, marks=pytest.mark.slow),
        pytest.param("bart", False, marks=pytest.mark.slow),
    ],
    ids=["t5-scan", "bart-scan", "bart-unrolled"],
)
def test_encoder_decoders_gather_their_embeddings_as_the_decoders_do(
    arch: str, scan_layers: bool
) -> None:
    """T5's and BART's embeddings, position tables, norms and head outside the layer
    stacks are gathered where used: no activation, token id or label crosses the data
    axis, and the step equals the unsharded one."""
    mesh = rc.make_mesh(1)  # 8 data shards: every weight split over the data axis
    batch = jax.device_put(SEQ2SEQ_BATCH, NamedSharding(mesh, P("data")))
    key = jax.random.key(0)
    whole = SEQ2SEQ[arch](scan_layers)
    model = rc.place(
        SEQ2SEQ[arch](scan_layers),
        mesh,
        example_call=lambda m: seq2seq_loss(m, batch, key),
        fsdp=True,
    )
    assert all("data" in str(spec) for spec in specs_of(model))
    optimizer = optax.sgd(0.5, momentum=0.9)
    core = rc.train_step(
        seq2seq_loss, optimizer, mesh=mesh, jit=False, parallelism=rc.Parallelism.of(model)
    )
    params, static = eqx.partition(model, eqx.is_array)

    def run(p, s, b, k):
        m, s, metrics = core(eqx.combine(p, static), s, b, k)
        return eqx.filter(m, eqx.is_array), s, metrics

    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    compiled = jax.jit(run).lower(params, state, batch, key).compile()

    # Every all-gather over the data axis rebuilds a weight (one layer's slice of a
    # stacked one), the token embedding and the position tables among them.
    shapes = [x.shape for x in arrays(model)]
    weights = set(shapes) | {shape[1:] for shape in shapes}
    gathered = data_all_gathers(compiled.as_text(), mesh)
    assert all(c.dims and set(c.dims) <= weights for c in gathered), [
        (c.shape, c.source) for c in gathered if not set(c.dims) <= weights
    ]
    positions = [
        getattr(model, name).weight.shape
        for name in ("encoder_position_bias", "encoder_positions")
        if hasattr(model, name)
    ]
    assert {model.embed_tokens.weight.shape, *positions} <= {d for c in gathered for d in c.dims}

    step = rc.train_step(seq2seq_loss, optimizer)
    want_state = optimizer.init(eqx.filter(whole, eqx.is_inexact_array))
    for i in range(2):
        params, state, got = compiled(params, state, batch, jax.random.key(i))
        whole, want_state, want = step(whole, want_state, SEQ2SEQ_BATCH, jax.random.key(i))
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    for g, w in zip(arrays(params), arrays(whole), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert specs_of(params) == specs_of(model)  # the step keeps the layout


@pytest.mark.slow
def test_a_model_placed_without_redcoast_gathers_nothing() -> None:
    """Weights split over the data axis by jax.device_put alone: XLA's partitioner decides."""
    mesh = rc.make_mesh(1)
    batch = jax.device_put({"ids": IDS}, NamedSharding(mesh, P("data")))
    model = make("gpt2", True)(jax.random.key(0))
    specs = rc.sharding_plan(model, 1, example_call=type(model).trace_call, fsdp=8).specs
    by_hand = eqx.combine(
        jax.device_put(
            eqx.filter(model, eqx.is_array),
            jax.tree.map(lambda s: NamedSharding(mesh, s), specs),
        ),
        eqx.filter(model, eqx.is_array, inverse=True),
    )
    params, static = eqx.partition(by_hand, eqx.is_array)
    text = (
        jax.jit(lambda p, b: loss_fn(eqx.combine(p, static), b, jax.random.key(0)))
        .lower(params, batch)
        .compile()
        .as_text()
    )
    whole = [x.shape for x in arrays(model)]
    weights = set(whole) | {shape[1:] for shape in whole}
    # Activations (the batch's rows) are gathered over the data axis instead.
    assert any(not set(c.dims) <= weights for c in data_all_gathers(text, mesh))


def test_sharded_init_holds_only_shards_and_equals_the_model_built_whole() -> None:
    mesh = rc.make_mesh(2)  # 4 x 2
    build = make("llama", True)
    model = rc.sharded_init(build, jax.random.key(3), mesh, fsdp=True)
    whole = build(jax.random.key(3))
    for got, want in zip(arrays(model), arrays(whole), strict=True):
        shard_shape = got.sharding.shard_shape(got.shape)
        assert all(s.data.shape == shard_shape for s in got.addressable_shards)
        # The same random bits; jit may fuse `std * normal` with one rounding less.
        np.testing.assert_array_max_ulp(np.asarray(got), np.asarray(want), maxulp=2)
    assert local_bytes(model) <= 1.10 * sum(x.nbytes for x in arrays(whole)) / 8
    # The statics (config, activation functions) are the model's own.
    assert model.config == whole.config
    logits = eqx.filter_jit(lambda m: jax.vmap(m)(IDS))
    np.testing.assert_allclose(logits(model), logits(whole), rtol=1e-5, atol=1e-5)


def test_sharded_init_rejects_specs_that_do_not_fit() -> None:
    mesh = rc.make_mesh(2)
    build = make("gpt2", False)
    abstract = eqx.filter_eval_shape(build, jax.random.key(0))
    specs = jax.tree.map(lambda _: P(None, "model"), eqx.filter(abstract, eqx.is_array))
    with pytest.raises(ValueError, match="spec"):
        rc.sharded_init(build, jax.random.key(0), mesh, specs=specs)


@pytest.mark.slow
def test_fit_with_fsdp_matches_fit_without(tmp_path: Path) -> None:
    examples = [{"ids": np.asarray(row)} for row in np.asarray(IDS)] * 4

    def collate(rows: list) -> dict:
        return {"ids": np.stack([r["ids"] for r in rows])}

    results = {}
    for fsdp in (False, True):
        results[fsdp] = rc.fit(
            make("llama", True)(jax.random.key(0)),
            optax.adamw(1e-2),
            examples,
            collate_fn=collate,
            loss_fn=loss_fn,
            mesh=rc.make_mesh(2),
            per_device_batch_size=2,
            max_steps=3,
            fsdp=fsdp,
            progress=False,
            log_every=1,
        )
    losses = {k: [h["loss"] for h in r.history["train"]] for k, r in results.items()}
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    assert all("data" in str(s) for s in specs_of(results[True].model))


@pytest.mark.slow
def test_checkpoints_move_between_fsdp_and_tensor_parallel_layouts(tmp_path: Path) -> None:
    mesh = rc.make_mesh(2)
    build = make("llama", True)
    fsdp_model = rc.sharded_init(build, jax.random.key(5), mesh, fsdp=True)
    optimizer = optax.adamw(1e-2)
    fsdp_model, fsdp_state, _ = run_steps(fsdp_model, mesh, n=1)
    rc.save_checkpoint(tmp_path / "ck", model=fsdp_model, opt_state=fsdp_state, step=1)

    abstract = eqx.filter_eval_shape(build, jax.random.key(0))
    tp_plan = rc.sharding_plan(abstract, 2, example_call=type(abstract).trace_call)
    like = rc.sharded_init(build, jax.random.key(0), mesh, specs=tp_plan)
    state_like = optimizer.init(eqx.filter(like, eqx.is_inexact_array))
    tp = rc.load_checkpoint(
        tmp_path / "ck", like=like, opt_state_like=state_like, mesh=mesh, specs=tp_plan
    )
    assert not any("data" in str(s) for s in specs_of(tp.model))
    for a, b in zip(arrays(tp.model), arrays(fsdp_model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(arrays(tp.opt_state), arrays(fsdp_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # And back: a tensor-parallel checkpoint into the FSDP layout.
    rc.save_checkpoint(tmp_path / "tp", model=tp.model, opt_state=tp.opt_state, step=1)
    fsdp_plan = rc.sharding_plan(abstract, 2, example_call=type(abstract).trace_call, fsdp=4)
    back = rc.load_checkpoint(
        tmp_path / "tp", like=like, opt_state_like=state_like, mesh=mesh, specs=fsdp_plan
    )
    assert all("data" in str(s) for s in specs_of(back.model))
    for a, b in zip(arrays(back.model), arrays(fsdp_model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The layout is read from where the arrays are; the structure is the same in both.
    assert rc.Parallelism.of(tp.model).fsdp is None
    assert rc.Parallelism.of(back.model).fsdp == rc.Parallelism.of(fsdp_model).fsdp
    assert jax.tree.structure(back.model) == jax.tree.structure(tp.model)
    run_steps(back.model, mesh, n=1, optimizer=optimizer, opt_state=back.opt_state)


def test_fsdp_plan_never_splits_the_scanned_layer_axis_and_reports_what_it_cannot_split() -> None:
    abstract = eqx.filter_eval_shape(make("llama", True), jax.random.key(0))
    plan = rc.sharding_plan(abstract, 1, example_call=type(abstract).trace_call, fsdp=8)
    for leaf in plan.leaves:
        if leaf.path.startswith("blocks."):
            assert leaf.spec[0] is None, leaf
    assert plan.bytes_per_device <= 1.10 * plan.total_bytes / 8
    odd = rc.sharding_plan(abstract, 1, example_call=type(abstract).trace_call, fsdp=3)
    assert any("no dimension divides into 3 data shards" in note for note in odd.notes)
    with pytest.raises(ValueError, match="fsdp must be >= 1"):
        rc.sharding_plan(abstract, 1, fsdp=0)


def test_use_spec_keeps_only_what_tensor_parallelism_asked_for() -> None:
    use = rc.fsdp.use_spec
    assert use(P("model", "data")) == P("model", None)
    assert use(P(("model", "data"), None)) == P("model", None)
    # How FSDP divides a weight that tensor parallelism replicates: used whole.
    assert use(P(("data", "model"))) == P(None)
    assert use(P(None, "data")) == P(None, None)


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan"])
def test_fsdp_adds_no_model_axis_traffic_to_tensor_parallelism(scan_layers: bool) -> None:
    """TP x FSDP gathers weights over the data axis only; the activations keep TP's layout."""
    mesh = rc.make_mesh(2)
    batch = jax.device_put({"ids": IDS}, NamedSharding(mesh, P("data")))
    model_bytes = {}
    for fsdp in (False, True):
        model = rc.place(
            make("gpt2", scan_layers)(jax.random.key(0)),
            mesh,
            example_call=lambda m: loss_fn(m, batch, jax.random.key(0)),
            fsdp=fsdp,
        )
        params, static = eqx.partition(model, eqx.is_inexact_array)
        optimizer = optax.adamw(1e-2)
        state = optimizer.init(params)
        step = rc.train_step(loss_fn, optimizer, jit=False, parallelism=rc.Parallelism.of(model))

        def run(p, s, b, k, step=step, static=static):
            m, s, metrics = step(eqx.combine(p, static), s, b, k)
            return eqx.filter(m, eqx.is_inexact_array), s, metrics

        lowered = jax.jit(run).lower(params, state, batch, jax.random.key(0))
        found = hlo.collectives(lowered.compile().as_text(), mesh)
        model_bytes[fsdp] = sum(c.nbytes for c in found if c.axis == "model")
    assert model_bytes[True] <= 1.05 * model_bytes[False], model_bytes
