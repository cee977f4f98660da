"""Preference tuning: pairs in token folders, DPO/IPO/SimPO/ORPO against TRL, the reference.

The parity tests run TRL's own trainers (1.16: `DPOTrainer`, and `CPOTrainer` and
`ORPOTrainer` from `trl.experimental`) on a tiny random LLaMA that `transformers`
saved and `rc.models.from_hf` loaded, on the very token ids `rc.text.paired` made.
"""

import errno
import functools
import json
import os
import re
from pydoc_data.topics import topics

import chex
import datasets
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redcoast as rc

EOS = "<eos>"
SEQ = 48
TOPICS = [topics[k] for k in sorted(topics)]


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE of 512 ids trained on Python's documentation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator(TOPICS[:100], trainer)
    return t


def _records(n=8, offset=0):
    """Pairs of unequal lengths: a passage's start; its continuation, or another's."""
    out = []
    for i in range(offset, offset + n):
        text, other = ([w for w in TOPICS[k].split() if w.isalpha()] for k in (3 * i, 3 * i + 1))
        out.append(
            {
                "prompt": " ".join(text[: 2 + i % 3]),
                "chosen": " " + " ".join(text[2 + i % 3 : 4 + i % 4]),
                "rejected": " " + " ".join(other[: 1 + i % 5]),
            }
        )
    return out


LLAMA = {
    "vocab_size": 512,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def hf(tmp_path_factory, tok):
    """Two tiny random LLaMAs (policy and reference) saved by `transformers`, and the tokenizer."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("hf")
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(**LLAMA)
        transformers.LlamaForCausalLM(config).save_pretrained(folder / name)
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS
    )
    return folder, hf_tok


@pytest.fixture(scope="module")
def rows(tmp_path_factory, tok):
    tokens = rc.text.tokenize_preferences(
        _records(), tok, tmp_path_factory.mktemp("pairs") / "tok", progress=False
    )
    return rc.text.paired(tokens, SEQ)


# ----------------------------------------------------------------------------- data


def test_a_pair_is_the_prompt_with_each_answer_and_the_mask_on_the_answer(tok, tmp_path):
    records = _records(4)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokens = rc.text.tokenize_preferences(path, tok, tmp_path / "tok", progress=False)
    assert tokens.meta["kind"] == "preference" and tokens.n_documents == 2 * len(records)
    rows = rc.text.paired(tokens, SEQ)
    assert len(rows) == len(records)
    eos = tok.token_to_id(EOS)
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    for r, row in zip(records, rows, strict=True):
        for name in ("chosen", "rejected"):
            prompt, answer = enc(r["prompt"]), [*enc(r[name]), eos]
            n = len(prompt) + len(answer)
            ids, mask = row[f"{name}_ids"], row[f"{name}_mask"]
            assert ids.dtype == np.int32 and mask.dtype == np.bool_ and ids.shape == (SEQ,)
            np.testing.assert_array_equal(ids[:n], prompt + answer)
            assert (ids[n:] == eos).all()  # padded with EOS: the tokenizer has no pad token
            np.testing.assert_array_equal(mask.nonzero()[0], np.arange(len(prompt), n))
    # A view, batched by rc.text.collate; the same folder again from a Dataset is reused.
    tail = rows[2:]
    assert len(tail) == 2
    np.testing.assert_array_equal(tail[1]["rejected_ids"], rows[3]["rejected_ids"])
    batch = rc.text.collate(list(tail))
    assert {k: v.shape for k, v in batch.items()} == {
        k: (2, SEQ) for k in ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")
    }
    dataset = datasets.Dataset.from_list(records)
    from_dataset = rc.text.tokenize_preferences(dataset, tok, tmp_path / "ds", progress=False)
    np.testing.assert_array_equal(np.asarray(from_dataset.tokens), np.asarray(tokens.tokens))
    written = (tmp_path / "ds" / "meta.json").stat().st_mtime_ns
    rc.text.tokenize_preferences(dataset, tok, tmp_path / "ds", progress=False)
    assert (tmp_path / "ds" / "meta.json").stat().st_mtime_ns == written  # reused
    rc.text.tokenize_preferences(dataset.select([0, 1]), tok, tmp_path / "ds", progress=False)
    assert (tmp_path / "ds" / "meta.json").stat().st_mtime_ns != written  # other records


def test_chat_pairs_count_only_the_answers_assistant_turns(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    hf_tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    prompt = [
        {"role": "user", "content": "Name a keyword."},
        {"role": "assistant", "content": "yield"},
        {"role": "user", "content": "Another."},
    ]
    record = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "lambda"}],
        "rejected": [{"role": "assistant", "content": "banana"}],
    }
    rows = rc.text.paired(rc.text.tokenize_preferences([record], hf_tok, tmp_path / "t"), 128)
    for name, word in (("chosen", "lambda"), ("rejected", "banana")):
        ids, mask = rows[0][f"{name}_ids"], rows[0][f"{name}_mask"]
        assert tok.decode(ids[mask].tolist()) == f"{word}<|end|>"  # not the prompt's "yield"
        assert tok.decode(ids[~mask].tolist()).startswith("<|user|>Name a keyword.")


def test_bad_preference_input_names_the_record(tok, tmp_path):
    good = _records(2)
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        json.dumps(good[0]) + "\n\n" + json.dumps({"prompt": "a", "chosen": "b"}) + "\n"
    )
    with pytest.raises(ValueError, match=r"pairs\.jsonl:3 needs fields .*\['chosen', 'prompt'\]"):
        rc.text.tokenize_preferences(path, tok, tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match=r"record #1 has an empty rejected answer"):
        rc.text.tokenize_preferences(
            [good[0], {**good[1], "rejected": ""}], tok, tmp_path / "a", progress=False
        )
    with pytest.raises(ValueError, match=r"record #0 has an empty prompt"):
        rc.text.tokenize_preferences([{**good[0], "prompt": ""}], tok, tmp_path / "a")
    with pytest.raises(ValueError, match="no chat template"):
        chat = {"prompt": [], "chosen": [], "rejected": []}
        rc.text.tokenize_preferences([chat], tok, tmp_path / "a", progress=False)
    assert not (tmp_path / "a").exists()

    long = {**good[1], "chosen": " word" * 60}
    path.write_text("".join(json.dumps(r) + "\n" for r in [good[0], long]))
    tokens = rc.text.tokenize_preferences(path, tok, tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match=r"1 of 2 pairs .* longer than seq_len=48.*pairs\.jsonl:2"):
        rc.text.paired(tokens, SEQ)
    listed = rc.text.tokenize_preferences([good[0], long], tok, tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match=r"record #1\)"):
        rc.text.paired(listed, SEQ)
    text = rc.text.tokenize(["plain text"], tok, tmp_path / "d", progress=False)
    with pytest.raises(ValueError, match="not preference pairs; make the folder with"):
        rc.text.paired(text, SEQ)


def test_bad_loss_settings_and_batches_say_what_to_do(rows, llama):
    model, _ = llama
    batch = rc.text.collate(list(rows[:2]))
    with pytest.raises(ValueError, match=r"has none\. Apply them .* reference='precomputed'"):
        rc.preference.dpo_loss(model, batch)
    with pytest.raises(ValueError, match=r"reads 'ref_chosen_logp' .*precompute_reference"):
        rc.preference.dpo_loss(model, batch, reference="precomputed")
    with pytest.raises(ValueError, match="lacks 'rejected_mask'"):
        rc.preference.simpo_loss(model, {k: v for k, v in batch.items() if k != "rejected_mask"})
    with pytest.raises(ValueError, match="beta must be a finite number > 0"):
        rc.preference.orpo_loss(model, batch, beta=0.0)
    with pytest.raises(ValueError, match=r"label_smoothing .* \[0, 0.5\)"):
        rc.preference.simpo_loss(model, batch, label_smoothing=0.5)


# ----------------------------------------------------------------------------- parity with TRL


def _from_hf(hf, name):
    folder, _ = hf
    return rc.models.from_hf(folder / name)


def _torch_model(hf, name):
    transformers = pytest.importorskip("transformers")
    folder, _ = hf
    return transformers.AutoModelForCausalLM.from_pretrained(folder / name)


def _trl_examples(batch):
    """The rows as TRL's preference examples: prompt ids, and each answer's ids."""
    out = []
    for i in range(len(batch["chosen_ids"])):
        first = int(np.argmax(batch["chosen_mask"][i]))
        ex = {"prompt_ids": batch["chosen_ids"][i][:first].tolist()}
        for name in ("chosen", "rejected"):
            ids, mask = batch[f"{name}_ids"][i], batch[f"{name}_mask"][i]
            assert ids[:first].tolist() == ex["prompt_ids"] and not mask[:first].any()
            ex[f"{name}_ids"] = ids[mask].tolist()
        out.append(ex)
    return out


def _trl_pair_batch(batch):
    """The rows as TRL's CPO/ORPO batches: ids, the prompt-and-answer mask, answer labels."""
    import torch

    out = {}
    for name in ("chosen", "rejected"):
        ids, mask = batch[f"{name}_ids"].astype(np.int64), batch[f"{name}_mask"]
        upto = np.flip(np.cumsum(np.flip(mask, -1), -1), -1) > 0
        out[f"{name}_input_ids"] = torch.tensor(ids)
        out[f"{name}_attention_mask"] = torch.tensor(upto.astype(np.int64))
        out[f"{name}_labels"] = torch.tensor(np.where(mask, ids, -100))
    return out


def _trl_args(tmp_path, config, **kw):
    # TRL's configs default to bfloat16 autocast (bf16=True) where the CPU has it.
    return config(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, **kw)


def _assert_metrics(ours, theirs, keys, tol=1e-5):
    for k in keys:
        np.testing.assert_allclose(float(ours[k]), float(theirs[k]), rtol=tol, atol=tol, err_msg=k)


METRICS = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
]

# Compiled once each: run op by op, the first forward pass alone takes seconds.
JIT = {
    name: eqx.filter_jit(getattr(rc.preference, name))
    for name in ("pair_logps", "dpo_loss", "simpo_loss", "orpo_loss")
}

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    ("loss_type", "sft_weight"), [("sigmoid", 0.0), ("ipo", 0.0), ("sigmoid", 0.5)]
)
def test_dpo_and_ipo_equal_trls_dpo_trainer(hf, rows, tmp_path, loss_type, sft_weight):
    trl = pytest.importorskip("trl")
    batch = rc.text.collate(list(rows))
    ref_c, ref_r = JIT["pair_logps"](_from_hf(hf, "reference"), batch)
    ours = JIT["dpo_loss"](
        _from_hf(hf, "policy"),
        {**batch, "ref_chosen_logp": ref_c, "ref_rejected_logp": ref_r},
        beta=0.3,
        loss_type=loss_type,
        reference="precomputed",
        sft_weight=sft_weight,
    )
    # TRL adds the chosen answers' likelihood as a second loss, "sft", with its weight.
    kinds = [loss_type, "sft"] if sft_weight else [loss_type]
    weights = [1.0, sft_weight] if sft_weight else None
    args = _trl_args(tmp_path, trl.DPOConfig, beta=0.3, loss_type=kinds, loss_weights=weights)
    trainer = trl.DPOTrainer(
        model=_torch_model(hf, "policy"),
        ref_model=_torch_model(hf, "reference"),
        args=args,
        train_dataset=datasets.Dataset.from_list(_records(2)),
        processing_class=hf[1],
    )
    inputs = trainer.data_collator(_trl_examples(batch))
    loss = trainer.compute_loss(trainer.model, inputs)
    mode = "train" if trainer.model.training else "eval"
    logged = {k: v[-1] for k, v in trainer._metrics[mode].items()}
    np.testing.assert_allclose(float(ours[0]), float(loss), rtol=1e-5, atol=1e-6)
    _assert_metrics(ours[1], logged, METRICS)
    assert 0 < float(ours[1]["rewards/accuracies"]) < 1  # the metrics are not degenerate


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("sft_weight", [0.0, 1.0])
def test_simpo_equals_trls_cpo_trainer(hf, rows, tmp_path, sft_weight):
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    batch = rc.text.collate(list(rows))
    ours = JIT["simpo_loss"](
        _from_hf(hf, "policy"), batch, beta=2.0, gamma=0.7, sft_weight=sft_weight
    )
    settings = {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.7, "cpo_alpha": sft_weight}
    trainer = CPOTrainer(
        model=_torch_model(hf, "policy"),
        args=_trl_args(tmp_path, CPOConfig, **settings),
        train_dataset=datasets.Dataset.from_list(_records(2)),
        processing_class=hf[1],
    )
    loss, logged = trainer.get_batch_loss_metrics(trainer.model, _trl_pair_batch(batch))
    np.testing.assert_allclose(float(ours[0]), float(loss), rtol=1e-5, atol=1e-6)
    _assert_metrics(ours[1], logged, METRICS + (["nll_loss"] if sft_weight else []))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_label_smoothed_dpo_equals_trls_conservative_loss(hf, rows, tmp_path):
    """TRL 1.16's DPOTrainer dropped label smoothing from its sigmoid loss; its
    CPOTrainer keeps the conservative-DPO formula, on log-ratios here."""
    pytest.importorskip("trl")
    import torch
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    batch = rc.text.collate(list(rows))
    ref_c, ref_r = JIT["pair_logps"](_from_hf(hf, "reference"), batch)
    policy = _from_hf(hf, "policy")
    chosen, rejected = JIT["pair_logps"](policy, batch)
    loss, _ = JIT["dpo_loss"](
        policy,
        {**batch, "ref_chosen_logp": ref_c, "ref_rejected_logp": ref_r},
        beta=0.3,
        label_smoothing=0.2,
        reference="precomputed",
    )
    settings = {"loss_type": "sigmoid", "beta": 0.3, "label_smoothing": 0.2}
    trainer = CPOTrainer(
        model=_torch_model(hf, "policy"),
        args=_trl_args(tmp_path, CPOConfig, **settings),
        train_dataset=datasets.Dataset.from_list(_records(2)),
        processing_class=hf[1],
    )
    as_torch = lambda x: torch.tensor(np.asarray(x, np.float64))  # noqa: E731
    losses, _, _ = trainer.cpo_loss(as_torch(chosen - ref_c), as_torch(rejected - ref_r))
    np.testing.assert_allclose(float(loss), float(losses.mean()), rtol=1e-5)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_orpo_equals_trls_orpo_trainer(hf, rows, tmp_path):
    pytest.importorskip("trl")
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    batch = rc.text.collate(list(rows))
    ours = JIT["orpo_loss"](_from_hf(hf, "policy"), batch, beta=0.25)
    trainer = ORPOTrainer(
        model=_torch_model(hf, "policy"),
        args=_trl_args(tmp_path, ORPOConfig, beta=0.25),
        train_dataset=datasets.Dataset.from_list(_records(2)),
        processing_class=hf[1],
    )
    loss, logged = trainer.get_batch_loss_metrics(trainer.model, _trl_pair_batch(batch))
    np.testing.assert_allclose(float(ours[0]), float(loss), rtol=1e-5, atol=1e-6)
    _assert_metrics(ours[1], logged, [*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"])


# ----------------------------------------------------------------------------- the reference


@pytest.fixture(scope="module")
def llama():
    """A tiny LLaMA, and the same with LoRA adapters on projections and the token table."""
    config = rc.models.LlamaConfig(**LLAMA)
    # Built under jit: op by op, initialising alone compiles for seconds.
    base = eqx.filter_jit(lambda k: rc.models.Llama(config, key=k))(jax.random.key(0))
    model = rc.lora.apply(base, ["q_proj", "v_proj", "down_proj"], rank=4, key=jax.random.key(1))
    model = rc.lora.apply(model, "embed_tokens", rank=2, key=jax.random.key(2))

    def nonzero(x):  # a fresh adapter computes nothing and would hide mistakes
        where = (lambda m: m.lora_b.weight) if isinstance(x, rc.lora.LoRALinear) else None
        if isinstance(x, rc.lora.LoRAEmbedding):
            where = lambda m: m.lora_a.weight  # noqa: E731
        if where is None:
            return x
        w = where(x)
        return eqx.tree_at(where, x, 0.5 * jax.random.normal(jax.random.key(w.size), w.shape))

    adapters = rc.lora.LoRALinear | rc.lora.LoRAEmbedding
    return base, jax.tree.map(nonzero, model, is_leaf=lambda x: isinstance(x, adapters))


def test_the_lora_reference_is_the_base_model_exactly(rows, llama):
    base, model = llama
    batch = rc.text.collate(list(rows))
    logps = eqx.filter_jit(rc.preference.pair_logps)
    want = logps(base, batch)
    got = logps(rc.lora.disabled(model), batch)
    chex.assert_trees_all_equal(got, want)
    assert not np.allclose(logps(model, batch)[0], want[0])  # the adapters do change it
    # No weight is copied: the disabled model holds the very arrays of the adapted one.
    ids = lambda t: {id(x) for x in jax.tree.leaves(eqx.filter(t, eqx.is_array))}  # noqa: E731
    assert ids(rc.lora.disabled(model)) <= ids(model)
    with pytest.raises(ValueError, match="has no LoRA layers"):
        rc.lora.disabled(base)


def test_the_precomputed_reference_equals_the_live_one(rows, llama, tmp_path):
    base, model = llama
    batch = rc.text.collate(list(rows))
    mesh = rc.make_mesh(2)
    referenced = rc.preference.precompute_reference(
        base, rows, tmp_path / "ref.npy", mesh=mesh, per_device_batch_size=1
    )
    assert isinstance(np.load(tmp_path / "ref.npy", mmap_mode="r"), np.memmap)
    assert len(referenced) == len(rows) and len(referenced[3:]) == len(rows) - 3
    with_ref = rc.text.collate(list(referenced))
    np.testing.assert_array_equal(with_ref["chosen_ids"], batch["chosen_ids"])

    def loss(m, b, reference):
        return rc.preference.dpo_loss(m, b, beta=0.5, reference=reference)

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True), donate="none")
    (live, live_m), live_g = grad(model, batch, "lora")
    (pre, pre_m), pre_g = grad(model, with_ref, "precomputed")
    np.testing.assert_allclose(float(pre), float(live), rtol=1e-5)
    chex.assert_trees_all_close(pre_m, live_m, rtol=1e-5, atol=1e-5)
    # No gradient reaches the reference: the base weights' gradients agree too.
    chex.assert_trees_all_close(
        eqx.filter(pre_g, eqx.is_array), eqx.filter(live_g, eqx.is_array), rtol=1e-4, atol=1e-6
    )
    assert abs(float(live_m["rewards/margins"])) > 1e-3


def _precompute(rows, path, **kw):
    # The model is never called: the tests below replace or stop the pass.
    return rc.preference.precompute_reference(lambda ids: ids, rows, path, **kw)


def test_a_reference_path_that_cannot_be_written_is_refused_before_the_pass(
    rows, tmp_path, monkeypatch
):
    def no_pass(*args, **kwargs):
        raise AssertionError("the reference pass ran")

    monkeypatch.setattr(rc.preference, "predict", no_pass)
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "notes.md").write_text("mine")
    (tmp_path / "data").write_text("a file")
    with pytest.raises(
        ValueError,
        match=rf"precompute_reference: path {re.escape(str(folder))} is a folder; pass the "
        "path of the file to write",
    ):
        _precompute(rows, folder, per_device_batch_size=1)
    with pytest.raises(ValueError, match=r"data is a file, not a folder\. Pass a path in a"):
        _precompute(rows, tmp_path / "data" / "ref" / "pairs.npy", per_device_batch_size=1)
    with monkeypatch.context() as m:
        m.setattr(os, "access", lambda *args, **kwargs: False)  # root may write anywhere
        with pytest.raises(ValueError, match=r"no permission to write in .*cache\. Pass a path"):
            _precompute(rows, folder / "ref.npy", per_device_batch_size=1)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "cache",
        "cache/notes.md",
        "data",
    ]


def test_a_failed_reference_write_leaves_the_previous_file_and_no_temporary(
    rows, tmp_path, monkeypatch
):
    logps = [{"chosen": np.float32(-i), "rejected": np.float32(-2 * i)} for i in range(len(rows))]
    monkeypatch.setattr(rc.preference, "predict", lambda *args, **kwargs: logps)
    path = tmp_path / "new" / "ref.npy"  # its folder is made
    referenced = _precompute(rows, path, per_device_batch_size=1)
    assert referenced[3]["ref_rejected_logp"] == -6.0
    written = path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=rf"No space left on device: '{re.escape(str(path))}'"):
        _precompute(rows, path, per_device_batch_size=1)
    monkeypatch.undo()
    assert [p.name for p in path.parent.iterdir()] == ["ref.npy"]
    assert path.read_bytes() == written


# ----------------------------------------------------------------------------- sharded, resumed


def _dpo_step(model, mesh, fsdp):
    mask = rc.lora.trainable(model)
    model = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, model)
    loss_fn = functools.partial(rc.preference.dpo_loss, beta=0.5)
    if mesh is not None:
        model = rc.place(model, mesh, fsdp=fsdp, example_call=lambda m: loss_fn(m, BATCH))
    opt = optax.sgd(0.5)
    step = rc.train_step(loss_fn, opt, mesh=mesh, trainable=mask)
    opt_state = opt.init(eqx.filter(model, rc.trainable_mask(model, mask)))
    model, _, metrics = step(model, opt_state, BATCH, jax.random.key(0))
    return model, metrics


BATCH: dict = {}


# In `nox -s slow` (two compilations of a step with two forward passes); the
# precomputed reference's sharded `rc.predict` above is its fast sibling.
@pytest.mark.slow
def test_a_sharded_dpo_step_equals_one_device(rows, llama):
    """LoRA DPO with its reference in the step: TP 2 x FSDP over 4 data shards."""
    BATCH.update(rc.text.collate(list(rows)))
    _, model = llama
    want, want_metrics = _dpo_step(model, None, False)
    got, metrics = _dpo_step(model, rc.make_mesh(2), True)
    chex.assert_trees_all_close(metrics, want_metrics, rtol=1e-5, atol=1e-6)
    mask = rc.lora.trainable(model)
    chex.assert_trees_all_close(
        jax.tree.leaves(eqx.filter(got, rc.trainable_mask(got, mask))),
        jax.tree.leaves(eqx.filter(want, mask)),
        rtol=1e-5,
        atol=1e-6,
    )
    q = got.blocks[0].attn.q_proj
    assert "data" in str(q.base.weight.sharding.spec) and "model" in str(
        q.lora_b.weight.sharding.spec
    )


@pytest.mark.slow
def test_a_full_dpo_fit_resumes_step_exactly(rows, llama, tmp_path):
    """A full fine-tune against the precomputed reference, stopped and resumed."""
    model, _ = llama
    mesh = rc.make_mesh(2)
    train = rc.preference.precompute_reference(
        model, rows, tmp_path / "ref.npy", mesh=mesh, per_device_batch_size=1
    )

    def run(max_steps, **kw):
        return rc.fit(
            model,
            optax.adamw(1e-2),
            train,
            collate_fn=rc.text.collate,
            loss_fn=functools.partial(rc.preference.dpo_loss, reference="precomputed"),
            mesh=mesh,
            per_device_batch_size=1,
            max_steps=max_steps,
            progress=False,
            **kw,
        )

    straight = run(5)
    run(2, workdir=tmp_path / "run")
    resumed = run(5, workdir=tmp_path / "run", resume=True)
    assert resumed.step == 5
    chex.assert_trees_all_equal(
        eqx.filter(resumed.model, eqx.is_array), eqx.filter(straight.model, eqx.is_array)
    )
