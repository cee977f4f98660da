"""Text to rows: token folders, packing, instruction masks, bad input, and fit on them."""

import errno
import gc
import inspect
import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import time
import tomllib
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
import redcoast.text._checksums as checksums
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
    old = rc.text.packed(tokens, 64, separate_documents=False)
    assert set(old[0]) == {"input_ids", "loss_mask"}


def test_packed_rows_say_where_their_documents_are(tok, tmp_path):
    docs = _docs()
    tokens = rc.text.tokenize(docs, tok, tmp_path / "tok", progress=False)
    eos = tok.token_to_id(EOS)
    rows = rc.text.packed(tokens, 64)
    stream = np.asarray(tokens.tokens)
    # Each document ends with EOS: a new segment starts right after every EOS, and
    # only there; positions count from each start, and from each row's first token.
    seen_documents = 0
    for i, row in enumerate(rows):
        segments, positions = row["segment_ids"], row["positions"]
        assert segments.dtype == positions.dtype == np.int32
        assert segments[0] == 0 and positions[0] == 0
        starts = np.flatnonzero(np.diff(segments)) + 1
        np.testing.assert_array_equal(np.diff(segments)[starts - 1], 1)
        ends = np.flatnonzero(stream[i * 64 : (i + 1) * 64] == eos)
        np.testing.assert_array_equal(starts, ends[ends < 63] + 1)
        for a, b in zip([0, *starts], [*starts, 64], strict=True):
            np.testing.assert_array_equal(positions[a:b], np.arange(b - a))
        seen_documents += len(starts)
    assert seen_documents > 3
    batch = rc.text.collate([rows[0], rows[1]])
    assert batch["segment_ids"].shape == batch["positions"].shape == (2, 64)


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


def test_a_full_disk_or_a_failed_rename_keeps_the_previous_folder_and_no_other(
    tok, tmp_path, monkeypatch
):
    out = tmp_path / "tok"
    rc.text.tokenize(_docs(2), tok, out, progress=False)

    def full_disk(path, mode):
        # Every write fails as on a full disk, again when the writer closes the file.
        return open("/dev/full", mode)

    monkeypatch.setattr(checksums, "open", full_disk, raising=False)
    with pytest.raises(OSError, match="No space left on device"):
        rc.text.tokenize(_docs(3), tok, out, progress=False)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]
    assert rc.text.TokenFile.open(out).n_documents == 2

    real = os.rename

    def fail_into_place(src, dst):
        if Path(dst) == out and ".tmp-" in Path(src).name:
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(os, "rename", fail_into_place)
    with pytest.raises(OSError, match="Input/output error"):
        rc.text.tokenize(_docs(3), tok, out, progress=False)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]
    assert rc.text.TokenFile.open(out).n_documents == 2


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
    # run_clm.py's rows, which a memmap of ids holds whole.
    rows = rc.text.packed(tokens, 64, separate_documents=False)
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


# Issue 35, "Nothing lost": each test below failed before its fix.


def test_a_folder_redcoast_did_not_write_is_never_replaced(tok, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "meta.json").write_text('{"name": "another tool"}')
    (project / "notes.md").write_text("mine")
    with pytest.raises(
        ValueError,
        match=r"project holds files redcoast did not write \(its meta\.json is not a token "
        r"folder's\): meta\.json, notes\.md\. .*give a new path",
    ):
        rc.text.tokenize(_docs(2), tok, project, progress=False)
    assert sorted(p.name for p in project.iterdir()) == ["meta.json", "notes.md"]
    assert (project / "notes.md").read_text() == "mine"

    # A token folder a user put a README into: reused as it is, never replaced.
    out = tmp_path / "tok"
    rc.text.tokenize(_docs(2), tok, out, progress=False)
    (out / "README.md").write_text("what this folder is")
    assert rc.text.tokenize(_docs(2), tok, out, progress=False).n_documents == 2
    with pytest.raises(ValueError, match=r"tok holds files redcoast did not write .*: README\.md"):
        rc.text.tokenize(_docs(3), tok, out, progress=False)
    assert (out / "README.md").read_text() == "what this folder is"
    assert rc.text.TokenFile.open(out).n_documents == 2

    # Leftovers of a dead writer are cleared; a folder of such a name holding anything
    # else is not redcoast's and stays.
    dead, other = tmp_path / "fresh.tmp-deadbeef", tmp_path / "fresh.tmp-0badc0de"
    dead.mkdir()
    (dead / "tokens.bin").write_bytes(b"\0" * 10)
    other.mkdir()
    (other / "draft.txt").write_text("mine too")
    rc.text.tokenize(_docs(2), tok, tmp_path / "fresh", progress=False)
    assert not dead.exists() and (other / "draft.txt").read_text() == "mine too"


def test_a_token_folder_of_an_older_format_is_rebuilt_not_trusted(tok, tmp_path):
    out = tmp_path / "tok"
    rc.text.tokenize(_docs(3), tok, out, progress=False)
    # As version 1 wrote it: no checksums.
    meta = json.loads((out / "meta.json").read_text())
    meta["format"] = "redcoast-tokens/1"
    del meta["checksums"], meta["chunk_bytes"]
    (out / "meta.json").write_text(json.dumps(meta))
    (out / "checksums.bin").unlink()
    with pytest.raises(ValueError, match=r"another version of redcoast .*'redcoast-tokens/1'"):
        rc.text.TokenFile.open(out)
    rebuilt = rc.text.tokenize(_docs(3), tok, out, progress=False)
    assert rebuilt.meta["format"] != "redcoast-tokens/1"
    assert (out / "checksums.bin").is_file()
    np.testing.assert_array_equal(np.asarray(rebuilt.tokens), _reference_tokens(tok, _docs(3)))


def test_a_list_of_path_strings_is_refused_not_tokenized_as_text(tok, tmp_path):
    paths = []
    for i, doc in enumerate(_docs(2)):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_text(doc)
    for given in ([str(p) for p in paths], tuple(str(p) for p in paths)):
        with pytest.raises(
            ValueError,
            match=r"strings that are all paths of existing files .* the paths themselves "
            r"would be tokenized\. .*\[Path\(p\) for p in paths\]",
        ):
            rc.text.tokenize(given, tok, tmp_path / "tok", progress=False)
    with pytest.raises(ValueError, match="all paths of existing files"):
        rc.text.tokenize_instructions([str(paths[0])], tok, tmp_path / "tok", progress=False)
    assert not (tmp_path / "tok").exists()

    # As Paths they are read; a one-shot iterator is not consumed by the check.
    files = rc.text.tokenize(paths, tok, tmp_path / "tok", progress=False)
    np.testing.assert_array_equal(np.asarray(files.tokens), _reference_tokens(tok, _docs(2)))
    texts = rc.text.tokenize((str(p) for p in paths), tok, tmp_path / "tok2", progress=False)
    np.testing.assert_array_equal(
        np.asarray(texts.tokens), _reference_tokens(tok, [str(p) for p in paths])
    )
    mixed = [_docs(1)[0], str(paths[0])]  # a document first: strings, read as text
    assert rc.text.tokenize(mixed, tok, tmp_path / "tok3", progress=False).n_documents == 2


def test_token_folders_inside_the_corpus_are_never_read_as_text(tok, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(_docs(5)):
        (corpus / f"{i}.txt").write_text(doc)
    out = corpus / "tok"
    first = rc.text.tokenize(corpus, tok, out, errors="replace", progress=False)
    stamp = (out / "tokens.bin").stat().st_mtime_ns
    second = rc.text.tokenize(corpus, tok, out, errors="replace", progress=False)
    assert first.n_documents == second.n_documents == 5
    assert (out / "tokens.bin").stat().st_mtime_ns == stamp  # reused: the corpus is unchanged

    # Another token folder, and one being written by another tokenize, are skipped too.
    rc.text.tokenize(_docs(2), tok, corpus / "sub" / "other", progress=False)
    writing = corpus / "cache.tmp-0123abcd"
    writing.mkdir()
    (writing / "tokens.bin").write_bytes(b"\x01\x02" * 10)
    third = rc.text.tokenize(corpus, tok, tmp_path / "elsewhere", errors="replace", progress=False)
    assert third.meta["files"] == [str(corpus / f"{i}.txt") for i in range(5)]
    np.testing.assert_array_equal(np.asarray(third.tokens), _reference_tokens(tok, _docs(5)))
    with pytest.raises(ValueError, match=r"tok is a token folder .*not text"):
        rc.text.tokenize(out, tok, tmp_path / "again", progress=False)
    with pytest.raises(ValueError, match=r"tokens\.bin is a file of a token folder"):
        rc.text.tokenize([out / "tokens.bin"], tok, tmp_path / "again", progress=False)


def _big_text():
    """About 1.6 MB of Python: a token file of two 1 MiB chunks."""
    names = ("argparse.py", "ast.py", "typing.py", "inspect.py")
    return "".join((STDLIB / name).read_text() for name in names) * 4


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def _unchecked(rows_fn):
    """`packed` or `padded` without the test run's type-checker, which reads a random row
    of the sequence they return: these tests must be the first to read each row."""
    return inspect.unwrap(rows_fn)


def test_a_token_folder_changed_on_disk_is_found_before_its_rows_are_used(tok, tmp_path):
    src = tmp_path / "big.py"
    src.write_text(_big_text())
    out = tmp_path / "tok"
    tokens = rc.text.tokenize(src, tok, out, progress=False)
    size = (out / "tokens.bin").stat().st_size
    assert size > 1 << 20
    _flip(out / "tokens.bin", (1 << 20) + 10)
    reused = rc.text.tokenize(src, tok, out, progress=False)  # opening reads no token chunk
    rows = _unchecked(rc.text.packed)(reused, 64)
    np.testing.assert_array_equal(rows[0]["input_ids"], np.asarray(tokens.tokens[:64]))
    with pytest.raises(
        ValueError,
        match=rf"tokens\.bin: bytes \[1048576, {size}\) do not match their checksum .*"
        r"Delete .*tok and tokenize again",
    ):
        rows[((1 << 20) + 10) // 2 // 64]
    assert rows[1]["input_ids"].shape == (64,)  # other chunks are still read

    # The small files are checked whole whenever the folder is opened, and a damaged
    # folder is rebuilt rather than reused.
    _flip(out / "documents.bin", 3)
    with pytest.raises(ValueError, match=r"documents\.bin does not match its checksum"):
        rc.text.TokenFile.open(out)
    rebuilt = _unchecked(rc.text.packed)(rc.text.tokenize(src, tok, out, progress=False), 64)
    assert rebuilt[((1 << 20) + 10) // 2 // 64]["input_ids"].shape == (64,)

    records = [{"prompt": d[:60], "completion": d[60:120]} for d in _docs(3)]
    sft = rc.text.tokenize_instructions(records, tok, tmp_path / "sft", progress=False)
    _flip(tmp_path / "sft" / "mask.bin", 5)
    with pytest.raises(ValueError, match=r"mask\.bin: bytes \[0, \d+\) do not match"):
        _unchecked(rc.text.padded)(sft, 128)[0]


def test_rows_check_their_ids_against_the_model_not_only_meta_json(tok, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(3)))
    out = tmp_path / "tok"
    tokens = rc.text.tokenize(src, tok, out, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    meta["max_id"] = 100  # meta.json says every id fits a vocabulary of 300
    (out / "meta.json").write_text(json.dumps(meta))
    tokens = rc.text.TokenFile.open(out)
    ids = np.asarray(tokens.tokens)
    bad = int(np.argmax(ids >= 300))
    line = int(np.searchsorted(tokens.starts, bad, side="right"))  # record d is on line d + 1
    rows = _unchecked(rc.text.packed)(tokens, 32, model=_gpt2(vocab=300))
    with pytest.raises(
        ValueError,
        match=rf"row {bad // 32} of .*tok holds token id {ids[bad]} \(from .*docs\.jsonl:"
        rf"{line}\), past the model's vocabulary of 300.*Delete",
    ):
        [rows[i] for i in range(len(rows))]
    longest = int(np.diff(tokens.starts).max())
    padded = _unchecked(rc.text.padded)(tokens, longest, model=_gpt2(vocab=300, positions=longest))
    with pytest.raises(ValueError, match=rf"row {line - 1} of .*docs\.jsonl:{line}\)"):
        [padded[i] for i in range(len(padded))]


def test_a_file_rewritten_with_its_size_and_mtime_kept_is_tokenized_again(tok, tmp_path):
    src = tmp_path / "doc.txt"
    src.write_text("alpha beta\n" * 40)
    out = tmp_path / "tok"
    rc.text.tokenize(src, tok, out, progress=False)
    kept = src.stat()
    src.write_text("gamma delt\n" * 40)  # as many bytes, other text
    os.utime(src, ns=(kept.st_atime_ns, kept.st_mtime_ns))  # as cp -p, rsync -t, tar x do
    assert (src.stat().st_size, src.stat().st_mtime_ns) == (kept.st_size, kept.st_mtime_ns)
    again = rc.text.tokenize(src, tok, out, progress=False)
    reference = _reference_tokens(tok, [src.read_text()])
    np.testing.assert_array_equal(np.asarray(again.tokens), reference)

    # Touched only (a new time, the same bytes): reused.
    stamp = (out / "tokens.bin").stat().st_mtime_ns
    os.utime(src, ns=(kept.st_atime_ns, kept.st_mtime_ns + 10**9))
    rc.text.tokenize(src, tok, out, progress=False)
    assert (out / "tokens.bin").stat().st_mtime_ns == stamp


_TOKENIZE_AT_ONCE = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import redcoast as rc

    corpus, tokenizer, out, flags, me = sys.argv[1:]
    (Path(flags) / f"ready-{me}").touch()
    while not (Path(flags) / "go").exists():
        time.sleep(0.001)
    tokens = rc.text.tokenize(Path(corpus), tokenizer, out, progress=False)
    inode = os.stat(Path(out) / "tokens.bin").st_ino
    print(json.dumps({"n_tokens": tokens.meta["n_tokens"], "inode": inode}))
    """
)


def _child_env():
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}


def test_two_processes_tokenizing_into_one_folder_both_succeed(tok, tmp_path):
    corpus, flags = tmp_path / "corpus", tmp_path / "flags"
    corpus.mkdir()
    flags.mkdir()
    text = _big_text()
    for i in range(4):  # long enough to tokenize that the two overlap
        (corpus / f"{i}.py").write_text(text[i::4])
    tok.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "cache" / "tok"
    args = [str(corpus), str(tmp_path / "tokenizer.json"), str(out), str(flags)]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _TOKENIZE_AT_ONCE, *args, str(i)],
            env=_child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 120
    while len(list(flags.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    (flags / "go").touch()
    results = [child.communicate(timeout=300) for child in children]
    for child, (_, err) in zip(children, results, strict=True):
        assert child.returncode == 0, err
    reports = [json.loads(out_text) for out_text, _ in results]
    # One folder, written once: the second writer waited, then reused the first's.
    assert reports[0] == reports[1]
    assert reports[0]["inode"] == os.stat(out / "tokens.bin").st_ino
    assert os.listdir(out.parent) == ["tok"]  # no temporary folder, no lock file left
    assert rc.text.TokenFile.open(out).meta["n_tokens"] == reports[0]["n_tokens"]


_READ_WHILE_TRUNCATED = textwrap.dedent(
    """
    import sys
    import redcoast as rc

    folder = sys.argv[1]
    rows = rc.text.packed(rc.text.TokenFile.open(folder), 64)
    rows[0]
    with open(f"{folder}/tokens.bin", "r+b") as f:
        f.truncate(1000)
    try:
        rows[len(rows) - 1]
    except ValueError as err:
        print(err)
    """
)


def test_a_token_file_truncated_while_in_use_is_an_error_not_a_crash(tok, tmp_path):
    tokens = rc.text.tokenize(_docs(12), tok, tmp_path / "tok", progress=False)
    n_rows = len(tokens.tokens) // 64
    start = (n_rows - 1) * 64 * 2  # the last row's first byte (2 bytes an id)
    assert start > 1000
    del tokens
    child = subprocess.run(
        [sys.executable, "-c", _READ_WHILE_TRUNCATED, str(tmp_path / "tok")],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    # A SIGBUS would end the reader with returncode -7 and print nothing.
    assert child.returncode == 0, child.stderr
    assert re.search(
        rf"tokens\.bin: bytes \[{start}, {start + 128}\) were wanted, but the file holds 1000 "
        r"bytes .*truncated while in use\. Delete .*tok and tokenize again",
        child.stdout,
    ), child.stdout


def test_collate_names_the_key_and_row_that_do_not_fit():
    def row(n, **extra):
        return {"input_ids": np.zeros(n, np.int32), "loss_mask": np.ones(n, bool), **extra}

    batch = rc.text.collate([row(8), row(8)])
    assert batch["input_ids"].shape == batch["loss_mask"].shape == (2, 8)
    with pytest.raises(
        ValueError,
        match=r"collate: row 2's 'input_ids' has shape \(6,\), but row 0's has \(8,\); .*"
        r"rc\.text\.padded .*your own collate_fn",
    ):
        rc.text.collate([row(8), row(8), row(6), row(5)])
    with pytest.raises(ValueError, match=r"collate: row 1 has key 'labels', which row 0 lacks"):
        rc.text.collate([row(8), row(8, labels=np.zeros(8))])
    with pytest.raises(ValueError, match=r"collate: row 1 lacks key 'labels', which row 0 has"):
        rc.text.collate([row(8, labels=np.zeros(8)), row(8)])


def test_tokenize_prints_its_bytes_to_a_log(tok, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    Path("a.txt").write_text("hello world\n" * 100)
    rc.text.tokenize(Path("a.txt"), tok, "tokens")
    (line,) = capsys.readouterr().out.splitlines()  # stdout is no terminal: one line, at the end
    assert re.fullmatch(r"tokenize a\.txt: 1\.2 kB/1\.2 kB \(100%\), [\d.]+ [kMG]?B/s", line), line


def test_a_symlink_beside_its_file_is_tokenized_once(tok, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = _docs(2)
    for i, doc in enumerate(docs):
        (corpus / f"{i}.txt").write_text(doc)
    (corpus / "2.txt").symlink_to(corpus / "0.txt")  # the same file under another name
    tokens = rc.text.tokenize(corpus, tok, tmp_path / "tokens", progress=False)
    assert tokens.meta["files"] == [str(corpus / "0.txt"), str(corpus / "1.txt")]
    np.testing.assert_array_equal(np.asarray(tokens.tokens), _reference_tokens(tok, docs))


def test_a_missing_tokenizer_package_names_what_to_install(monkeypatch):
    from redcoast.text import _tokenizer

    for module, fix in (("tokenizers", "pip install tokenizers"), ("transformers", "redcoast[hf]")):
        monkeypatch.setitem(sys.modules, module, None)  # `import` fails as if not installed
        with pytest.raises(ImportError, match=re.escape(fix)):
            _tokenizer._import(module)
    # In the default install, not behind an extra.
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert any(d.startswith("tokenizers") for d in project["project"]["dependencies"])
