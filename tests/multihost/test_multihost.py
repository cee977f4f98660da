"""Many processes, one job: `rc.fit` on 2 x 4 and 4 x 2 processes x devices equals 1 x 8.

Every run trains the same small GPT on a 2 x 4 mesh with train_gpt.py; only how
the 8 devices are spread over processes changes. Run with `nox -s multihost`
(`pytest -m multihost tests/multihost`); the default test session skips these.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from redcoast.distributed import free_port
from redcoast.distributed._simulated import SIMULATED_XLA_FLAGS
from redcoast.train.workdir import hold_workdir

pytestmark = pytest.mark.multihost

SCRIPT = Path(__file__).parent / "train_gpt.py"
TIMEOUT = 600
LAYOUTS = {"2x4": (2, 4), "4x2": (4, 2)}


def _run(command: list[str], env: dict[str, str], log: Path) -> None:
    """Run `command` to completion; on timeout stop it (and, for a launcher, its children)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # redcoast launch stops its processes on SIGTERM
            proc.wait(timeout=30)
            raise
    assert code == 0, f"{' '.join(command)} exited with {code}:\n{log.read_text()[-5000:]}"


def _single(out: Path, *extra: str) -> Path:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {SIMULATED_XLA_FLAGS}",
    }
    for var in ("REDCOAST_COORDINATOR_ADDRESS", "REDCOAST_NUM_PROCESSES", "REDCOAST_PROCESS_ID"):
        env.pop(var, None)
    _run([sys.executable, str(SCRIPT), "--out", str(out), *extra], env, out.with_suffix(".log"))
    return out


def _launched(out: Path, nprocs: int, devices: int) -> Path:
    command = [sys.executable, "-m", "redcoast", "launch", "--nprocs", str(nprocs)]
    command += ["--devices-per-proc", str(devices), "--port", str(free_port()), "--"]
    command += [sys.executable, str(SCRIPT), "--out", str(out)]
    _run(command, dict(os.environ), out.with_suffix(".log"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each layout's run folder, trained once for the whole module."""
    root = tmp_path_factory.mktemp("multihost")
    found = {"1x8": _single(root / "1x8")}
    for name, (nprocs, devices) in LAYOUTS.items():
        found[name] = _launched(root / name, nprocs, devices)
    return found


def _reports(run: Path) -> list[dict[str, Any]]:
    files = sorted(run.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_process_joins_one_job(runs: dict[str, Path], layout: str) -> None:
    nprocs, _ = LAYOUTS[layout]
    reports = _reports(runs[layout])
    assert [r["process_index"] for r in reports] == list(range(nprocs))
    for r in reports:
        assert (r["process_count"], r["device_count"]) == (nprocs, 8)
        assert r["mesh"] == {"data": 2, "model": 4}
    log = runs[layout].with_suffix(".log").read_text()
    # make_mesh started the runtime; only process 0 says so.
    assert f"[0] redcoast: {nprocs} processes, coordinator 127.0.0.1:" in log
    assert "[1] redcoast:" not in log


@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_equal_a_single_process(runs: dict[str, Path], layout: str) -> None:
    reference = _reports(runs["1x8"])[0]
    assert len(reference["losses"]) == 20 and reference["losses"][-1] < reference["losses"][0]
    for r in _reports(runs[layout]):
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-5)
        (ours,), (theirs,) = r["eval"], reference["eval"]
        assert ours["step"] == theirs["step"] == 20
        np.testing.assert_allclose(ours["eval_nats"], theirs["eval_nats"], rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_predictions_are_gathered_in_order_on_every_process(
    runs: dict[str, Path], layout: str
) -> None:
    reference = np.load(runs["1x8"] / "preds0.npy")
    assert reference.shape == (10, 16)  # 10 examples (the last batch padded), 16 tokens
    nprocs, _ = LAYOUTS[layout]
    for rank in range(nprocs):
        preds = np.load(runs[layout] / f"preds{rank}.npy")
        np.testing.assert_allclose(preds, reference, rtol=1e-5, atol=1e-6)


def _rows(layout: tuple[int, int], rank: int) -> slice:
    """The rows of a 4-row global batch that `rank` holds on the 2 x 4 mesh.

    Data row d of the mesh is devices 4d..4d+3, which belong to the processes
    4d // devices_per_proc and on; a batch's rows 2d, 2d+1 live on data row d.
    """
    _, devices = layout
    d = rank * devices // 4
    return slice(2 * d, 2 * d + 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_process_collates_only_its_rows(runs: dict[str, Path], layout: str) -> None:
    # The single process collates whole global batches, call by call; each process
    # of a layout must have made the same calls on exactly its rows of them.
    reference = _reports(runs["1x8"])[0]["calls"]
    assert all(len(c) == 4 for c in reference)
    for rank, r in enumerate(_reports(runs[layout])):
        assert r["calls"] == [c[_rows(LAYOUTS[layout], rank)] for c in reference]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_process_0_alone_writes(runs: dict[str, Path], layout: str) -> None:
    run = runs[layout]
    reference = (runs["1x8"] / "workdir" / "metrics.jsonl").read_text().splitlines()
    lines = (run / "workdir" / "metrics.jsonl").read_text().splitlines()
    assert len(reference) >= 21  # 20 steps and one evaluation
    assert len(lines) == len(reference)  # written once, not once per process
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # no temp dirs
    assert (run / "ckpt" / "state.json").is_file()


def test_a_checkpoint_from_two_processes_loads_in_one(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    loaded = _single(tmp_path / "load", "--load", str(runs["2x4"]))
    saved = np.load(runs["2x4"] / "arrays.npz")
    read = np.load(loaded / "arrays.npz")
    assert sorted(saved.files) == sorted(read.files)
    assert any(k.startswith("model") for k in saved.files)
    assert any(k.startswith("opt") for k in saved.files)
    for key in saved.files:
        np.testing.assert_array_equal(read[key], saved[key], err_msg=key)
    assert _reports(loaded)[0]["step"] == 20
    np.testing.assert_allclose(
        np.load(loaded / "preds0.npy"), np.load(runs["2x4"] / "preds0.npy"), rtol=1e-5, atol=1e-6
    )


def test_two_processes_read_disjoint_rows_of_one_token_folder(tmp_path: Path) -> None:
    script = Path(__file__).parent / "token_rows.py"
    command = [sys.executable, "-m", "redcoast", "launch", "--nprocs", "2"]
    command += ["--devices-per-proc", "4", "--port", str(free_port()), "--"]
    command += [sys.executable, str(script), "--out", str(tmp_path)]
    _run(command, dict(os.environ), tmp_path / "launch.log")
    first, second = _reports(tmp_path)
    assert first["n_tokens"] == second["n_tokens"] > 0  # one folder, written by process 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "launch.log",
        "rank0.json",
        "rank1.json",
        "tokens",
    ]
    # 3 steps of 8 rows, each row read by the one process whose devices hold it.
    assert not set(first["read"]) & set(second["read"])
    assert len(set(first["read"]) | set(second["read"])) == 24
    np.testing.assert_allclose(first["losses"], second["losses"], rtol=0)
    assert first["losses"][-1] < first["losses"][0]


def test_a_held_workdir_stops_every_process_of_a_job(tmp_path: Path) -> None:
    # Process 0 finds the workdir held (here by this test process); the others wait for
    # its verdict and stop with the same error, none left hanging in a collective.
    out = tmp_path / "job"
    command = [sys.executable, "-m", "redcoast", "launch", "--nprocs", "2"]
    command += ["--devices-per-proc", "4", "--port", str(free_port()), "--timeout", "300", "--"]
    command += [sys.executable, str(SCRIPT), "--out", str(out)]
    with hold_workdir(out / "workdir"):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    log = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124), log  # failed, and not by the launcher's timeout
    held = f"is in use by another live run: process {os.getpid()} on host"
    for rank in (0, 1):
        error = (
            f"[{rank}] redcoast.train.workdir.WorkdirInUseError: workdir {out / 'workdir'} {held}"
        )
        assert error in log, log
    assert not (out / "workdir" / "metrics.jsonl").exists()
    assert not (out / "workdir" / "ckpts").exists()


def test_context_parallelism_over_two_processes_equals_the_rows_split_on_one(
    tmp_path: Path,
) -> None:
    script = Path(__file__).parent / "context_lm.py"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {SIMULATED_XLA_FLAGS}",
    }
    single = tmp_path / "single"
    _run(
        [sys.executable, str(script), "--out", str(single), "--no-context"],
        env,
        tmp_path / "single.log",
    )
    command = [sys.executable, "-m", "redcoast", "launch", "--nprocs", "2"]
    command += ["--devices-per-proc", "4", "--port", str(free_port()), "--"]
    command += [sys.executable, str(script), "--out", str(tmp_path / "split")]
    _run(command, dict(os.environ), tmp_path / "split.log")
    (reference,) = _reports(single)
    reports = _reports(tmp_path / "split")
    assert len(reports) == 2 and len(reference["losses"]) == 5
    for r in reports:
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-5)
        np.testing.assert_allclose(
            r["eval"][-1]["eval_loss"], reference["eval"][-1]["eval_loss"], rtol=1e-5
        )
        # Every process collates whole batches: the rows a single process collates.
        assert r["calls"] == reference["calls"]


ACROSS = Path(__file__).parent / "resume_across.py"


def _across(workdir: Path, out: Path, kind: str, layout: str, steps: int, *flags: str,
            nprocs: int = 1) -> Path:  # fmt: skip
    """`resume_across.py` alone (8 devices) or under `redcoast launch` (nprocs x 8/nprocs)."""
    script = [sys.executable, str(ACROSS), str(workdir), str(out), kind, layout, str(steps)]
    if nprocs == 1:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {SIMULATED_XLA_FLAGS}"
        for var in ("REDCOAST_COORDINATOR_ADDRESS", "REDCOAST_NUM_PROCESSES"):
            env.pop(var, None)
        _run([*script, *flags], env, out.with_suffix(".log"))
    else:
        command = [sys.executable, "-m", "redcoast", "launch", "--nprocs", str(nprocs)]
        command += ["--devices-per-proc", str(8 // nprocs), "--port", str(free_port()), "--"]
        _run([*command, *script, *flags], dict(os.environ), out.with_suffix(".log"))
    return out


@pytest.mark.parametrize(
    ("kind", "first", "then"),
    # (kind, (processes, layout) before the stop, after it)
    [("fsdp", (2, "2x4"), (1, "8x1")), ("lora", (1, "8x1"), (2, "2x4"))],
)
def test_a_run_resumed_on_another_process_count_equals_one_never_interrupted(
    tmp_path: Path, kind: str, first: tuple[int, str], then: tuple[int, str]
) -> None:
    """Checkpointed by 2 processes x 4 devices and resumed by 1 x 8, and the other way:
    the losses and parameters of an uninterrupted run (tolerances of tests/test_resume.py)."""
    straight = _across(tmp_path / "a", tmp_path / "straight", kind, first[1], 6, nprocs=first[0])
    _across(tmp_path / "b", tmp_path / "stopped", kind, first[1], 3, nprocs=first[0])
    resumed = _across(
        tmp_path / "b", tmp_path / "resumed", kind, then[1], 6, "--resume", nprocs=then[0]
    )
    want = json.loads((straight / "losses.json").read_text())
    got = json.loads((resumed / "losses.json").read_text())
    assert sorted(got, key=int) == [str(s) for s in range(1, 7)]
    np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(got)],
                               rtol=2e-6)  # fmt: skip
    with np.load(straight / "params.npz") as a, np.load(resumed / "params.npz") as b:
        assert len(a.files) == len(b.files) > 0
        for key in a.files:
            np.testing.assert_allclose(b[key], a[key], rtol=0, atol=2e-5, err_msg=key)


def test_an_rl_run_on_two_processes_equals_one_and_each_scores_its_own_rows(
    tmp_path: Path,
) -> None:
    """GRPO on 2 x 4 processes x devices: the rewards, losses and evaluation of one
    process of 8 devices; each process scores only the completions of its rows (the
    evaluation's outputs, gathered, are scored on every process)."""
    script = Path(__file__).parent / "grpo_run.py"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {SIMULATED_XLA_FLAGS}",
    }
    _run([sys.executable, str(script), "--out", str(tmp_path / "one")], env, tmp_path / "one.log")
    command = [sys.executable, "-m", "redcoast", "launch", "--nprocs", "2"]
    command += ["--devices-per-proc", "4", "--port", str(free_port()), "--"]
    command += [sys.executable, str(script), "--out", str(tmp_path / "two")]
    _run(command, dict(os.environ), tmp_path / "two.log")
    (reference,) = _reports(tmp_path / "one")
    reports = _reports(tmp_path / "two")
    assert len(reports) == 2 and len(reference["train"]) == 3
    keys = ("reward", "loss", "kl", "completions/mean_length")
    for r in reports:
        for got, want in zip(r["train"], reference["train"], strict=True):
            for k in keys:
                np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)
        assert r["eval"][-1]["eval_reward"] == reference["eval"][-1]["eval_reward"]
    evaluated = 16
    trained = len(reference["scored"]) - evaluated
    assert trained == 3 * 8 * 4  # steps x prompts x completions
    assert [len(r["scored"]) - evaluated for r in reports] == [trained // 2] * 2
    both = sorted(p for r in reports for p in r["scored"][: trained // 2])
    assert both == sorted(reference["scored"][:trained])
