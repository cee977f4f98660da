"""README's code, run as written.

The Python blocks run in order in one namespace, as one session reading the README
would type them, in a folder that holds what they name: `checkpoints/gpt2` (a tiny
GPT-2 with its tokenizer), `corpus/` (text files) and `pairs.jsonl` (preference pairs).
The `console` block's command runs and prints the lines shown. Every `redcoast` line
of the `bash` blocks runs, except `redcoast launch`, which starts a script of the
reader's (`nox -s multihost` runs it on real ones); the environment variables the
many-hosts block sets are the ones redcoast reads. The Quickstart's two lines are what
CI itself runs.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics

import pytest
from tiny_checkpoint import tiny_gpt2

from redcoast import distributed

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.M | re.S)


def test_readme_is_short_and_has_its_blocks():
    assert len(README.read_text().splitlines()) <= 300
    assert len(_blocks("python")) >= 4 and _blocks("console") and _blocks("bash")


@pytest.mark.slow
def test_every_python_block_runs_in_order(tmp_path, monkeypatch):
    tiny_gpt2(tmp_path / "checkpoints" / "gpt2", positions=128)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, key in enumerate(sorted(topics)[:400]):
        (corpus / f"{i:03d}.txt").write_text(topics[key])
    pairs = [
        {"prompt": f"{i} + {i} =", "chosen": f" {2 * i}", "rejected": f" {i}"} for i in range(32)
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(_blocks("python")):
        code = compile(block, f"README.md python block {i + 1}", "exec")
        exec(code, namespace)
    assert (tmp_path / "finetuned" / "config.json").exists()
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow
def test_the_console_block_prints_what_it_shows():
    (block,) = _blocks("console")
    command, *shown = block.strip().splitlines()
    assert command.startswith("$ redcoast ")
    result = _redcoast(shlex.split(command)[2:])
    printed = result.stdout.strip().splitlines()
    # Every line but the compile time, which depends on the machine.
    assert [s for s in printed if not s.startswith("compiled in")] == [
        s for s in shown if not s.startswith("compiled in")
    ]


def _redcoast(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`redcoast ARGS` in a process of its own, as a shell runs it (it sets its devices)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, "-m", "redcoast", *args]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _redcoast_lines() -> list[list[str]]:
    lines = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["redcoast"] and words[1] != "launch":
                lines.append(words[1:])
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("args", _redcoast_lines(), ids=" ".join)
def test_every_redcoast_command_runs(args, tmp_path):
    _redcoast(args, cwd=tmp_path)


def test_the_many_hosts_variables_are_the_ones_redcoast_reads():
    text = "\n".join(_blocks("bash"))
    named = set(re.findall(r"\b(REDCOAST_[A-Z_]+)=", text))
    read = {distributed.ENV_ADDRESS, distributed.ENV_NPROCS, distributed.ENV_RANK}
    assert named == read
