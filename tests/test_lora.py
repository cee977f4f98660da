"""Training part of a model: the trainable filter, its checkpoints, and LoRA adapters."""

import json
import math
import shutil

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from beartype import beartype
from jaxtyping import Array, Float, PRNGKeyArray, jaxtyped
from tiny import megatron_specs

import redcoast as rc
from redcoast.checkpoint._io import checkpoint_state


class MLP(eqx.Module):
    """A user's own model: three `eqx.nn.Linear` layers, called on one example."""

    inp: eqx.nn.Linear
    hidden: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.inp = eqx.nn.Linear(6, 32, key=k1)
        self.hidden = eqx.nn.Linear(32, 32, key=k2)
        self.out = eqx.nn.Linear(32, 2, key=k3)

    def __call__(self, x: Float[Array, " 6"], *, key: PRNGKeyArray | None = None) -> Array:
        return self.out(jax.nn.gelu(self.hidden(jax.nn.gelu(self.inp(x)))))


def collate_fn(examples):
    return {
        "x": np.stack([e["x"] for e in examples]),
        "y": np.array([e["y"] for e in examples], np.int32),
    }


def loss_fn(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _toy(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    return [{"x": a, "y": int(a[0] * a[1] > 0)} for a in x]


def _fit(model, trainable, **kw):
    kw = {
        "collate_fn": collate_fn,
        "loss_fn": loss_fn,
        "per_device_batch_size": 2,
        "max_steps": 4,
        "progress": False,
        **kw,
    }
    return rc.fit(model, optax.adamw(1e-2, weight_decay=0.1), _toy(64), trainable=trainable, **kw)


def _arrays(tree):
    return eqx.filter(tree, eqx.is_array)


# ----------------------------------------------------------------------------- the filter


@pytest.mark.parametrize(
    ("trainable", "shapes"),
    [
        ("hidden.*", [(32,), (32, 32)]),
        (["hidden.weight", "hidden.bias"], [(32,), (32, 32)]),
        (lambda x: eqx.is_inexact_array(x) and x.shape == (32, 32), [(32, 32)]),
    ],
    ids=["glob", "globs", "predicate"],
)
def test_frozen_leaves_are_bit_identical_and_get_no_optimizer_state(trainable, shapes):
    model = MLP(key=jax.random.key(0))
    result = _fit(model, trainable)
    assert result.step == 4
    for name in ("inp", "out"):
        chex.assert_trees_all_equal(getattr(result.model, name), getattr(model, name))
    assert not np.allclose(result.model.hidden.weight, model.hidden.weight)
    # AdamW's two moments exist for the trainable arrays only.
    moments = [x.shape for x in jax.tree.leaves(result.opt_state) if x.ndim > 0]
    assert sorted(moments) == sorted(shapes * 2)


def test_a_tree_of_bools_trains_what_it_marks():
    model = MLP(key=jax.random.key(0))
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda m: m.out.weight, spec, replace=True)
    result = _fit(model, spec)
    chex.assert_trees_all_equal(result.model.out.bias, model.out.bias)
    chex.assert_trees_all_equal(result.model.hidden, model.hidden)
    assert not np.allclose(result.model.out.weight, model.out.weight)


def test_train_step_with_a_filter_equals_the_full_step_on_the_trainable_part():
    model = MLP(key=jax.random.key(0))
    batch = collate_fn(_toy(16))
    opt = optax.sgd(0.1)
    key = jax.random.key(1)
    mask = rc.trainable_mask(model, "out.*")
    step = rc.train_step(loss_fn, opt, trainable="out.*", jit=False)
    new, _, metrics = step(model, opt.init(eqx.filter(model, mask)), batch, key)
    full = rc.train_step(loss_fn, opt, jit=False)
    whole, _, full_metrics = full(model, opt.init(eqx.filter(model, eqx.is_array)), batch, key)
    chex.assert_trees_all_close(new.out, whole.out, rtol=1e-6)
    chex.assert_trees_all_equal(new.inp, model.inp)
    # The gradient norm counts only the trainable part.
    assert float(metrics["grad_norm"]) < float(full_metrics["grad_norm"])


def test_frozen_leaves_may_be_stored_in_bfloat16():
    model = MLP(key=jax.random.key(0))
    model = eqx.tree_at(lambda m: m.inp, model, replace=rc.cast(model.inp, jnp.bfloat16))
    for precision in ("fp32", "bf16"):
        result = _fit(model, "out.*", precision=precision)
        assert result.model.inp.weight.dtype == jnp.bfloat16
        chex.assert_trees_all_equal(result.model.inp, model.inp)
        assert result.model.out.weight.dtype == jnp.float32


@pytest.mark.parametrize(
    "kw",
    [
        {"fsdp": True},
        {"mesh": rc.make_mesh(2), "per_device_batch_size": 4},
        {"data_parallel": "shard_map"},
        {"donate": True},
    ],
    ids=["fsdp", "tp", "shard_map", "donate"],
)
def test_filter_under_fsdp_tp_shard_map_and_donate_equals_the_plain_run(kw):
    model = MLP(key=jax.random.key(0))
    base = _fit(model, "hidden.*", mesh=rc.make_mesh(1))
    result = _fit(MLP(key=jax.random.key(0)), "hidden.*", **{"mesh": rc.make_mesh(1), **kw})
    chex.assert_trees_all_close(_arrays(result.model), _arrays(base.model), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(result.model.inp, model.inp)


def test_glob_matching_nothing_is_a_clear_error():
    model = MLP(key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"\['\*\.q_proj\.\*'\] match no .*inp\.weight"):
        rc.trainable_mask(model, "*.q_proj.*")
    with pytest.raises(ValueError, match="selects no floating-point array"):
        rc.trainable_mask(model, lambda x: False)
    with pytest.raises(TypeError, match="trainable must be"):
        rc.trainable_mask(model, [1, 2])


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoints_hold_the_trainable_part_and_resume_step_exactly(tmp_path):
    model = MLP(key=jax.random.key(0))
    straight = _fit(model, "hidden.*", max_steps=6)
    _fit(model, "hidden.*", max_steps=3, workdir=tmp_path)
    ckpt = tmp_path / "ckpts" / "step_00000003"
    state = checkpoint_state(ckpt)
    assert sorted(state["checksums"]["model"]) == ["hidden.bias", "hidden.weight"]
    assert state["loop"]["frozen"]["arrays"] == 4
    resumed = _fit(model, "hidden.*", max_steps=6, workdir=tmp_path, resume=True)
    assert resumed.step == 6
    chex.assert_trees_all_equal(_arrays(resumed.model), _arrays(straight.model))
    chex.assert_trees_all_equal(resumed.opt_state, straight.opt_state)


def test_resume_refuses_another_base(tmp_path):
    _fit(MLP(key=jax.random.key(0)), "hidden.*", max_steps=2, workdir=tmp_path)
    other = MLP(key=jax.random.key(1))
    with pytest.raises(ValueError, match="trained on another frozen base"):
        _fit(other, "hidden.*", max_steps=4, workdir=tmp_path, resume=True)
    # The same weights stored in another dtype are another base too.
    base = MLP(key=jax.random.key(0))
    half = eqx.tree_at(lambda m: m.inp, base, replace=rc.cast(base.inp, jnp.bfloat16))
    with pytest.raises(ValueError, match="trained on another frozen base"):
        _fit(half, "hidden.*", max_steps=4, workdir=tmp_path, resume=True)
    with pytest.raises(ValueError, match="holds only the trainable arrays"):
        _fit(base, None, max_steps=4, workdir=tmp_path, resume=True)


# ----------------------------------------------------------------------------- LoRA

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
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (8, 16)), jnp.int32)
TARGETS = {
    "gpt2": ["q_proj", "v_proj", "o_proj", "fc_in", "fc_out"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def _zoo(arch, scan_layers=False, seed=0):
    if arch == "llama":
        return rc.models.Llama(LLAMA, scan_layers=scan_layers, key=jax.random.key(seed))
    return rc.models.GPT2(GPT2, scan_layers=scan_layers, key=jax.random.key(seed))


ADAPTERS = rc.lora.LoRALinear | rc.lora.LoRAEmbedding


def _nonzero_b(model):
    """`model` with every adapter's zero factor random (lora_b; a table's lora_a): a
    fresh adapter is zero and would hide mistakes."""

    def fill(x):
        if isinstance(x, ADAPTERS):
            where = (
                (lambda m: m.lora_b.weight)
                if isinstance(x, rc.lora.LoRALinear)
                else (lambda m: m.lora_a.weight)
            )
            w = where(x)
            return eqx.tree_at(where, x, 0.1 * jax.random.normal(jax.random.key(w.size), w.shape))
        return x

    return jax.tree.map(fill, model, is_leaf=lambda x: isinstance(x, ADAPTERS))


@eqx.filter_jit
def _logits(model, ids=IDS):
    return jax.vmap(model)(ids)


@jaxtyped(typechecker=beartype)
def _factors(
    layer: rc.lora.LoRALinear,
) -> tuple[Float[Array, "rank n_in"], Float[Array, "n_out rank"], Float[Array, "n_out n_in"]]:
    """A LoRA layer's A, B and base weight, their shapes checked against each other."""
    return layer.lora_a.weight, layer.lora_b.weight, layer.base.weight


def test_lora_on_a_users_mlp_equals_its_merged_model():
    model = MLP(key=jax.random.key(0))
    lora = rc.lora.apply(model, ["inp", "hidden"], rank=4, alpha=8, key=jax.random.key(1))
    assert isinstance(lora.inp, rc.lora.LoRALinear) and isinstance(lora.out, eqx.nn.Linear)
    a, b, _ = _factors(lora.inp)
    _factors(lora.hidden)
    assert a.shape == (4, 6) and b.shape == (32, 4) and not b.any()
    assert float(jnp.abs(a).max()) <= 1 / np.sqrt(6)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 6)), jnp.float32)
    # B starts at zero: the wrapped model is the base model.
    chex.assert_trees_all_close(jax.vmap(lora)(x), jax.vmap(model)(x), rtol=1e-6)
    lora = _nonzero_b(lora)
    merged = rc.lora.merge(lora)
    assert isinstance(merged.inp, eqx.nn.Linear)
    chex.assert_trees_all_close(jax.vmap(lora)(x), jax.vmap(merged)(x), rtol=1e-5, atol=1e-6)
    assert not np.allclose(jax.vmap(lora)(x), jax.vmap(model)(x))


@pytest.mark.parametrize(
    ("arch", "scan_layers"),
    [
        ("gpt2", False),
        pytest.param("llama", True, marks=pytest.mark.slow),
        pytest.param("gpt2", True, marks=pytest.mark.slow),
        pytest.param("llama", False, marks=pytest.mark.slow),
    ],
)
def test_lora_on_the_zoo_equals_its_merged_model(arch, scan_layers):
    model = _zoo(arch, scan_layers)
    lora = _nonzero_b(rc.lora.apply(model, TARGETS[arch], rank=4, key=jax.random.key(1)))
    merged = rc.lora.merge(lora)
    chex.assert_trees_all_equal_structs(_arrays(merged), _arrays(model))
    got, want = _logits(lora), _logits(merged)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, _logits(model), atol=1e-3)


@jaxtyped(typechecker=beartype)
def _table_factors(
    table: rc.lora.LoRAEmbedding,
) -> tuple[
    Float[Array, "vocab rank"], Float[Array, "features rank"], Float[Array, "vocab features"]
]:
    """A LoRA table's A, B and base table, their shapes checked against each other."""
    return table.lora_a.weight, table.lora_b.weight, table.base.weight


@pytest.mark.parametrize(
    ("arch", "scan_layers"), [("gpt2", False), pytest.param("llama", True, marks=pytest.mark.slow)]
)
def test_lora_on_the_token_table_equals_its_merged_model(arch, scan_layers):
    """GPT-2's head is tied to the table and sees the update; LLaMA's is its own."""
    model = _zoo(arch, scan_layers)
    lora = rc.lora.apply(model, ["embed_tokens", "q_proj"], rank=4, key=jax.random.key(1))
    a, b, _ = _table_factors(lora.embed_tokens)
    assert a.shape == (128, 4) and b.shape == (32, 4) and not a.any() and b.any()
    # A starts at zero (PEFT's init for tables): the wrapped model is the base model.
    chex.assert_trees_all_close(_logits(lora), _logits(model), rtol=1e-6)
    lora = _nonzero_b(lora)
    merged = rc.lora.merge(lora)
    assert type(merged.embed_tokens) is eqx.nn.Embedding
    chex.assert_trees_all_equal_structs(_arrays(merged), _arrays(model))
    got, want = _logits(lora), _logits(merged)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, _logits(model), atol=1e-3)
    # Only the adapters train: A and B of the table and of each q_proj.
    mask = rc.lora.trainable(lora)
    table_mask = mask.embed_tokens
    assert table_mask.lora_a.weight and table_mask.lora_b.weight and not table_mask.base.weight
    n_q = 1 if scan_layers else len(lora.blocks)
    assert sum(jax.tree.leaves(mask)) == 2 + 2 * n_q
    with pytest.raises(ValueError, match=r"rank=64 is larger than embed_tokens's dimensions"):
        rc.lora.apply(model, "embed_tokens", rank=64, key=jax.random.key(1))


def test_lora_trains_only_the_adapters_of_a_bfloat16_base():
    model = rc.cast(_zoo("llama"), jnp.bfloat16)
    lora = rc.lora.apply(model, ["q_proj", "v_proj"], rank=4, key=jax.random.key(1))
    examples = [{"input_ids": np.asarray(r)} for r in np.asarray(IDS)]
    result = rc.fit(
        lora,
        optax.adamw(1e-2),
        examples,
        collate_fn=lambda ex: {"input_ids": np.stack([e["input_ids"] for e in ex])},
        loss_fn=rc.models.lm_loss,
        per_device_batch_size=1,
        max_steps=3,
        trainable=rc.lora.trainable(lora),
        progress=False,
    )
    frozen = eqx.filter(lora, rc.lora.trainable(lora), inverse=True)
    chex.assert_trees_all_equal(
        _arrays(eqx.filter(result.model, rc.lora.trainable(lora), inverse=True)), _arrays(frozen)
    )
    q = result.model.blocks[0].attn.q_proj
    assert q.base.weight.dtype == jnp.bfloat16 and q.lora_b.weight.dtype == jnp.float32
    assert q.lora_b.weight.any()
    # Two AdamW moments for each adapter, nothing for the base.
    adapters = sum(x.size for x in jax.tree.leaves(eqx.filter(lora, rc.lora.trainable(lora))))
    moments = sum(x.size for x in jax.tree.leaves(result.opt_state) if x.ndim > 0)
    assert moments == 2 * adapters


def test_lora_bad_input():
    model = MLP(key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"\['q_proj'\] match no eqx.nn.Linear.*'inp'"):
        rc.lora.apply(model, ["inp", "q_proj"], key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"rank=8 is larger than out's dimensions \(32 in, 2 out"):
        rc.lora.apply(model, "out", rank=8, key=jax.random.key(0))
    with pytest.raises(ValueError, match="no LoRA layers"):
        rc.lora.trainable(model)
    lora = rc.lora.apply(model, "hidden", dropout=0.1, key=jax.random.key(0))
    with pytest.raises(ValueError, match="called without key="):
        lora.hidden.over_tokens(jnp.ones((3, 32)))
    assert lora.hidden(jnp.ones(32), key=jax.random.key(0)).shape == (32,)
    assert eqx.nn.inference_mode(lora).hidden.over_tokens(jnp.ones((3, 32))).shape == (3, 32)


@pytest.mark.parametrize("alpha", [0, -2.0, math.nan, math.inf, -math.inf, True])
def test_lora_alpha_must_be_a_finite_number_above_zero(alpha):
    # alpha=0 trained nothing without a word; nan or inf showed as a nan loss at step 1.
    model = MLP(key=jax.random.key(0))
    with pytest.raises(ValueError, match=rf"alpha must be a finite number > 0.*got {alpha!r}"):
        rc.lora.apply(model, "hidden", alpha=alpha, key=jax.random.key(0))
    small = rc.lora.apply(model, "hidden", rank=4, alpha=0.5, key=jax.random.key(0))
    assert small.hidden.scale == 0.125


def test_applying_lora_twice_says_the_model_is_already_adapted():
    model = MLP(key=jax.random.key(0))
    lora = rc.lora.apply(model, ["inp", "hidden"], rank=4, key=jax.random.key(1))
    for targets in ("hidden", ["inp", "hidden"], lambda path, linear: linear.out_features == 32):
        with pytest.raises(ValueError, match=r"\['inp', 'hidden'\]|\['hidden'\]") as err:
            rc.lora.apply(lora, targets, key=jax.random.key(2))
        assert "already carry LoRA adapters" in str(err.value)
        assert "rc.lora.merge" in str(err.value) and "match no" not in str(err.value)
    # The layers not adapted yet can still be.
    more = rc.lora.apply(lora, "out", rank=2, key=jax.random.key(2))
    assert isinstance(more.out, rc.lora.LoRALinear) and more.inp is lora.inp
    # And the merged model is a base model again.
    again = rc.lora.apply(rc.lora.merge(lora), "hidden", rank=4, key=jax.random.key(2))
    assert isinstance(again.hidden, rc.lora.LoRALinear)


def _lora_mlp(rank=2, alpha=8, dropout=0.0, targets=("inp", "hidden")):
    model = MLP(key=jax.random.key(0))
    kw = {"rank": rank, "alpha": alpha, "dropout": dropout}
    return rc.lora.apply(model, list(targets), **kw, key=jax.random.key(1))


@pytest.mark.parametrize("partial", [True, False], ids=["trainable", "whole_model"])
def test_resuming_lora_with_another_alpha_rank_dropout_or_targets_is_refused(tmp_path, partial):
    """A LoRA layer's scale is static and its dropout rate a float: neither is in the
    checkpoint's arrays, nor in the frozen base's fingerprint."""

    def run(model, **kw):
        return _fit(model, rc.lora.trainable(model) if partial else None, **kw)

    straight = run(_lora_mlp(), max_steps=4)
    run(_lora_mlp(), max_steps=2, workdir=tmp_path)
    for changed, says in [
        (
            {"alpha": 16},
            r"inp: saved LoRALinear rank 2, alpha 8, dropout 0, now LoRALinear "
            r"rank 2, alpha 16, dropout 0; hidden: saved",
        ),
        (
            {"rank": 1, "alpha": 4},
            r"hidden: saved LoRALinear rank 2, alpha 8, dropout 0, now "
            r"LoRALinear rank 1, alpha 4",
        ),
        ({"dropout": 0.1}, r"alpha 8, dropout 0, now LoRALinear rank 2, alpha 8, dropout 0.1"),
        ({"targets": ("inp",)}, r"adapted when saved, not now: \['hidden'\]"),
        ({"targets": ("inp", "hidden", "out")}, r"adapted now, not when saved: \['out'\]"),
    ]:
        with pytest.raises(ValueError, match=says) as err:
            run(_lora_mlp(**changed), max_steps=4, workdir=tmp_path, resume=True)
        message = str(err.value)
        assert "LoRA adapters are not the ones it was saved with" in message
        assert "rc.lora.apply with the same targets, rank, alpha and dropout" in message
    # What state.json records of them.
    recorded = checkpoint_state(tmp_path / "ckpts" / "step_00000002")["loop"]["lora"]
    assert recorded["layers"]["inp"] == {
        "kind": "LoRALinear",
        "rank": 2,
        "scale": 4.0,
        "dropout": 0.0,
    }
    assert recorded["summary"] == "inp, hidden (LoRALinear rank 2, alpha 8, dropout 0)"
    # A checkpoint from before redcoast recorded the adapters resumes as it did.
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "ckpts", old / "ckpts")
    state_file = old / "ckpts" / "step_00000002" / "state.json"
    state = json.loads(state_file.read_text())
    del state["loop"]["lora"]
    state_file.write_text(json.dumps(state))
    assert run(_lora_mlp(), max_steps=4, workdir=old, resume=True).step == 4
    # The same adapters resume step-exactly.
    resumed = run(_lora_mlp(), max_steps=4, workdir=tmp_path, resume=True)
    assert resumed.step == 4
    chex.assert_trees_all_equal(_arrays(resumed.model), _arrays(straight.model))
    chex.assert_trees_all_equal(resumed.opt_state, straight.opt_state)


def test_resuming_a_run_without_adapters_with_them_is_refused(tmp_path):
    _fit(MLP(key=jax.random.key(0)), None, max_steps=2, workdir=tmp_path)
    assert checkpoint_state(tmp_path / "ckpts" / "step_00000002")["loop"]["lora"] is None
    with pytest.raises(ValueError, match=r"saved with no adapters, now inp, hidden \(LoRALinear"):
        _fit(_lora_mlp(), None, max_steps=4, workdir=tmp_path, resume=True)


# ----------------------------------------------------------------------------- adapters split


def _lora_zoo(arch, scan_layers=False, table=False):
    model = _zoo(arch, scan_layers)
    targets = TARGETS[arch] + ["embed_tokens"] * table
    return rc.lora.apply(model, targets, rank=4, key=jax.random.key(1))


def _trace(model):
    return jax.vmap(model)(IDS)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_adapters_split_with_their_base_and_never_on_the_rank(arch, n):
    plan = rc.sharding_plan(_lora_zoo(arch), n, example_call=_trace)
    specs = {leaf.path: tuple(leaf.spec) for leaf in plan.leaves}
    col, row = ("model", None), (None, "model")
    layers = sorted({p.rsplit(".", 2)[0] for p in specs if ".lora_a." in p})
    assert len(layers) == 2 * len(TARGETS[arch])
    for layer in layers:
        base, a, b = (specs[f"{layer}.{x}.weight"] for x in ("base", "lora_a", "lora_b"))
        name = layer.rsplit(".", 1)[1]
        if name in ("o_proj", "fc_out", "down_proj"):  # row-split base: A on its input
            assert (base, a, b) == (row, row, ()), layer
        elif n == 4 and name in ("k_proj", "v_proj") and arch == "llama":
            # 2 key/value heads do not split 4 ways: the base and its adapter stay whole.
            assert (base, a, b) == ((), (), ()), layer
        else:  # column-split base: B on its output
            assert (base, a, b) == (col, (), col), layer
    # The rest of the model is split as it is without adapters.
    plain = rc.sharding_plan(_zoo(arch), n, example_call=_trace)
    for leaf in plain.leaves:
        wrapped = leaf.path.replace(".weight", ".base.weight").replace(".bias", ".base.bias")
        assert specs.get(leaf.path, specs.get(wrapped)) == tuple(leaf.spec), leaf.path


# GPT-2 on 2 shards and LLaMA on 4 here; the other two in `nox -s slow`.
@pytest.mark.parametrize(
    ("arch", "n"),
    [
        ("gpt2", 2),
        pytest.param("gpt2", 4, marks=pytest.mark.slow),
        pytest.param("llama", 2, marks=pytest.mark.slow),
        ("llama", 4),
    ],
)
def test_lora_layout_is_megatron_lms_with_megatron_style_lora(arch, n):
    # bench_comm's reference: A replicated and B column-split beside a column base,
    # A row-split and B replicated beside a row base, both whole beside a whole base.
    model = _lora_zoo(arch, scan_layers=True)
    ours = rc.sharding_plan(model, n, example_call=_trace).specs
    is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)  # noqa: E731
    assert jax.tree.leaves(ours, is_leaf=is_spec) == jax.tree.leaves(
        megatron_specs(model, n), is_leaf=is_spec
    )


def _step_once(model, mesh, fsdp):
    mask = rc.lora.trainable(model)
    # The step donates what it is given: work on a copy.
    model = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, model)
    if mesh is not None:
        model = rc.place(model, mesh, example_call=_trace, fsdp=fsdp)
    # SGD: Adam's normalisation would blow float rounding up on near-zero gradients.
    opt = optax.sgd(0.5)
    step = rc.train_step(rc.models.lm_loss, opt, mesh=mesh, trainable=mask)
    # The mask was made before the model was placed; trainable_mask fits it to the
    # placed model (which records its FSDP layout), as train_step does.
    opt_state = opt.init(eqx.filter(model, rc.trainable_mask(model, mask)))
    model, _, metrics = step(model, opt_state, {"input_ids": IDS}, jax.random.key(0))
    return model, metrics


# In `nox -s slow`; the filter under FSDP, TP and donation above is the fast sibling.
@pytest.mark.parametrize(
    ("arch", "n_model", "fsdp", "table"),
    [
        pytest.param("llama", 2, False, False, marks=pytest.mark.slow),
        pytest.param("gpt2", 4, True, False, marks=pytest.mark.slow),
        pytest.param("gpt2", 2, False, False, marks=pytest.mark.slow),
        pytest.param("llama", 4, True, False, marks=pytest.mark.slow),
        ("gpt2", 4, False, True),  # the tied token table adapted too
        pytest.param("gpt2", 2, True, True, marks=pytest.mark.slow),
    ],
)
def test_sharded_lora_step_equals_unsharded(arch, n_model, fsdp, table):
    model = _nonzero_b(_lora_zoo(arch, table=table))
    want, want_metrics = _step_once(model, None, False)
    got, metrics = _step_once(model, rc.make_mesh(n_model), fsdp)
    chex.assert_trees_all_close(metrics["loss"], want_metrics["loss"], rtol=1e-5)
    chex.assert_trees_all_close(metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)
    chex.assert_trees_all_close(
        # Leaves: the placed model's static structure records its FSDP layout.
        jax.tree.leaves(eqx.filter(got, rc.trainable_mask(got, rc.lora.trainable(model)))),
        jax.tree.leaves(eqx.filter(want, rc.lora.trainable(model))),
        rtol=1e-5,
        # The table's A sums its gradient over every token: a few entries near zero
        # carry that sum's rounding (2e-6 of entries of order 1).
        atol=1e-5 if table else 1e-6,
    )
    q = got.blocks[0].attn.q_proj
    assert "model" in str(q.lora_b.weight.sharding.spec)
    if fsdp:  # the frozen base is split over the data axis too
        assert "data" in str(q.base.weight.sharding.spec)
    if table and not fsdp:  # A split on the vocabulary as the table is; B whole
        spec = lambda x: tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))  # noqa: E731
        assert spec(got.embed_tokens.lora_a.weight)[0] == spec(got.embed_tokens.base.weight)[0]
        assert "model" in str(spec(got.embed_tokens.lora_a.weight)[0])
        assert "model" not in str(got.embed_tokens.lora_b.weight.sharding.spec)
