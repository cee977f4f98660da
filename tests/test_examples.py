"""Every example runs a few steps through `redcoast run` (the full runs: `nox -s examples`)."""

import json

import pytest
from click.testing import CliRunner

from redcoast.cli import main

# Options small enough for a smoke run of each example on 8 simulated CPU devices.
SMOKE = {
    "classification": ["--n-epochs", "1", "--per-device-batch-size", "16"],
    "dp_sgd": ["--n-epochs", "1", "--per-device-batch-size", "16"],
    "fedavg": ["--n-rounds", "1", "--local-epochs", "1", "--n-clients", "2"],
    "maml": ["--max-steps", "10", "--n-test-tasks", "8"],
    "seq2seq": ["--max-steps", "4", "--eval-every", "2", "--per-device-batch-size", "4"],
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
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_example_runs_through_the_cli(name, tmp_path):
    out = tmp_path / "metrics.json"
    args = ["run", name, *SMOKE[name], "--workdir", str(tmp_path), "--metrics-json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "metrics:" in result.output
    metrics = json.loads(out.read_text())
    assert set(metrics) == EXPECTED[name]
    assert all(isinstance(v, float) for v in metrics.values())


def test_demo_prints_the_plan_a_sample_and_metrics(tmp_path):
    result = CliRunner().invoke(main, ["demo", "--max-steps", "2", "--workdir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "sharding plan: 2 model shard(s)" in result.output
    assert "bytes per device" in result.output
    assert "sample:" in result.output
    assert "val_nats_per_byte" in result.output
    assert (tmp_path / "metrics.jsonl").is_file()


def test_every_example_has_a_smoke_test():
    listing = CliRunner().invoke(main, ["run", "--help"]).output
    names = listing.split("Examples:")[1].split()
    assert set(SMOKE) | {"language_modeling"} <= set(names)
