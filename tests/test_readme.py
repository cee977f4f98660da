"""README's code, run as written, in order, by a reader who has only done the Quickstart.

`test_the_readme_runs_in_order_in_an_empty_folder` starts in an empty folder, with no
XLA flags, and goes down the README: each Python block runs in one Python session
(one namespace, as a reader typing them would), each `redcoast` line of the `bash`
blocks runs as a command, in the order they appear. Nothing is prepared beforehand:
the checkpoint and tokenizer the blocks read come from the README's own `redcoast
pretrained`, the text from the standard library. Not run: the Quickstart's lines
(what CI itself runs), and `srun` and the many-hosts lines, which start a script of the
reader's (`nox -s multihost` runs real ones). The `redcoast launch` line and the
`console` block's command run in tests of their own; the console's must print the
lines shown.
"""

import json
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from redcoast import distributed

README = Path(__file__).resolve().parent.parent / "README.md"

# A Python session the test types blocks into: each line on stdin names a file of code,
# run in one namespace; a marker line says how it went.
SESSION = r"""
import json, sys, traceback
namespace = {"__name__": "__main__"}
for line in sys.stdin:
    block = json.loads(line)
    try:
        exec(compile(open(block["path"]).read(), block["name"], "exec"), namespace)
        print("\n@@ok", flush=True)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        print("\n@@failed", flush=True)
"""


def _blocks(language: str | None = None) -> list[tuple[str, str]]:
    """`(language, code)` of every fenced block, in order (of one language, if given)."""
    found = re.findall(r"^```(\w+)\n(.*?)^```", README.read_text(), re.M | re.S)
    return [(lang, code) for lang, code in found if language in (None, lang)]


def _reader_env() -> dict[str, str]:
    """The environment of a reader's shell: no simulated devices or platform set for them,
    and the installed `redcoast` command on the PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _redcoast(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`redcoast ARGS` in a process of its own, as a shell runs it."""
    command = [sys.executable, "-m", "redcoast", *args]
    result = subprocess.run(command, cwd=cwd, env=_reader_env(), capture_output=True, text=True)
    assert result.returncode == 0, f"redcoast {shlex.join(args)}:\n{result.stdout}{result.stderr}"
    return result


def _redcoast_lines(code: str) -> list[list[str]]:
    """The arguments of each `redcoast` command of a bash block."""
    words = [shlex.split(line, comments=True) for line in code.splitlines()]
    return [w[1:] for w in words if w[:1] == ["redcoast"]]


class _Session:
    """A Python process that runs blocks one after another in one namespace."""

    def __init__(self, cwd: Path, scratch: Path):
        self.scratch = scratch
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-c", SESSION],
            cwd=cwd,
            env=_reader_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, name: str, code: str, timeout: float = 3600) -> str:
        path = self.scratch / f"{len(list(self.scratch.iterdir()))}.py"
        path.write_text(code)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"path": str(path), "name": name}) + "\n")
        self.proc.stdin.flush()
        printed = []
        while True:
            line = self.lines.get(timeout=timeout)
            if line is None:
                raise AssertionError(f"{name}: the session ended:\n{''.join(printed)}")
            if line.strip() in ("@@ok", "@@failed"):
                assert line.strip() == "@@ok", f"{name} failed:\n{''.join(printed)}"
                return "".join(printed)
            printed.append(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=60)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def test_readme_is_short_and_has_its_blocks():
    assert len(README.read_text().splitlines()) <= 300
    assert len(_blocks("python")) >= 4 and _blocks("console") and _blocks("bash")


def test_every_file_the_blocks_read_is_made_by_an_earlier_block():
    """The checkpoint folder the Python blocks open is written by a `redcoast` line
    above its first use; no block reads a file of the reader's own."""
    made_at, first_use = None, None
    for i, (lang, code) in enumerate(_blocks()):
        if lang == "bash" and any(a[:1] == ["pretrained"] for a in _redcoast_lines(code)):
            made_at = i if made_at is None else made_at
        if lang == "python" and "checkpoints/gpt2" in code and first_use is None:
            first_use = i
    assert made_at is not None and first_use is not None and made_at < first_use
    python = "\n".join(code for lang, code in _blocks("python"))
    assert not re.search(r"\"(corpus/|pairs\.jsonl)", python)


@pytest.mark.slow
def test_the_readme_runs_in_order_in_an_empty_folder(tmp_path):
    reader, scratch = tmp_path / "reader", tmp_path / "blocks"
    reader.mkdir()
    scratch.mkdir()
    session = _Session(reader, scratch)
    quickstart = _blocks("bash")[0][1]
    ran: list[str] = []
    try:
        for i, (lang, code) in enumerate(_blocks()):
            if lang == "python":
                session.run(f"README.md block {i + 1} (python)", code)
                ran.append("python")
            elif lang == "bash" and code != quickstart:
                for args in _redcoast_lines(code):
                    if args[0] == "launch":  # test_the_launch_line_…
                        continue
                    _redcoast(args, cwd=reader)
                    ran.append(f"redcoast {args[0]}")
    finally:
        session.close()
    assert ran.count("python") == len(_blocks("python"))
    assert {"redcoast pretrained", "redcoast demo", "redcoast plan"} <= set(ran)
    assert (reader / "checkpoints" / "gpt2" / "tokenizer.json").is_file()
    for folder in ("out", "finetuned", "merged"):
        assert (reader / folder / "config.json").is_file(), folder
    assert (reader / "adapter" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_the_console_block_prints_what_it_shows(tmp_path):
    ((_, block),) = _blocks("console")
    command, *shown = block.strip().splitlines()
    assert command.startswith("$ redcoast ")
    result = _redcoast(shlex.split(command)[2:], cwd=tmp_path)
    printed = result.stdout.strip().splitlines()

    # Every line as shown but for the compile time, which depends on the machine, and
    # the lines saying the plan is still compiling, printed every 30 s to a log.
    def fixed(lines: list[str]) -> list[str]:
        timeless = [re.sub(r" in [0-9hm. ]+s\b", " in …", s) for s in lines]
        return [s for s in timeless if "so far" not in s]

    assert fixed(printed) == fixed(shown)
    assert shown[-2].startswith("compiled 3 train steps in ")  # what the time was spent on


@pytest.mark.slow
def test_the_launch_line_trains_the_demo_as_two_processes_of_four_devices(tmp_path):
    (args,) = [a for _, code in _blocks("bash") for a in _redcoast_lines(code) if a[0] == "launch"]
    out = _redcoast(args, cwd=tmp_path).stdout
    assert "[0] redcoast: 2 processes" in out and "[0] train: 20/20 steps (100%)" in out
    assert "[0] sample: " in out and "[1] sample: " in out
    # Both processes train in the one folder process 0 named.
    (workdir,) = set(re.findall(r"^\[[01]\] workdir: (\S+)$", out, re.M))
    assert len(re.findall(r"^\[[01]\] workdir: ", out, re.M)) == 2
    # 8 devices, 2 model shards: 4 data shards of 4 windows a step.
    record = json.loads((tmp_path / workdir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["examples_per_s"] / record["steps_per_s"] == pytest.approx(16)


def test_the_many_hosts_variables_are_the_ones_redcoast_reads():
    text = "\n".join(code for _, code in _blocks("bash"))
    named = set(re.findall(r"\b(REDCOAST_[A-Z_]+)=", text))
    read = {distributed.ENV_ADDRESS, distributed.ENV_NPROCS, distributed.ENV_RANK}
    assert named == read
