"""The `redcoast` command line."""

import click
import jax
import pytest
from click.testing import CliRunner

import redcoast as rc
from redcoast import _examples, cli
from redcoast.cli import main


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert rc.__version__ in result.output


def test_devices_default_to_the_ones_xla_flags_force_as_redcoast_launch_sets_them(
    monkeypatch,
) -> None:
    asked = []
    monkeypatch.setattr(rc.distributed._simulated, "simulate_devices", asked.append)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_foo=1")
    cli._simulate_devices(None)
    cli._simulate_devices(2)  # given: as given
    monkeypatch.delenv("XLA_FLAGS")
    cli._simulate_devices(None)
    assert asked == [4, 2, 8]


def test_run_help_lists_every_example_with_one_line() -> None:
    result = CliRunner().invoke(main, ["run", "--help"])
    assert result.exit_code == 0, result.output
    listing = result.output.split("Examples:")[1]
    for name, summary in [
        ("classification", "Image classification"),
        ("maml", "Meta-learning: MAML"),
        ("ppo", "Reinforcement learning: PPO"),
        ("fedavg", "Federated learning: FedAvg"),
        ("dp_sgd", "Differential privacy: DP-SGD"),
        ("language_modeling", "Causal language modelling"),
    ]:
        assert name in listing and summary in listing


def test_example_options_come_from_its_main() -> None:
    result = CliRunner().invoke(main, ["run", "maml", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--devices", "--n-model-shards", "--per-device-batch-size", "--max-steps"):
        assert option in result.output
    text = " ".join(result.output.split())
    assert "meta-steps (outer Adam updates)" in text  # main's Args: section
    assert "[default: 15000]" in text


def test_run_mistakes_are_one_line_errors(tmp_path) -> None:
    jax.devices()  # JAX has started, whichever tests ran before: --devices 3 must refuse
    for args, message in [
        (["run", "resnet"], "no example named 'resnet'; choose one of"),
        (["run", "maml", "--max-steps", "many"], "'many' is not a valid integer"),
        (["run", "maml", "--epochs", "3"], "No such option '--epochs'"),
        (["run", "maml", "--devices", "3"], "cannot simulate 3 devices: JAX already started"),
        (
            ["run", "maml", "--per-device-batch-size", "2000"],
            "maml: train_examples has 10000 examples in epoch 0, fewer than one global batch",
        ),
        (
            ["run", "language_modeling", "--n-model-shards", "3"],
            "n_model_shards=3 does not divide the 8 available devices",
        ),
        (
            ["run", "language_modeling", "--n-model-shards", "3"],
            "call rc.simulate_devices(8) before anything touches a device",
        ),
    ]:
        result = CliRunner().invoke(main, args)
        assert result.exit_code != 0
        assert message in result.output, result.output
        assert "Traceback" not in result.output


def test_an_example_missing_a_dependency_says_what_to_install(tmp_path, monkeypatch) -> None:
    (tmp_path / "needs.py").write_text(
        '"""Needs a package."""\nimport not_a_real_package\n\n\ndef main(steps: int = 1) -> dict:\n'
        "    return {}\n"
    )
    monkeypatch.setattr(_examples, "examples_dir", lambda: tmp_path)
    result = CliRunner().invoke(main, ["run", "needs", "--steps", "2"])
    assert result.exit_code != 0
    assert "needs the package 'not_a_real_package'" in result.output
    assert "pip install 'redcoast[examples]'" in result.output


def test_main_signatures_the_cli_cannot_express_are_reported(tmp_path) -> None:
    path = tmp_path / "odd.py"
    path.write_text("def main(sizes: list[int] = [1]) -> dict:\n    return {}\n")
    with pytest.raises(click.ClickException, match="annotated 'list\\[int\\]'"):
        _examples.describe(path)
    path.write_text("def main(steps: int) -> dict:\n    return {}\n")
    with pytest.raises(click.ClickException, match="'steps' has no default"):
        _examples.describe(path)


def test_arg_help_reads_google_style_args() -> None:
    doc = "Run.\n\nArgs:\n    a: first\n        and more.\n    b (int): second.\n\nReturns:\n    x"
    assert _examples.arg_help(doc) == {"a": "first and more.", "b": "second."}
