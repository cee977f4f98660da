"""Every example runs a few steps through `redcoast run` (the full runs: `nox -s examples`)."""

import importlib.util
import json
import re
import shlex
import sysconfig
import time
import types
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file
from tiny_checkpoint import tiny_gpt2

import redcoast as rc
from redcoast import _examples, cli
from redcoast._progress import ENV_SECONDS
from redcoast.cli import main

STDLIB = Path(sysconfig.get_paths()["stdlib"])
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES, COUNT_LINES = ROOT / "examples", ROOT / "scripts" / "count_lines.py"

# Options small enough for a smoke run of each example on 8 simulated CPU devices.
SMOKE = {
    "classification": ["--n-epochs", "1", "--per-device-batch-size", "16"],
    "dp_sgd": ["--n-epochs", "1", "--per-device-batch-size", "16"],
    "fedavg": ["--n-rounds", "1", "--local-epochs", "1", "--n-clients", "2"],
    "maml": ["--max-steps", "10", "--n-test-tasks", "8"],
    "seq2seq": ["--max-steps", "4", "--eval-every", "2", "--per-device-batch-size", "4"],
    "captioning": ["--max-steps", "4", "--per-device-batch-size", "4"],
    "text_to_image": ["--max-steps", "4", "--per-device-batch-size", "4"],
    "grpo": ["--sft-steps", "4", "--rl-steps", "3"],
    "ppo": [
        "--n-iterations",
        "2",
        "--n-envs",
        "8",
        "--n-steps",
        "16",
        "--per-device-batch-size",
        "8",
    ],
}
EXPECTED = {
    "classification": {"test_accuracy", "test_loss"},
    "dp_sgd": {"test_accuracy", "epsilon", "delta"},
    "fedavg": {"test_accuracy"},
    "maml": {"mse_before", "mse_after_1_step"},
    "ppo": {"mean_return"},
    "seq2seq": {"rougeL", "rouge2", "exact"},
    "captioning": {"rougeL", "exact"},
    "text_to_image": {"recognised", "colour", "shape", "place"},
    "grpo": {"accuracy_before", "accuracy_after", "gain", "mean_completion_length"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(SMOKE) - {"captioning"}))  # captioning: below
def test_example_runs_through_the_cli(name, tmp_path):
    out = tmp_path / "metrics.json"
    args = ["run", name, *SMOKE[name], "--workdir", str(tmp_path), "--metrics-json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "metrics:" in result.output
    metrics = json.loads(out.read_text())
    assert set(metrics) == EXPECTED[name]
    assert all(isinstance(v, float) for v in metrics.values())


def _demo_runs(times: int) -> list:
    for _ in range(times):  # each demo is a fresh run in a folder of its own
        result = CliRunner().invoke(main, ["demo", "--max-steps", "1"])
        assert result.exit_code == 0, result.output
        assert "sharding plan: 2 model shards" in result.output
        assert "bytes per device" in result.output
        assert "sample:" in result.output
        assert "val_nats_per_byte" in result.output
        assert "compiling the train step… " in result.output
        assert "tokens/s" in result.output and "tokens_per_s" in result.output  # bar and metrics
        lines = result.output.splitlines()
        assert not [line for line in lines if "steps/s" in line and "s/step" in line]
        assert "no MFU: a CPU's peak FLOP/s is not assumed" in result.output
    runs = sorted((Path.cwd() / "runs" / "demo").iterdir())
    assert len(runs) == times and all((r / "metrics.jsonl").is_file() for r in runs)
    return runs


def test_demo_prints_the_plan_a_sample_and_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = _demo_runs(2)  # the second in a fresh folder of its own
    for devices in ("0", "-1"):
        bad = CliRunner().invoke(main, ["demo", "--devices", devices])
        assert bad.exit_code == 2 and "is not in the range x>=1" in bad.output
    held = CliRunner().invoke(main, ["demo", "--max-steps", "1", "--workdir", str(runs[0])])
    assert held.exit_code == 1 and "already holds a run" in held.output
    assert "Traceback" not in held.output


def test_every_example_has_a_smoke_test():
    listing = CliRunner().invoke(main, ["run", "--help"]).output
    names = listing.split("Examples:")[1].split()
    tested_apart = {"language_modeling", "finetune", "preference", "evaluate", "vlm"}
    assert set(SMOKE) | tested_apart <= set(names)


def test_every_example_stays_within_its_lines_of_code():
    spec = importlib.util.spec_from_file_location("count_lines", COUNT_LINES)
    assert spec is not None and spec.loader is not None
    counting = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counting)
    # 120 lines of code each; finetune.py, the whole fine-tuning job, its size today.
    assert counting.limit("finetune") == 208 and counting.limit("ppo") == counting.LIMIT == 120
    sizes = {p.stem: counting.code_lines(p.read_text()) for p in EXAMPLES.glob("*.py")}
    over = {name: n for name, n in sizes.items() if n > counting.limit(name)}
    assert len(sizes) >= 12 and not over, f"examples over their bound (count_lines.py): {over}"


def test_finetune_refuses_an_unknown_packing_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["run", "finetune", "--packing", "bogus"])
    assert result.exit_code != 0
    assert "--packing is segments, joined or padded, not 'bogus'" in result.output
    assert not any(tmp_path.iterdir())  # no base checkpoint built first


def test_finetune_makes_instruction_records_of_documented_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        'def f(x):\n    """Twice x."""\n    y = 2 * x\n    return y\n\n\n'
        'class A:\n    def g(self):\n        """G."""\n        return 1\n\n'
        '    @property\n    def h(self):\n        """H."""\n        return 2\n\n\n'
        "def undocumented():\n    return 3\n"
    )
    (tmp_path / "bad.py").write_text("def (:\n")  # unparsable source is passed over
    records = _examples.load_example("finetune").function_records([tmp_path / "bad.py", source])
    # The signature and docstring are the prompt, the body the completion, dedented;
    # decorated, undocumented and docstring-only functions are left out.
    f = {"prompt": 'def f(x):\n    """Twice x."""\n', "completion": "    y = 2 * x\n    return y\n"}
    g = {"prompt": 'def g(self):\n    """G."""\n', "completion": "    return 1\n"}
    assert records == [f, g]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("data", "lora_rank", "quantize"),
    [("text", 0, None), ("jsonl", 0, None), ("text", 4, None), ("text", 4, "int8")],
    ids=["text", "jsonl", "lora", "qlora"],  # the tiny base's 32 features: int8, not NF4's 64
)
def test_finetune_hands_back_a_folder_transformers_generates_from(
    data, lora_rank, quantize, tmp_path
):
    transformers = pytest.importorskip("transformers")
    base = tiny_gpt2(tmp_path / "base")
    if data == "text":
        source = tmp_path / "corpus"
        source.mkdir()
        for name in ("json/decoder.py", "json/encoder.py", "csv.py"):
            (source / name.replace("/", "_")).write_text((STDLIB / name).read_text())
    else:
        source = tmp_path / "sft.jsonl"
        records = [{"prompt": f"{i} + {i} =", "completion": f" {2 * i}"} for i in range(200)]
        source.write_text("".join(json.dumps(r) + "\n" for r in records))
    out, metrics = tmp_path / "out", tmp_path / "metrics.json"
    args = ["run", "finetune", "--model", str(base), "--data", str(source), "--seq-len", "32"]
    args += ["--max-steps", "3", "--eval-rows", "16", "--per-device-batch-size", "2"]
    args += ["--output", str(out), "--metrics-json", str(metrics), "--lora-rank", str(lora_rank)]
    if lora_rank:  # the tied token table too: merged, transformers reads it as its head
        args += ["--lora-table-rank", "2"]
    # Rows: text packed with segments (the default) or joined, records one per row.
    args += ["--packing", "padded" if data == "jsonl" else "joined" if lora_rank else "segments"]
    if quantize:  # a quantized base, decoded by the merge before writing
        args += ["--quantize", quantize]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "held-out perplexity" in result.output and "sample:" in result.output
    # The sample's prompt comes from the data: a record's prompt, or a held-out row's start.
    if data == "jsonl":
        assert re.search(r"sample: [\"']\d+ \+ \d+ =", result.output), result.output
    assert "def read_file(path)" not in result.output
    found = json.loads(metrics.read_text())
    assert set(found) == {"perplexity_before", "perplexity_after", "ratio", "opt_state", "step_s"}
    assert found["perplexity_after"] < found["perplexity_before"]
    # With LoRA, AdamW keeps state for the adapters only; the merged model is plain.
    assert (found["opt_state"] < 0.5) if lora_rank else (found["opt_state"] == 1.0)
    # transformers opens what it wrote, and generates what redcoast generates.
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    theirs = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    ours = rc.models.generate(rc.models.from_hf(out), ids.numpy(), max_new_tokens=8)
    np.testing.assert_array_equal(np.asarray(ours[0]), theirs.numpy())


@pytest.mark.slow
def test_captioning_writes_a_folder_transformers_captions_with(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    out = tmp_path / "metrics.json"
    args = ["run", "captioning", *SMOKE["captioning"], "--workdir", str(tmp_path)]
    result = CliRunner().invoke(main, [*args, "--metrics-json", str(out)])
    assert result.exit_code == 0, result.output
    metrics = json.loads(out.read_text())
    assert set(metrics) == EXPECTED["captioning"]
    assert all(isinstance(v, float) for v in metrics.values())
    captioning = _examples.load_example("captioning")
    pixels = captioning.collate_fn([(k, k) for k in range(0, 200, 50)])["pixel_values"]
    model = transformers.VisionEncoderDecoderModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = model.generate(
            pixel_values=torch.tensor(pixels), max_new_tokens=captioning.LENGTH, num_beams=3
        )[:, 1:].numpy()
    ours = np.asarray(
        rc.models.generate_seq2seq(
            rc.models.from_hf(tmp_path / "hf"),
            pixels,
            max_new_tokens=captioning.LENGTH,
            num_beams=3,
        )
    )
    eos = captioning.EOS
    for mine, hf in zip(ours.tolist(), theirs.tolist(), strict=True):
        end = mine.index(eos) + 1 if eos in mine else len(mine)
        assert mine[:end] == hf[:end]


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dpo", "simpo"])
def test_preference_tunes_a_checkpoint_on_docstring_pairs(loss, tmp_path):
    base = tiny_gpt2(tmp_path / "base", positions=192)
    metrics = tmp_path / "metrics.json"
    args = ["run", "preference", "--model", str(base), "--loss", loss, "--seq-len", "192"]
    args += ["--max-steps", "2", "--eval-pairs", "16", "--per-device-batch-size", "1"]
    args += ["--output", str(tmp_path / "out"), "--metrics-json", str(metrics)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "held-out reward accuracy" in result.output
    found = json.loads(metrics.read_text())
    assert set(found) == {
        "accuracy_before",
        "accuracy_after",
        "chosen_logp_before",
        "chosen_logp_after",
        "chosen_logp_change",
    }
    if loss == "dpo":  # the adapters start at zero: the model is its own reference
        assert found["accuracy_before"] == 0.5


def test_the_demo_says_above_the_baseline_when_it_is_worse():
    demo = _examples.load_example("language_modeling")
    assert demo.versus_baseline(2.04, 2.0) == "2% above it"
    assert demo.versus_baseline(1.5, 2.0) == "25% below it"


def test_a_stopped_demo_says_the_command_that_continues_it(tmp_path, monkeypatch):
    given = []

    def stopped(name, kwargs, metrics_json=None, *, command):
        given.append(kwargs)
        return {"stopped_after_step": 7}

    monkeypatch.setattr(cli, "_run_example", stopped)
    workdir = str(tmp_path / "my run")
    result = CliRunner().invoke(main, ["demo", "--workdir", workdir, "--max-steps", "100"])
    assert result.exit_code == 0, result.output
    again = f"redcoast demo --workdir '{workdir}' --resume --max-steps 100"
    assert f"to continue: {again}" in result.output
    result = CliRunner().invoke(main, ["demo", *shlex.split(again)[2:]])
    assert given[-1] == {"n_model_shards": 2, "max_steps": 100, "workdir": workdir, "resume": True}
    bad = CliRunner().invoke(main, ["demo", "--resume"])
    assert bad.exit_code == 2 and "name its folder with --workdir" in bad.output


def test_an_example_silent_for_a_while_is_said_to_be_still_working(tmp_path, monkeypatch):
    def quiet_main(**kwargs):
        time.sleep(1.0)  # builds its model, say, printing nothing
        return {"loss": 0.5}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ENV_SECONDS, "0.2")
    monkeypatch.setattr(
        _examples, "load_example", lambda name: types.SimpleNamespace(main=quiet_main)
    )
    result = CliRunner().invoke(main, ["demo", "--max-steps", "1"])
    assert result.exit_code == 0, result.output
    workdir, *working, metrics, loss = result.output.splitlines()
    assert workdir.startswith("workdir: runs/demo/run-") and working
    assert all(line.startswith("redcoast demo: still working, ") for line in working)
    assert (metrics, loss) == ("metrics:", "  loss  0.5")


@pytest.mark.slow
def test_finetune_says_it_pretrains_its_base_for_base_steps_and_pretrained_makes_one(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((STDLIB / "json" / "decoder.py").read_text() * 4)
    base, out = tmp_path / "base", tmp_path / "out"
    args = ["run", "finetune", "--base-dir", str(base), "--base-steps", "3", "--data", str(corpus)]
    args += ["--max-steps", "2", "--seq-len", "32", "--eval-rows", "16"]
    args += ["--per-device-batch-size", "2", "--output", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert f"no checkpoint in {base}: pretraining one first, 3 steps" in result.output
    assert "train: 3/3 steps" in result.output and "train: 2/2 steps" in result.output
    assert f"fine-tuning {base} for 2 steps" in result.output
    # `redcoast pretrained` finds the folder complete and keeps it; a new one it makes.
    kept = CliRunner().invoke(main, ["pretrained", str(base)])
    assert kept.exit_code == 0 and "pretraining" not in kept.output, kept.output
    made = CliRunner().invoke(main, ["pretrained", str(tmp_path / "gpt2"), "--steps", "2"])
    assert made.exit_code == 0 and "pretraining one first, 2 steps" in made.output, made.output
    files = "config.json, model.safetensors, tokenizer.json, tokenizer_config.json"
    assert made.output.rstrip().endswith(f"{tmp_path / 'gpt2'}: {files}")


@pytest.mark.slow
def test_evaluate_scores_both_checkpoints_on_the_shipped_tasks(tmp_path):
    folder = tiny_gpt2(tmp_path / "tiny")
    out = tmp_path / "metrics.json"
    args = ["run", "evaluate", "--model", str(folder), "--tuned", str(folder), "--limit", "3"]
    result = CliRunner().invoke(main, [*args, "--metrics-json", str(out)])
    assert result.exit_code == 0, result.output
    metrics = json.loads(out.read_text())
    for name in ("choice_accuracy", "line_exact_match", "source_bits_per_byte"):
        assert metrics[f"{name}_before"] == metrics[f"{name}_after"]  # the same checkpoint
    assert metrics["byte_perplexity_ratio"] == 1.0
    assert "choice_accuracy: " in result.output


@pytest.mark.slow
def test_vlm_writes_a_llava_folder_that_loads_back_alike(tmp_path):
    transformers = pytest.importorskip("transformers")
    made = CliRunner().invoke(main, ["pretrained", str(tmp_path / "base"), "--steps", "2"])
    assert made.exit_code == 0, made.output
    out = tmp_path / "metrics.json"
    args = ["run", "vlm", "--max-steps", "4", "--per-device-batch-size", "4"]
    args += ["--base-dir", str(tmp_path / "base"), "--workdir", str(tmp_path)]
    result = CliRunner().invoke(main, [*args, "--metrics-json", str(out)])
    assert result.exit_code == 0, result.output
    metrics = json.loads(out.read_text())
    assert set(metrics) == {"accuracy_before", "accuracy_after"}
    # A LLaVA folder: transformers reads its config, from_hf its tensors, and writing
    # them again gives the same tensors. (transformers 5.24's LLaVA ties a head to a
    # table named `embed_tokens`, which GPT-2's is not: it cannot load this decoder.)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert config.model_type == "llava" and config.text_config.model_type == "gpt2"
    model = rc.models.from_hf(tmp_path / "hf")
    assert isinstance(model, rc.models.Llava) and model.config.image_token_index == 4096
    model.to_hf(tmp_path / "again")
    written, again = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "again"))
    assert written.keys() == again.keys()
    for name, value in written.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
