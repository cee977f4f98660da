"""RL from verifiable rewards: GRPO's and RLOO's advantages and policy losses against TRL.

The parity tests run TRL 1.16's own trainers on a tiny random LLaMA that
`transformers` saved and `rc.models.from_hf` loaded: `GRPOTrainer._compute_loss` and
`RLOOTrainer._compute_loss` on the batch below, and `_generate_and_score_completions`
(its completions fixed, by GRPO's `rollout_func` or in place of RLOO's `_generate`;
its reward functions returning fixed rewards) for the advantages.
"""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import TypeCheckError

import redcoast as rc
from redcoast import rl

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

VOCAB, PAD, EOS = 64, 0, 1
PROMPTS, G, PROMPT_LEN, MAX_COMPLETION = 3, 4, 5, 10
ROWS, SEQ = PROMPTS * G, PROMPT_LEN + MAX_COMPLETION
LLAMA = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": PAD,
    "eos_token_id": EOS,
    "bos_token_id": 2,
}
# Per row: the completion's length, and whether it ends in EOS (those that do not were
# cut at MAX_COMPLETION).
LENGTHS = [3, 10, 1, 7, 10, 5, 2, 9, 10, 4, 6, 8]
ENDS_IN_EOS = [True, False, True, True, True, True, True, True, False, True, True, True]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Two tiny random LLaMAs (policy, reference) saved by `transformers`, and a tokenizer
    of `t0 ... t63`."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("hf")
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(**LLAMA)
        transformers.LlamaForCausalLM(config).save_pretrained(folder / name)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token=f"t{EOS}", pad_token=f"t{PAD}", bos_token="t2"
    )
    return folder, tok


@pytest.fixture(scope="module")
def models(hf):
    folder, _ = hf
    return rc.models.from_hf(folder / "policy"), rc.models.from_hf(folder / "reference")


LOGPS = eqx.filter_jit(rl.token_logps)


@pytest.fixture(scope="module")
def rollout(models):
    """The batch, in redcoast's layout (`_trl_inputs` gives TRL's).

    Prompts are of equal length: TRL left-pads them without position ids, so a
    shorter prompt's tokens would sit at other positions than in a right-padded row.
    `old_logps` and `ref_logps` are the policy's own plus noise (0.3 a token), so that
    ratios leave the clip range; at positions that do not count they hold junk, which
    no loss may read (TRL has zeros there)."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, VOCAB, (PROMPTS, PROMPT_LEN))
    ids = np.full((ROWS, SEQ), PAD, np.int32)
    mask = np.zeros((ROWS, SEQ), np.int32)
    for row, (n, eos) in enumerate(zip(LENGTHS, ENDS_IN_EOS, strict=True)):
        ids[row, :PROMPT_LEN] = prompts[row // G]
        ids[row, PROMPT_LEN : PROMPT_LEN + n] = rng.integers(3, VOCAB, n)
        if eos:
            ids[row, PROMPT_LEN + n - 1] = EOS
        mask[row, PROMPT_LEN : PROMPT_LEN + n] = 1
    logps = np.asarray(LOGPS(models[0], ids))
    counted = mask > 0
    junk = rng.uniform(-60, 60, (2, ROWS, SEQ))
    old = np.where(counted, logps + 0.3 * rng.normal(size=logps.shape), junk[0])
    ref = np.where(counted, logps + 0.3 * rng.normal(size=logps.shape), junk[1])
    batch = {
        "input_ids": ids,
        "completion_mask": mask,
        "advantages": rng.normal(size=ROWS).astype(np.float32),
        "old_logps": old.astype(np.float32),
        "ref_logps": ref.astype(np.float32),
        "tokens_per_row": np.full(ROWS, mask.sum() / ROWS, np.float32),
    }
    return batch


def _trl_inputs(batch, keys=("old_logps", "ref_logps")):
    """The batch as TRL's trainers receive it from `_generate_and_score_completions`."""
    import torch

    mask = batch["completion_mask"][:, PROMPT_LEN:]
    as_long = lambda x: torch.tensor(np.asarray(x, np.int64))  # noqa: E731
    per_token = lambda x: torch.tensor(np.where(mask > 0, x[:, PROMPT_LEN:], 0.0))  # noqa: E731
    inputs = {
        "prompt_ids": as_long(batch["input_ids"][:, :PROMPT_LEN]),
        "prompt_mask": torch.ones(ROWS, PROMPT_LEN, dtype=torch.int64),
        "completion_ids": as_long(batch["input_ids"][:, PROMPT_LEN:]),
        "completion_mask": as_long(mask),
        "advantages": torch.tensor(batch["advantages"]),
        "num_items_in_batch": torch.tensor(mask.sum()),
    }
    names = {"old_logps": "old_per_token_logps", "ref_logps": "ref_per_token_logps"}
    for key in keys:
        inputs[names[key]] = per_token(batch[key]).float()
    return inputs


def _trl_args(tmp_path, config, **kw):
    settings = {
        "output_dir": str(tmp_path),
        "report_to": [],
        "use_cpu": True,
        "bf16": False,  # TRL defaults to bfloat16 autocast where the CPU has it
        "per_device_train_batch_size": ROWS,
        "num_generations": G,
        "gradient_accumulation_steps": 1,
        "max_completion_length": MAX_COMPLETION,
    }
    return config(**(settings | kw))


def _torch_policy(hf, reference=False):
    """The policy as TRL loads it; with `reference`, one whose reference (which TRL
    loads from the policy's `_name_or_path`) is the other LLaMA."""
    import transformers

    folder, _ = hf
    model = transformers.AutoModelForCausalLM.from_pretrained(folder / "policy")
    if reference:
        model.config._name_or_path = str(folder / "reference")
    return model


def _no_reward(prompts, completions, **kwargs):
    return [0.0] * len(prompts)


def _logged(trainer):
    return {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _torch_grads(model, loss):
    """The gradients of the two ends of the network, as numpy: the output head and
    the token table (whose gradient has come through every layer)."""
    import torch

    head, table = torch.autograd.grad(loss, [model.lm_head.weight, model.model.embed_tokens.weight])
    return head.numpy(), table.numpy()


def _assert_close(ours, theirs, keys, tol=1e-5):
    for k in keys:
        np.testing.assert_allclose(float(ours[k]), float(theirs[k]), rtol=tol, atol=tol, err_msg=k)


def _assert_grads_close(grads, theirs):
    for ours, want in zip((grads.lm_head.weight, grads.embed_tokens.weight), theirs, strict=True):
        np.testing.assert_allclose(np.asarray(ours), want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- log-probs


def test_token_logps_are_each_tokens_log_probability_given_those_before(hf, models, rollout):
    torch = pytest.importorskip("torch")
    ids = rollout["input_ids"]
    ours = np.asarray(eqx.filter_jit(rl.token_logps)(models[0], ids, temperature=0.7))
    with torch.no_grad():
        logits = _torch_policy(hf)(torch.tensor(ids.astype(np.int64))).logits / 0.7
    want = torch.log_softmax(logits.double(), -1)[:, :-1].gather(
        -1, torch.tensor(ids[:, 1:, None].astype(np.int64))
    )
    assert ours.dtype == np.float32 and ours.shape == (ROWS, SEQ)
    np.testing.assert_array_equal(ours[:, 0], 0.0)
    np.testing.assert_allclose(ours[:, 1:], want[..., 0].numpy(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- GRPO's loss

# (id, policy_loss's settings = GRPOConfig's, the batch's optional keys)
CASES = [
    ("dapo", {}, ("old_logps",)),
    ("dapo-on-policy", {}, ()),
    ("dapo-kl", {"beta": 0.05}, ("old_logps", "ref_logps")),
    (
        "grpo-kl-uncorrected-hot",
        {
            "loss_type": "grpo",
            "beta": 0.05,
            "use_bias_correction_kl": False,
            "temperature": 0.7,
            "epsilon_high": 0.28,
        },
        ("old_logps", "ref_logps"),
    ),
    ("bnpo-delta", {"loss_type": "bnpo", "epsilon": 0.1, "delta": 1.25}, ("old_logps",)),
    ("dr_grpo", {"loss_type": "dr_grpo", "max_completion_length": MAX_COMPLETION}, ("old_logps",)),
    ("cispo", {"loss_type": "cispo", "epsilon_high": 1.2}, ("old_logps",)),
    ("sapo-kl", {"loss_type": "sapo", "beta": 0.05}, ("old_logps", "ref_logps")),
    (
        "gspo-kl",
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.05},
        ("old_logps", "ref_logps"),
    ),
    ("luspo", {"loss_type": "luspo", "importance_sampling_level": "sequence"}, ("old_logps",)),
    ("vespo", {"loss_type": "vespo"}, ("old_logps",)),
    ("dapo-sequence", {"importance_sampling_level": "sequence"}, ("old_logps",)),
]
CLIP_METRICS = [
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
]


def _expected_metrics(settings):
    loss_type = settings.get("loss_type", "dapo")
    keys = ["entropy"] + (["kl"] if settings.get("beta") else [])
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        keys += CLIP_METRICS
    keys += {"cispo": ["cispo_clip_ratio"], "vespo": ["vespo/phi_seq_mean"]}.get(loss_type, [])
    return keys


@pytest.mark.filterwarnings("ignore::UserWarning")  # TRL's: the tokenizer has no chat template
@pytest.mark.parametrize(("settings", "keys"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_policy_loss_and_its_gradient_equal_trls_grpo_trainer(
    hf, models, rollout, tmp_path, settings, keys
):
    trl = pytest.importorskip("trl")
    batch = {k: v for k, v in rollout.items() if k not in ("old_logps", "ref_logps") or k in keys}
    loss_fn = functools.partial(rl.policy_loss, **settings)
    grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn, has_aux=True))
    if settings.get("importance_sampling_level") == "sequence" and "loss_type" not in settings:
        with pytest.warns(UserWarning, match="weights each completion by its length"):
            (loss, metrics), grads = grad_fn(models[0], batch)
    else:
        (loss, metrics), grads = grad_fn(models[0], batch)

    trainer = trl.GRPOTrainer(
        model=_torch_policy(hf),
        reward_funcs=_no_reward,
        args=_trl_args(tmp_path, trl.GRPOConfig, **settings),
        train_dataset=_prompt_dataset(),
        processing_class=hf[1],
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # as Trainer's loop sets it
    want = trainer._compute_loss(trainer.model, _trl_inputs(rollout, keys))
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    expected = _expected_metrics(settings)
    assert sorted(metrics) == sorted(expected)
    assert all(v.dtype == jnp.float32 and v.shape == () for v in metrics.values())
    _assert_close(metrics, _logged(trainer), expected)
    _assert_grads_close(grads, _torch_grads(trainer.model, want))
    # The clips and weights are exercised: some tokens are clipped, not all.
    for name in ("clip_ratio/region_mean", "cispo_clip_ratio"):
        if name in metrics and "old_logps" in keys:
            assert 0 < float(metrics[name]) < 1, name
    if "vespo/phi_seq_mean" in metrics:
        assert abs(float(metrics["vespo/phi_seq_mean"]) - 1) > 0.01


def _prompt_dataset():
    import datasets

    return datasets.Dataset.from_list([{"prompt": "t3 t4"}] * PROMPTS)


def test_dapo_is_the_steps_token_mean_however_the_step_splits_the_batch(models, rollout):
    """`rc.train_step` averages its micro-batches' gradients; with `tokens_per_row`,
    DAPO's step is the same over 1 or 3 micro-batches."""
    batch = {k: v for k, v in rollout.items() if k != "ref_logps"}
    opt = optax.sgd(1.0)
    heads, losses = [], []
    for accumulate in (1, 3):
        step = rc.train_step(rl.policy_loss, opt, accumulate_grad_batches=accumulate)
        model = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, models[0])
        state = opt.init(eqx.filter(model, eqx.is_inexact_array))
        model, _, metrics = step(model, state, batch, jax.random.key(0))
        heads.append(np.asarray(model.lm_head.weight))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    np.testing.assert_allclose(heads[1], heads[0], rtol=1e-5, atol=1e-7)
    assert not np.allclose(heads[0], np.asarray(models[0].lm_head.weight))  # a step was taken


# ----------------------------------------------------------------------------- RLOO's loss


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("on_policy", [False, True], ids=["old-logps", "on-policy"])
def test_rloo_loss_and_its_gradient_equal_trls_rloo_trainer(
    hf, models, rollout, tmp_path, on_policy
):
    trl = pytest.importorskip("trl")
    import torch

    batch = {k: v for k, v in rollout.items() if k != "ref_logps"}
    if on_policy:
        del batch["old_logps"]
    loss_fn = functools.partial(rl.rloo_loss, epsilon=0.1, epsilon_high=0.15)
    (loss, metrics), grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn, has_aux=True))(
        models[0], batch
    )
    trainer = trl.RLOOTrainer(
        model=_torch_policy(hf),
        reward_funcs=_no_reward,
        args=_trl_args(tmp_path, trl.RLOOConfig, epsilon=0.1, epsilon_high=0.15),
        train_dataset=_prompt_dataset(),
        processing_class=hf[1],
    )
    trainer.model.train()
    inputs = _trl_inputs(rollout, ())
    mask = batch["completion_mask"] > 0
    # On policy, TRL's generation step computes them from the very same policy.
    old = np.asarray(LOGPS(models[0], batch["input_ids"])) if on_policy else batch["old_logps"]
    inputs["old_logps"] = torch.tensor(np.where(mask, old, 0.0).sum(-1)).float()
    want = trainer._compute_loss(trainer.model, inputs)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    assert sorted(metrics) == sorted(["entropy", *CLIP_METRICS])
    _assert_close(metrics, _logged(trainer), list(metrics))
    _assert_grads_close(grads, _torch_grads(trainer.model, want))
    if not on_policy:
        assert 0 < float(metrics["clip_ratio/region_mean"]) < 1


# ----------------------------------------------------------------------------- advantages

NAN = math.nan
# Two reward functions over the 3 x 4 completions, NaN where one returned None: prompt 1's
# group is flat (no signal), and row 8 no function scored.
REWARDS = np.array(
    [
        [1.0, 0.5],
        [0.0, NAN],
        [1.0, -0.2],
        [1.0, 0.3],
        [0.0, NAN],
        [0.0, NAN],
        [0.0, NAN],
        [0.0, NAN],
        [NAN, NAN],
        [1.0, 0.7],
        [0.0, 0.1],
        [0.5, NAN],
    ]
)
WEIGHTS = [1.0, 0.5]
NAMES = ["correct", "formatted"]


def _reward_functions():
    def column(i):
        def reward(prompts, completions, **kwargs):
            assert len(completions) == ROWS
            return [None if math.isnan(x) else float(x) for x in REWARDS[:, i]]

        reward.__name__ = NAMES[i]
        return reward

    return [column(0), column(1)]


def _fixed_completions(batch):
    """Each row's prompt and completion ids, as a sampler returns them (cut at EOS)."""
    ids, mask = batch["input_ids"], batch["completion_mask"] > 0
    prompts = [row[:PROMPT_LEN].tolist() for row in ids]
    return prompts, [row[m].tolist() for row, m in zip(ids, mask, strict=True)]


def _trl_prompts():
    return [{"prompt": f"prompt {g}"} for g in range(PROMPTS) for _ in range(G)]


ADVANTAGE_CASES = {
    "group": {"scale_rewards": "group"},
    "batch": {"scale_rewards": "batch"},
    "none": {"scale_rewards": "none"},
    "normalize_then_sum": {"aggregation": "normalize_then_sum"},
}


@pytest.mark.parametrize("case", list(ADVANTAGE_CASES))
def test_group_advantages_equal_trls_grpo_trainer(hf, rollout, tmp_path, monkeypatch, case):
    trl = pytest.importorskip("trl")
    settings = ADVANTAGE_CASES[case]
    ours, metrics = rl.group_advantages(REWARDS, G, weights=WEIGHTS, names=NAMES, **settings)

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    prompt_ids, completion_ids = _fixed_completions(rollout)

    def rollout_func(prompts, trainer):
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    trl_settings = {k: v for k, v in settings.items() if k != "aggregation"}
    if "aggregation" in settings:
        trl_settings["multi_objective_aggregation"] = settings["aggregation"]
    trainer = trl.GRPOTrainer(
        model=_torch_policy(hf),
        reward_funcs=_reward_functions(),
        args=_trl_args(tmp_path, trl.GRPOConfig, reward_weights=WEIGHTS, **trl_settings),
        train_dataset=_prompt_dataset(),
        processing_class=hf[1],
        rollout_func=rollout_func,
    )
    trainer.model.train()
    out = trainer._generate_and_score_completions(_trl_prompts())
    assert ours.dtype == np.float32 and ours.shape == (ROWS,)
    np.testing.assert_allclose(ours, out["advantages"].numpy(), rtol=1e-5, atol=1e-5)
    names = [f"rewards/{n}/{s}" for n in NAMES for s in ("mean", "std")]
    expected = [*names, "reward", "reward_std", "frac_reward_zero_std"]
    assert sorted(metrics) == sorted(expected)
    _assert_close(metrics, _logged(trainer), expected)
    assert ours[8] == 0.0  # unscored
    if case == "group":
        np.testing.assert_array_equal(ours[4:8], 0.0)  # the flat group
        assert metrics["frac_reward_zero_std"] == pytest.approx(1 / 3)


RLOO_CASES = {
    "plain": {"beta": 0.0},
    "kl-normalized-clipped": {"beta": 0.3, "normalize": True, "reward_clip_range": (-0.1, 0.9)},
}


@pytest.mark.parametrize("case", list(RLOO_CASES))
def test_rloo_advantages_equal_trls_rloo_trainer(hf, models, rollout, tmp_path, case):
    trl = pytest.importorskip("trl")
    settings = RLOO_CASES[case]
    ids, mask = rollout["input_ids"], rollout["completion_mask"]
    logps = LOGPS(models[0], ids) if settings["beta"] else None
    ref_logps = LOGPS(models[1], ids) if settings["beta"] else None
    ours, metrics = rl.rloo_advantages(
        REWARDS,
        G,
        weights=WEIGHTS,
        names=NAMES,
        logps=logps,
        ref_logps=ref_logps,
        completion_mask=mask,
        **settings,
    )

    trl_settings = {k: v for k, v in settings.items() if k != "normalize"}
    trl_settings["normalize_advantages"] = settings.get("normalize", False)
    trainer = trl.RLOOTrainer(
        model=_torch_policy(hf, reference=True),
        reward_funcs=_reward_functions(),
        args=_trl_args(tmp_path, trl.RLOOConfig, reward_weights=WEIGHTS, **trl_settings),
        train_dataset=_prompt_dataset(),
        processing_class=hf[1],
    )
    trainer.model.train()
    prompt_ids, completion_ids = _fixed_completions(rollout)
    completions = hf[1].batch_decode(completion_ids, skip_special_tokens=True)
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, completions)
    out = trainer._generate_and_score_completions(_trl_prompts())
    np.testing.assert_allclose(ours, out["advantages"].numpy(), rtol=1e-5, atol=1e-5)
    expected = [f"rewards/{n}/{s}" for n in NAMES for s in ("mean", "std")]
    expected += ["reward", "reward_std", "frac_reward_zero_std"]
    expected += ["kl"] if settings["beta"] else []
    assert sorted(metrics) == sorted(expected)
    _assert_close(metrics, _logged(trainer), expected)
    if settings["beta"]:
        assert abs(metrics["kl"]) > 1e-3  # the reference is another model


def test_advantages_of_groups_of_one_and_of_unscored_groups_are_zero():
    """TRL calls a group of one flat, and a completion alone in being scored has no
    RLOO baseline."""
    rewards = np.array([[1.0], [3.0], [NAN], [2.0]])
    advantages, metrics = rl.group_advantages(rewards, 1)
    np.testing.assert_array_equal(advantages, 0.0)
    assert metrics["frac_reward_zero_std"] == 1.0
    advantages, _ = rl.rloo_advantages(rewards, 2, beta=0.0)
    np.testing.assert_allclose(advantages, [-2.0, 2.0, 0.0, 0.0])
    advantages, metrics = rl.group_advantages([0.0, 1.0, 0.0, 1.0], 2, scale_rewards="none")
    np.testing.assert_allclose(advantages, [-0.5, 0.5, -0.5, 0.5])
    assert metrics["rewards/reward_0/mean"] == 0.5


# ----------------------------------------------------------------------------- bad input


def test_bad_settings_and_batches_say_what_to_do(models, rollout):
    model = models[0]
    batch = {k: v for k, v in rollout.items() if k not in ("ref_logps", "tokens_per_row")}
    cases = [
        ({"loss_type": "ppo"}, batch, "'ppo'"),
        ({"epsilon": 0.0}, batch, r"epsilon must be a finite number > 0, got 0\.0"),
        ({"loss_type": "dr_grpo"}, batch, "pass the sampler's max_completion_length"),
        ({"beta": 0.1}, batch, r"lacks \(it has .*\)\. Add rc\.rl\.token_logps\(reference"),
        ({"loss_type": "cispo", "delta": 2.0}, batch, "has no use for it"),
        ({"delta": 1.0}, batch, r"delta .* must be a finite number > 1"),
        ({"importance_sampling_level": "tokens"}, batch, "'tokens'"),
        (
            {},
            {k: v for k, v in batch.items() if k != "advantages"},
            r"lacks \['advantages'\] \(it has \['completion_mask', 'input_ids', 'old_logps'\]\)"
            r".*rc\.rl\.group_advantages",
        ),
        (
            {},
            {**batch, "advantages": batch["advantages"][:3]},
            r"'advantages' is \(3,\); .*\(12,\)",
        ),
        ({}, {**batch, "old_logps": batch["old_logps"][:, 1:]}, r"'old_logps' is \(12, 14\)"),
    ]
    # A value outside a Literal is a user's ValueError; under the tests' jaxtyping hook
    # (pyproject's --jaxtyping-packages) the annotation refuses it first.
    for settings, b, message in cases:
        with pytest.raises((ValueError, TypeCheckError), match=message):
            rl.policy_loss(model, b, **settings)
    with pytest.raises(ValueError, match=r"rloo_loss: epsilon_high must be a finite number > 0"):
        rl.rloo_loss(model, batch, epsilon_high=-1.0)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        rl.token_logps(model, batch["input_ids"], temperature=0.0)


def test_bad_rewards_say_what_to_do():
    with pytest.raises(ValueError, match=r"12 rows are not whole groups of num_generations=5"):
        rl.group_advantages(REWARDS, 5)
    with pytest.raises(ValueError, match=r"weights must hold one number per reward function \(2\)"):
        rl.group_advantages(REWARDS, G, weights=[1.0])
    with pytest.raises(ValueError, match=r"names must name each of the 2 reward functions once"):
        rl.group_advantages(REWARDS, G, names=["a", "a"])
    with pytest.raises((ValueError, TypeCheckError), match="'std'"):
        rl.group_advantages(REWARDS, G, scale_rewards="std")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rewards must be \(rows,\) or \(rows, n_functions\)"):
        rl.group_advantages(np.zeros((2, 2, 2)), 2)
    with pytest.raises(ValueError, match=r"Pass them, or beta=0\.0 for no penalty"):
        rl.rloo_advantages(REWARDS, G)
    with pytest.raises(ValueError, match=r"must all be \(rows, seq\) with the rewards' 12 rows"):
        zeros = np.zeros((ROWS, 3))
        rl.rloo_advantages(REWARDS, G, logps=zeros, ref_logps=zeros, completion_mask=zeros[:, 1:])
    with pytest.raises(ValueError, match=r"reward_clip_range must be \(low, high\)"):
        rl.rloo_advantages(REWARDS, G, beta=0.0, reward_clip_range=(1.0, 0.0))
