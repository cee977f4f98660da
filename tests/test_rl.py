"""RL runs (`rc.rl.train`): a sharded run equals one device, a resumed run draws the same
completions and ends as the uninterrupted one, rows join prompt and completion, and
reward functions that misbehave are named with the prompt.

The losses and advantages against TRL are `test_rl_losses.py`'s; sampling is
`test_sampling.py`'s.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redcoast as rc
from redcoast.rl._rewards import score
from redcoast.rl._rollout import _join

EOS = "<eos>"


@pytest.fixture(scope="module")
def tok():
    """A byte-level tokenizer of single characters (no merges) and an end token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 1, special_tokens=[EOS])
    t.train_from_iterator(["0123456789+="], trainer)
    return rc.text.load_tokenizer(t, eos_id=t.token_to_id(EOS))


def _model(tok, seed=0):
    config = rc.models.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return rc.models.Llama(config, key=jax.random.key(seed))


TASKS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]


def correct(prompts, completions, answer, **_):
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def short(prompts, completions, **_):
    return [-len(c) / 8 for c in completions]


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))]


def _run(tok, model, mesh, per_device, **options):
    algorithm = options.pop(
        "algorithm", rc.rl.GRPO(num_generations=4, max_new_tokens=5, beta=0.05, num_iterations=2)
    )
    return rc.rl.train(
        model,
        options.pop("optimizer", optax.adam(3e-3)),
        TASKS,
        rewards=[correct, short],
        tokenizer=tok,
        per_device_batch_size=per_device,
        algorithm=algorithm,
        mesh=mesh,
        log_every=1,
        progress=False,
        **options,
    )


@pytest.mark.parametrize("how", ["tp-fsdp", "lora"])
def test_a_sharded_run_equals_one_device(tok, how):
    """The same completions, losses, rewards and parameters on one device and on a 2x4
    mesh (tensor parallel with FSDP; LoRA with the reference its adapters switched off)."""
    model = _model(tok)
    options = {}
    if how == "lora":
        model = rc.lora.apply(
            model, ["q_proj", "v_proj", "down_proj"], rank=4, key=jax.random.key(1)
        )
        options["trainable"] = rc.lora.trainable(model)
    # SGD: each parameter moves by its gradient (Adam's step on a gradient near zero is
    # +-lr whichever its last digits, which another summation order changes).
    options["optimizer"] = optax.sgd(0.5)
    one = _run(tok, model, rc.make_mesh(1, devices=jax.devices()[:1]), 4, max_steps=2, **options)
    split = _run(tok, model, rc.make_mesh(2), 1, max_steps=2, fsdp=how == "tp-fsdp", **options)
    for a, b in zip(one.history["train"], split.history["train"], strict=True):
        for k in ("reward", "completions/mean_length", "loss", "grad_norm"):
            np.testing.assert_allclose(a[k], b[k], rtol=2e-4, atol=2e-6, err_msg=k)
        # A full fine-tune's reference is a bfloat16 copy, summed in another order.
        np.testing.assert_allclose(a["kl"], b["kl"], rtol=2e-3, atol=1e-5)
    assert one.history["train"][-1]["kl"] > 0  # the reference is another model by then
    for x, y in zip(_params(one.model), _params(split.model), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-5)
    before, after = _params(model), _params(one.model)
    assert max(np.abs(x - y).max() for x, y in zip(before, after, strict=True)) > 1e-3


@pytest.mark.slow
def test_a_resumed_run_draws_the_same_completions_and_ends_alike(tok, tmp_path):
    mesh = rc.make_mesh(2)
    every = rc.Checkpointing(every=2)
    straight = _run(tok, _model(tok), mesh, 1, max_steps=4, workdir=tmp_path / "a")
    _run(tok, _model(tok), mesh, 1, max_steps=2, workdir=tmp_path / "b", checkpointing=every)
    resumed = _run(tok, _model(tok), mesh, 1, max_steps=4, workdir=tmp_path / "b", resume=True)
    assert [r["step"] for r in resumed.history["train"]] == [1, 2, 3, 4]
    for a, b in zip(straight.history["train"][2:], resumed.history["train"][2:], strict=True):
        for k in ("reward", "rewards/short/mean", "completions/mean_length", "loss"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=k)
    for x, y in zip(_params(straight.model), _params(resumed.model), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_rows_join_each_prompt_and_its_completion():
    prompts = jnp.array([[5, 6, 7], [8, 9, 0]])
    lengths = jnp.array([3, 2])
    tokens = jnp.array([[1, 2, 3, 4], [1, 9, 9, 9], [3, 9, 9, 9], [2, 2, 9, 9]])
    ends = jnp.array([4, 2, 2, 3])  # rows 1-3 end with the end token 9; row 0 is cut off
    ids, mask, per_row = _join(
        prompts, lengths, tokens, ends, group=2, pad_id=9, mask_truncated=False
    )
    np.testing.assert_array_equal(
        ids,
        [
            [5, 6, 7, 1, 2, 3, 4],
            [5, 6, 7, 1, 9, 9, 9],
            [8, 9, 3, 9, 9, 9, 9],
            [8, 9, 2, 2, 9, 9, 9],
        ],
    )
    np.testing.assert_array_equal(
        mask,
        [
            [0, 0, 0, 1, 1, 1, 1],
            [0, 0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1, 0, 0],
        ],
    )
    np.testing.assert_allclose(per_row, np.full(4, 11 / 4))
    _, cut, _ = _join(prompts, lengths, tokens, ends, group=2, pad_id=9, mask_truncated=True)
    assert not np.asarray(cut[0]).any() and (np.asarray(cut[1:]) == np.asarray(mask[1:])).all()


def test_reward_functions_that_misbehave_are_named_with_the_prompt():
    prompts, completions = ["1+1=", "2+2="], ["2", "5"]
    fields = {"answer": ["2", "4"]}
    got = score([correct, lambda prompts, completions, **_: [None, 0.5]], ["correct", "half"],
                prompts, completions, fields)  # fmt: skip
    np.testing.assert_array_equal(got, [[1.0, np.nan], [0.0, 0.5]])

    def breaks_on_the_second(prompts, completions, **_):
        return [1.0 / (p != "2+2=") for p in prompts]

    def returns(value):
        return lambda prompts, completions, **_: value

    cases = [
        (breaks_on_the_second, RuntimeError, "raised ZeroDivisionError.*'2\\+2='"),
        (returns([1.0]), ValueError, "returned 1 values for 2 completions"),
        (returns([1.0, float("nan")]), ValueError, "returned nan .*'2\\+2='"),
        (returns([1.0, "yes"]), ValueError, "returned 'yes' \\(str\\)"),
        (returns(3.0), ValueError, "returned not a sequence"),
    ]
    for fn, error, message in cases:
        with pytest.raises(error, match=message):
            score([fn], [getattr(fn, "__name__", "fn")], prompts, completions, fields)


def test_bad_input_says_what_to_do(tok, tmp_path):
    model = _model(tok)
    with pytest.raises(ValueError, match=re.escape("prompt record 1 has no 'prompt'")):
        rc.rl.load_prompts([{"prompt": "1+1="}, {"question": "2+2="}])
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{"prompt": \n')
    with pytest.raises(ValueError, match=f"{re.escape(str(bad))}, line 2: not JSON"):
        rc.rl.load_prompts(bad)
    with pytest.raises(ValueError, match="sets \\['loss_fn'\\] itself"):
        _run(tok, model, rc.make_mesh(1), 1, max_steps=1, loss_fn=None)
    with pytest.raises(ValueError, match="reference='lora' is the model with its LoRA adapters"):
        _run(tok, model, rc.make_mesh(1), 1, max_steps=1, reference="lora")
    with pytest.raises(ValueError, match="reference must be 'auto', 'lora', 'copy'"):
        _run(tok, model, rc.make_mesh(1), 1, max_steps=1, reference="frozen")
    with pytest.raises(ValueError, match="RLOO: num_generations must be >= 2"):
        rc.rl.RLOO(num_generations=1)
