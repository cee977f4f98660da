"""rc.eval: the LM Evaluation Harness on redcoast's sharded model, scored as its `hf`
backend scores the same checkpoint."""

import json
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from click.testing import CliRunner
from tiny_checkpoint import tiny_gpt2

import redcoast as rc

pytest.importorskip("torch")
lm_eval = pytest.importorskip("lm_eval")
rce = pytest.importorskip("redcoast.eval")

POSITIONS = 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny GPT-2 of 64 positions: the shipped tasks' prompts are longer, so they are
    truncated, and their functions are scored over several windows."""
    return tiny_gpt2(tmp_path_factory.mktemp("gpt2"), positions=POSITIONS)


@pytest.fixture(scope="module")
def model(folder):
    return rc.models.from_hf(folder)


def _requests(rng, n, vocab=400):
    """`n` (context, continuation) pairs of 1-40 and 1-30 tokens, some longer than the
    model's context, every third continuing the context of the one before (as a
    question's choices do)."""
    out = []
    for i in range(n):
        context = rng.integers(0, vocab, int(rng.integers(1, 41)) + 40 * (i % 4 == 0)).tolist()
        context = out[-1][0] if i % 3 == 2 else context
        out.append((context, rng.integers(0, vocab, int(rng.integers(1, 31))).tolist()))
    return out


def test_loglikelihoods_equal_the_log_softmax_of_the_last_tokens(model):
    requests = _requests(np.random.default_rng(0), 11)
    got = rce.loglikelihoods(model, requests, max_length=POSITIONS, per_device_batch_size=1)
    assert any(len(c) + len(x) > POSITIONS + 1 for c, x in requests)  # some are truncated
    rows = [(c + x)[-(POSITIONS + 1) :] for c, x in requests]
    ids, _ = rc.sampling.pad_prompts([r[:-1] for r in rows], multiple=POSITIONS)
    logits = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(model, ids)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    for (_, continuation), row, p, (logprob, greedy) in zip(requests, rows, logp, got, strict=True):
        scored = p[len(row) - 1 - len(continuation) : len(row) - 1]
        expected = float(scored[jnp.arange(len(continuation)), jnp.array(continuation)].sum())
        assert logprob == pytest.approx(expected, abs=1e-4)
        assert greedy == bool((scored.argmax(-1) == jnp.array(continuation)).all())


def test_a_greedy_continuation_counts_as_greedy(model):
    context = [5, 6, 7, 8]
    new = np.asarray(rc.models.generate(model, jnp.array([context]), max_new_tokens=3))[0]
    [(_, greedy)] = rce.loglikelihoods(model, [(context, new.tolist())], max_length=POSITIONS)
    assert greedy


def test_requests_that_cannot_be_scored_are_refused(model):
    with pytest.raises(ValueError, match="more than the model reads at once"):
        rce.loglikelihoods(model, [([1], [2] * (POSITIONS + 1))], max_length=POSITIONS)
    with pytest.raises(ValueError, match="at least one token"):
        rce.loglikelihoods(model, [([], [2])], max_length=POSITIONS)


def test_continuations_in_rounds_equal_one_generation(model):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    ids, lengths = rc.sampling.pad_prompts(prompts, multiple=8)
    whole = np.asarray(
        rc.models.generate(model, ids, prompt_lengths=lengths, max_new_tokens=12)
    ).tolist()
    got = rce.continuations(model, prompts, max_new_tokens=12, first_round=4)
    assert got == whole  # rounds of 4 and 8 tokens
    # Rows whose tokens are done stop at the end of that round.
    done = rce.continuations(model, prompts, max_new_tokens=12, first_round=4, done=lambda t: True)
    assert done == [w[:4] for w in whole]
    eos = whole[0][2]
    ended = rce.continuations(model, prompts, max_new_tokens=12, first_round=4, eos_id=eos)
    assert ended[0] == whole[0][: whole[0].index(eos) + 1]


def test_a_sharded_model_scores_as_one_device(folder, model):
    requests = _requests(np.random.default_rng(1), 9)
    prompts = [c[:20] for c, _ in requests[:4]]
    one = rc.make_mesh(1, devices=jax.devices()[:1])
    expected = rce.loglikelihoods(model, requests, max_length=POSITIONS, mesh=one)
    new = rce.continuations(model, prompts, max_new_tokens=12, mesh=one)
    mesh = rc.make_mesh(2)
    sharded = rc.models.from_hf(folder, mesh=mesh)
    fsdp = rc.models.from_hf(folder, mesh=mesh, fsdp=True)  # weights over the data axis too
    for split in (sharded, fsdp):
        got = rce.loglikelihoods(split, requests, max_length=POSITIONS, per_device_batch_size=1)
        for (a, greedy_a), (b, greedy_b) in zip(got, expected, strict=True):
            assert a == pytest.approx(b, abs=1e-4)
            assert greedy_a == greedy_b
    assert rce.continuations(sharded, prompts, max_new_tokens=12, per_device_batch_size=1) == new


def test_lm_eval_finds_redcoast_and_keeps_its_own_models():
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    assert get_model("redcoast") is rce.RedcoastLM
    assert rc.eval is rce  # imported on first use, not by `import redcoast`
    assert get_model("hf") is HFLM


def test_bad_settings_say_what_to_do(folder, model):
    with pytest.raises(ValueError, match="not both"):
        rce.RedcoastLM(str(folder), model=model)
    with pytest.raises(ValueError, match="tokenizer"):
        rce.RedcoastLM(model=model)
    with pytest.raises(ValueError, match="positions"):
        rce.harness(model, str(folder), max_length=POSITIONS + 1)
    lm = rce.harness(model, str(folder))
    assert lm.max_length == POSITIONS  # GPT-2's n_positions, as the hf backend reads it
    with pytest.raises(ValueError, match="num_beams"):
        lm._generate(["def f():"], {"until": ["\n"], "num_beams": 4})
    with pytest.raises(ValueError, match="no room"):
        lm._generate(["def f():"], {"until": ["\n"], "max_gen_toks": POSITIONS})


def test_chat_templates_are_applied_as_the_hf_backend_applies_them(folder, model):
    import transformers
    from lm_eval.models.huggingface import HFLM

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    theirs = HFLM(pretrained=str(folder), tokenizer=tokenizer, device="cpu")
    ours = rce.harness(model, tokenizer)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f("}]
    for prompt in (True, False):
        assert ours.apply_chat_template(chat, prompt) == theirs.apply_chat_template(chat, prompt)
    assert ours.apply_chat_template(chat) == "<user>def f(\n<assistant>"


def test_the_command_prints_the_table_and_writes_the_results(folder, tmp_path):
    from redcoast.cli import main

    out = tmp_path / "results.json"
    args = [str(folder), "--tasks", "redcoast_stdlib_choice", "--limit", "6", "--batch-size", "2"]
    result = CliRunner().invoke(main, ["eval", *args, "-n", "2", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "redcoast_stdlib_choice" in result.output and "acc" in result.output
    scores = json.loads(out.read_text())["results"]["redcoast_stdlib_choice"]
    assert 0.0 <= scores["acc,none"] <= 1.0
    bad = CliRunner().invoke(main, ["eval", str(folder), "--log-samples"])
    assert bad.exit_code != 0 and "--output" in bad.output


def _evaluate(model, folder, **how):
    return lm_eval.simple_evaluate(
        model=model,
        tasks=["redcoast"],
        task_manager=rce.task_manager(),
        limit=10,
        log_samples=True,
        **how,
    )


def test_scores_equal_the_hf_backend(folder):
    """Every request of the shipped tasks (multiple choice, rolling perplexity, generation
    to a stop sequence), on a model whose context truncates them, as lm-eval's `hf`
    backend scores them on the same checkpoint."""
    ours = _evaluate("redcoast", folder, model_args=f"path={folder},n_model_shards=2")
    theirs = _evaluate("hf", folder, model_args=f"pretrained={folder}", device="cpu")
    for task in ("redcoast_stdlib_choice", "redcoast_stdlib_source", "redcoast_stdlib_line"):
        mine, ref = ours["samples"][task], theirs["samples"][task]
        assert len(mine) == len(ref) == 10
        for a, b in zip(mine, ref, strict=True):
            assert a["doc_id"] == b["doc_id"]
            for x, y in zip(a["resps"], b["resps"], strict=True):
                if task == "redcoast_stdlib_line":
                    assert x == y  # the same greedy text, cut at the same stop
                elif task == "redcoast_stdlib_choice":
                    assert x[0][0] == pytest.approx(y[0][0], abs=1e-4)
                    assert x[0][1] == y[0][1]
                else:
                    assert x[0] == pytest.approx(y[0], abs=1e-4)
        for metric, value in ours["results"][task].items():
            if isinstance(value, float) and math.isfinite(value) and "stderr" not in metric:
                assert value == pytest.approx(theirs["results"][task][metric], rel=1e-4)
    # The prompts were longer than the context: the scores above include truncation.
    assert any(
        len(s["doc"]["context"]) > 4 * POSITIONS for s in ours["samples"]["redcoast_stdlib_choice"]
    )


def test_fit_scores_the_harness_tasks_on_the_live_model_beside_the_loss(folder, model, tmp_path):
    rows = [{"input_ids": np.arange(i, i + 32) % 400} for i in range(16)]
    score = rce.harness_metrics(str(folder), ["redcoast_stdlib_choice"], limit=4)
    evaluation = rc.Evaluation(
        model_fn=score, every=2, save_best=("redcoast_stdlib_choice/acc", "max")
    )
    result = rc.fit(
        model,
        optax.sgd(1e-2),
        rows,
        collate_fn=rc.text.collate,
        loss_fn=rc.models.lm_loss,
        mesh=rc.make_mesh(2),
        per_device_batch_size=1,
        max_steps=2,
        evaluation=evaluation,
        workdir=str(tmp_path / "run"),
        progress=False,
    )
    (record,) = result.history["eval"]
    assert record["step"] == 2
    assert 0.0 <= record["eval_redcoast_stdlib_choice/acc"] <= 1.0
    assert "eval_redcoast_stdlib_choice/acc_norm" in record and "eval_loss" not in record
    assert result.history["best"]["metric"] == "redcoast_stdlib_choice/acc"
    with pytest.raises(ValueError, match="pass examples"):
        rc.Evaluation(model_fn=score, pred_fn=lambda m, b, k: b)


def test_the_commands_tasks_are_names_yaml_files_and_folders(tmp_path):
    import click

    from redcoast._eval_command import _tasks

    yaml = rce.TASKS / "redcoast_stdlib_line.yaml"
    names, folders = _tasks(f"hellaswag, {yaml},{tmp_path}", ("extra",))
    assert names[0] == "hellaswag" and names[1]["task"] == "redcoast_stdlib_line"
    assert callable(names[1]["custom_dataset"])  # its !function read from beside the file
    assert folders == ["extra", str(tmp_path)]
    with pytest.raises(click.UsageError, match="no task"):
        _tasks(" , ", ())


def test_the_command_names_a_folder_that_holds_no_checkpoint(tmp_path):
    from redcoast.cli import main

    result = CliRunner().invoke(main, ["eval", str(tmp_path), "--tasks", "redcoast"])
    assert result.exit_code == 1 and "no config.json" in result.output
