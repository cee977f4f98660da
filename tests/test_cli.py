"""The `redcoast` command line."""

from click.testing import CliRunner

import redcoast as rc
from redcoast.cli import main


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert rc.__version__ in result.output


def test_plan_prints_every_weight_and_the_totals() -> None:
    result = CliRunner().invoke(main, ["plan", "llama", "-n", "2"])
    assert result.exit_code == 0, result.output
    assert "blocks.0.mlp.down_proj.weight" in result.output
    assert "P(None, 'model')" in result.output
    assert "bytes per device" in result.output


def test_user_mistakes_are_one_line_errors() -> None:
    result = CliRunner().invoke(main, ["plan", "mlp", "-n", "0"])
    assert result.exit_code != 0
    assert "n_model_shards must be >= 1" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["plan", "resnet"])
    assert result.exit_code != 0 and "Invalid value" in result.output
