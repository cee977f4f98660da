"""Text to rows: token folders, packing, instruction masks, bad input, and fit on them."""

import gc
import json
import sysconfig
from pathlib import Path
from pydoc_data.topics import topics

import datasets
import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from beartype import beartype
from jaxtyping import Array, Bool, Int, jaxtyped

import redcoast as rc
from redcoast.models import GPT2, GPT2Config

EOS = "<|endoftext|>"
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE of 512 ids trained on Python's documentation (a fraction of a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator([topics[k] for k in sorted(topics)][:200], trainer)
    return t


def _docs(n=12):
    return [topics[k] for k in sorted(topics)[:n]]


def _reference_tokens(tok, docs):
    eos = tok.token_to_id(EOS)
    out = []
    for d in docs:
        ids = tok.encode(d, add_special_tokens=False).ids
        if ids:
            out += [*ids, eos]
    return out


def _group_texts(ids, block):
    """run_clm.py's group_texts on one concatenated stream."""
    total = (len(ids) // block) * block
    return [ids[i : i + block] for i in range(0, total, block)]


def test_packing_equals_run_clm_group_texts(tok, tmp_path):
    docs = _docs()
    tokens = rc.text.tokenize(docs, tok, tmp_path / "tok", progress=False)
    reference = _reference_tokens(tok, docs)
    np.testing.assert_array_equal(np.asarray(tokens.tokens), reference)
    assert tokens.n_documents == len(docs)
    rows = rc.text.packed(tokens, 64)
    blocks = _group_texts(reference, 64)
    assert len(rows) == len(blocks)
    for row, block in zip(rows, blocks, strict=True):
        np.testing.assert_array_equal(row["input_ids"], block)
        assert row["input_ids"].dtype == np.int32 and row["loss_mask"].all()
    tail = rows[len(rows) - 3 :]
    assert len(tail) == 3
    np.testing.assert_array_equal(tail[0]["input_ids"], blocks[-3])


def test_a_long_file_tokenized_in_pieces_equals_the_whole_document(tok, tmp_path):
    text = "".join(
        (STDLIB / name).read_text() for name in ("argparse.py", "ast.py", "typing.py", "inspect.py")
    )
    assert len(text.encode()) > 400_000  # several 64 KiB pieces
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text(text)
    (corpus / "b.py").write_text("")  # an empty document adds nothing
    (corpus / "c.txt").write_text("print('x')\n")
    tokens = rc.text.tokenize(corpus, tok, tmp_path / "tok", pattern="**/*.py", progress=False)
    np.testing.assert_array_equal(np.asarray(tokens.tokens), _reference_tokens(tok, [text]))
    assert tokens.meta["files"] == [str(corpus / "a.py"), str(corpus / "b.py")]


def test_a_token_folder_is_reused_until_its_sources_change(tok, tmp_path):
    src = tmp_path / "doc.txt"
    src.write_text("first version of the text\n" * 50)
    a = rc.text.tokenize(src, tok, tmp_path / "tok", progress=False)
    stamp = (tmp_path / "tok" / "tokens.bin").stat().st_mtime_ns
    b = rc.text.tokenize(src, tok, tmp_path / "tok", progress=False)
    assert (tmp_path / "tok" / "tokens.bin").stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    src.write_text("a second, longer version of the text\n" * 50)
    c = rc.text.tokenize(src, tok, tmp_path / "tok", progress=False)
    assert len(c.tokens) != len(a.tokens)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt", "tok"]


def test_an_interrupted_tokenization_leaves_nothing_that_looks_complete(tok, tmp_path):
    def texts():
        yield from _docs(3)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rc.text.tokenize(texts(), tok, tmp_path / "tok", progress=False)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="not a token folder"):
        rc.text.TokenFile.open(tmp_path / "tok")
    rc.text.tokenize(_docs(3), tok, tmp_path / "tok", progress=False)
    # A damaged folder is refused by name, never read as complete.
    with open(tmp_path / "tok" / "tokens.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=r"tokens\.bin holds 10 bytes .* damaged"):
        rc.text.TokenFile.open(tmp_path / "tok")


def test_the_instruction_mask_covers_exactly_the_completion(tok, tmp_path):
    records = [
        {"prompt": "Explain the for statement.", "completion": " It iterates over a sequence."},
        {"prompt": "What is a tuple?", "completion": " An immutable sequence."},
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = rc.text.tokenize_instructions(path, tok, tmp_path / "tok", progress=False)
    rows = rc.text.padded(data, 40)
    eos = tok.token_to_id(EOS)
    for r, row in zip(records, rows, strict=True):
        prompt = tok.encode(r["prompt"], add_special_tokens=False).ids
        completion = [*tok.encode(r["completion"], add_special_tokens=False).ids, eos]
        n = len(prompt) + len(completion)
        np.testing.assert_array_equal(row["input_ids"][:n], prompt + completion)
        assert (row["input_ids"][n:] == eos).all()  # padded with EOS: no pad token
        expected = [False] * len(prompt) + [True] * len(completion) + [False] * (40 - n)
        np.testing.assert_array_equal(row["loss_mask"], expected)
    packed = rc.text.packed(data, 8)
    np.testing.assert_array_equal(
        np.concatenate([r["loss_mask"] for r in packed]), np.asarray(data.mask)[: 8 * len(packed)]
    )


def test_chat_messages_count_the_assistant_turns(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    hf.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    messages = [
        {"role": "user", "content": "Name a keyword."},
        {"role": "assistant", "content": "yield"},
        {"role": "user", "content": "Another."},
        {"role": "assistant", "content": "lambda"},
    ]
    data = rc.text.tokenize_instructions([{"messages": messages}], hf, tmp_path / "tok")
    ids, mask = np.asarray(data.tokens), np.asarray(data.mask)
    counted = tok.decode(ids[mask].tolist())
    assert counted == "yield<|end|>lambda<|end|>"
    assert tok.decode(ids[~mask].tolist()).count("<|assistant|>") == 2


@jaxtyped(typechecker=beartype)
def _masked_reference(
    model: GPT2, ids: Int[Array, "b s"], mask: Bool[Array, "b s"]
) -> tuple[float, float]:
    logits = jax.vmap(model)(ids[:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
    w = mask[:, 1:]
    return float((nll * w).sum()), float(w.sum())


def _gpt2(vocab=512, positions=64, seed=0):
    config = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=32, n_layer=2, n_head=2)
    return GPT2(config, key=jax.random.key(seed))


def test_lm_loss_counts_only_the_masked_tokens(tok, tmp_path):
    data = rc.text.tokenize_instructions(
        [{"prompt": d[:80], "completion": d[80:160]} for d in _docs(4)], tok, tmp_path / "tok"
    )
    batch = rc.text.collate(list(rc.text.padded(data, 128)))
    model = _gpt2(positions=128)
    loss, aux = rc.models.lm_loss(model, batch)
    ids, mask = (jax.numpy.asarray(batch[k]) for k in ("input_ids", "loss_mask"))
    total, count = _masked_reference(model, ids, mask)
    assert float(aux["tokens"]) == count == batch["loss_mask"][:, 1:].sum()
    np.testing.assert_allclose(float(loss), total / count, rtol=1e-6)


def test_bad_input_names_the_file_and_line(tok, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good line\nsecond line \xff\xfe broken\n")
    with pytest.raises(ValueError, match=r"bad\.txt:2 is not valid UTF-8"):
        rc.text.tokenize(bad, tok, tmp_path / "a", progress=False)
    replaced = rc.text.tokenize(bad, tok, tmp_path / "a", errors="replace", progress=False)
    assert "\ufffd" in tok.decode(np.asarray(replaced.tokens).tolist())

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.txt").write_text("")
    with pytest.raises(ValueError, match="holds no text"):
        rc.text.tokenize(empty, tok, tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match=r"no file .* matches"):
        rc.text.tokenize(empty, tok, tmp_path / "b", pattern="*.md", progress=False)
    with pytest.raises(ValueError, match="does not exist"):
        rc.text.tokenize(tmp_path / "nowhere", tok, tmp_path / "b", progress=False)
    assert not (tmp_path / "b").exists()

    records = tmp_path / "sft.jsonl"
    records.write_text('{"prompt": "a", "completion": "b"}\n\n{"question": "a"}\n')
    with pytest.raises(ValueError, match=r"sft\.jsonl:3 needs string fields .*\['question'\]"):
        rc.text.tokenize_instructions(records, tok, tmp_path / "c", progress=False)
    records.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"sft\.jsonl:2 is not valid JSON"):
        rc.text.tokenize_instructions(records, tok, tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="no chat template"):
        rc.text.tokenize_instructions([{"messages": []}], tok, tmp_path / "c", progress=False)

    user_file = tmp_path / "notes.txt"
    user_file.write_text("mine")
    with pytest.raises(ValueError, match="not a token folder"):
        rc.text.tokenize(_docs(2), tok, user_file, progress=False)
    assert user_file.read_text() == "mine"


def test_rows_a_model_cannot_take_are_refused(tok, tmp_path):
    docs = _docs(6)
    tokens = rc.text.tokenize(docs, tok, tmp_path / "tok", progress=False)
    small = _gpt2(vocab=300)
    with pytest.raises(
        ValueError, match=r"token id \d+ \(first at document #\d+.* vocabulary of 300"
    ):
        rc.text.packed(tokens, 32, model=small)
    with pytest.raises(ValueError, match=r"longer than GPT2's position table \(64 positions"):
        rc.text.packed(tokens, 65, model=_gpt2())
    assert len(rc.text.packed(tokens, 64, model=_gpt2())) > 0
    with pytest.raises(ValueError, match=r"documents .* longer than seq_len=16; the longest has"):
        rc.text.padded(tokens, 16)
    with pytest.raises(ValueError, match="seq_len must be an int >= 2"):
        rc.text.packed(tokens, 1)


def _fit_lm(examples, collate_fn, tmp_path=None):
    return rc.fit(
        _gpt2(),
        optax.adamw(3e-3),
        examples,
        collate_fn=collate_fn,
        loss_fn=rc.models.lm_loss,
        mesh=rc.make_mesh(2),
        per_device_batch_size=2,
        max_steps=6,
        log_every=1,
        progress=False,
    )


@pytest.mark.slow
def test_fit_takes_packed_rows_a_memmap_and_a_datasets_dataset(tok, tmp_path):
    tokens = rc.text.tokenize(_docs(40), tok, tmp_path / "tok", progress=False)
    rows = rc.text.packed(tokens, 64)
    packed = _fit_lm(rows, rc.text.collate)
    losses = [r["loss"] for r in packed.history["train"]]
    assert losses[-1] < losses[0]
    assert all(r["tokens"] == 8 * 63 for r in packed.history["train"])

    # The same rows as a NumPy memmap of shape (rows, seq_len), and as a datasets.Dataset.
    matrix = np.memmap(tmp_path / "rows.bin", np.int32, "w+", shape=(len(rows), 64))
    matrix[:] = np.stack([r["input_ids"] for r in rows])
    matrix.flush()
    mm = np.memmap(tmp_path / "rows.bin", np.int32, "r", shape=(len(rows), 64))
    from_memmap = _fit_lm(mm, lambda ex: {"input_ids": np.stack(ex)})
    ds = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows]})
    from_dataset = _fit_lm(ds, lambda ex: {"input_ids": np.array([e["input_ids"] for e in ex])})
    for other in (from_memmap, from_dataset):
        np.testing.assert_allclose([r["loss"] for r in other.history["train"]], losses, rtol=1e-6)


def _buffers(tree):
    """The distinct device buffers behind a tree's arrays: pointer -> bytes."""
    found = {}
    for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        for shard in x.addressable_shards:
            found[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return found


@pytest.mark.slow  # test_lora's donate=True run is its fast sibling
def test_donate_hands_the_model_over_without_a_second_copy():
    mesh = rc.make_mesh(2)
    rows = [np.arange(i, i + 64, dtype=np.int32) % 512 for i in range(64)]
    outside: dict[bool, int] = {}

    def run(donate):
        gc.collect()
        alive = jax.live_arrays()  # what earlier tests left, kept so no address is reused
        before = _buffers(alive)
        given = rc.place(_gpt2(), mesh)

        def measure(state):
            # Device memory held beyond the loop's own model and optimizer state.
            gc.collect()
            held = _buffers(state.model) | _buffers(state.opt_state) | before
            live = _buffers(jax.live_arrays())
            outside[donate] = sum(n for p, n in live.items() if p not in held)

        rc.fit(
            given,
            optax.adamw(1e-3),
            rows,
            loss_fn=rc.models.lm_loss,
            collate_fn=lambda ex: {"input_ids": np.stack(ex)},
            mesh=mesh,
            per_device_batch_size=2,
            max_steps=2,
            hooks=[rc.every(1, measure)],
            progress=False,
            donate=donate,
        )
        del alive
        return jax.tree.leaves(eqx.filter(given, eqx.is_array))

    handed_over = run(True)
    assert all(x.is_deleted() for x in handed_over)
    kept = run(False)
    assert not any(x.is_deleted() for x in kept)
    param_bytes = sum(_buffers(kept).values())
    # Without donation the caller's model is a second copy; with it, only a batch
    # and the step's scalars are held besides the loop state.
    assert outside[False] >= param_bytes
    assert outside[True] < 0.02 * param_bytes
