"""Distributed start-up: SLURM parsing, the environment, and real local processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from redcoast import distributed
from redcoast.distributed import expand_nodelist, resolve

SCRIPT = Path(__file__).parent / "scripts" / "allsum.py"


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu17", ["gpu17"]),
        ("a[1-2],b3,c[08-10]", ["a1", "a2", "b3", "c08", "c09", "c10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("node-[9-11]", ["node-9", "node-10", "node-11"]),
    ],
)
def test_slurm_nodelists_expand(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


def test_slurm_job_over_four_nodes() -> None:
    env = {
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NODELIST": "node[01-04]",
        "SLURM_STEP_NODELIST": "node[02-03]",
    }
    config = resolve(env=env)
    assert config.source == "slurm"
    assert config.coordinator_address == f"node02:{12000 + 123456 % 20000}"
    assert (config.num_processes, config.process_id) == (8, 5)


def test_slurm_single_task_and_missing_variables() -> None:
    assert resolve(env={"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).source == "single process"
    assert resolve(env={"SLURM_JOB_ID": "9"}).source == "single process"  # salloc shell
    with pytest.raises(ValueError, match="neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST"):
        resolve(env={"SLURM_NTASKS": "2", "SLURM_PROCID": "0"})
    with pytest.raises(ValueError, match="SLURM_PROCID='x' is not an integer"):
        resolve(env={"SLURM_NTASKS": "2", "SLURM_PROCID": "x", "SLURM_JOB_NODELIST": "n1"})


def test_explicit_arguments_win_over_environment() -> None:
    env = {
        "REDCOAST_COORDINATOR_ADDRESS": "10.0.0.1:99",
        "REDCOAST_NUM_PROCESSES": "4",
        "REDCOAST_PROCESS_ID": "3",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
    }
    assert resolve("h:1", 2, 0, env=env).source == "arguments"
    config = resolve(env=env)
    assert (config.source, config.num_processes, config.process_id) == ("environment", 4, 3)
    with pytest.raises(ValueError, match="together"):
        resolve("h:1", env=env)
    with pytest.raises(ValueError, match=r"process_id 4 is not in \[0, 4\)"):
        resolve(env={**env, "REDCOAST_PROCESS_ID": "4"})
    with pytest.raises(ValueError, match="REDCOAST_PROCESS_ID not set"):
        resolve(env={"REDCOAST_COORDINATOR_ADDRESS": "h:1", "REDCOAST_NUM_PROCESSES": "2"})


def test_no_environment_is_single_process() -> None:
    config = resolve(env={})
    assert not config.multi_process and config.source == "single process"


def test_launch_runs_processes_that_see_each_other(capfd: pytest.CaptureFixture[str]) -> None:
    code = distributed.launch(
        [sys.executable, str(SCRIPT)], nprocs=2, devices_per_proc=2, port=_free_port(), timeout=120
    )
    out = capfd.readouterr().out
    assert code == 0, out
    # 2 devices of rank 0 hold 1, 2 devices of rank 1 hold 2: the global sum is 6.
    assert "[0] rank 0 of 2: devices 4 sum 6.0" in out
    assert "[1] rank 1 of 2: devices 4 sum 6.0" in out


def test_launch_returns_the_failure_and_leaves_no_process(
    capfd: pytest.CaptureFixture[str],
) -> None:
    code = distributed.launch(
        [sys.executable, str(SCRIPT), "fail"],
        nprocs=2,
        devices_per_proc=1,
        port=_free_port(),
        timeout=120,
    )
    capfd.readouterr()
    assert code == 3
    leftover = subprocess.run(["pgrep", "-f", f"{SCRIPT} fail"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"processes left behind: {leftover.stdout}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_single_process_initialize_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith(("REDCOAST_", "SLURM_")):
            monkeypatch.delenv(var)
    assert distributed.initialize().source == "single process"


def test_launch_command_line() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "redcoast",
            "launch",
            "--nprocs",
            "2",
            "--devices-per-proc",
            "1",
            "--port",
            str(_free_port()),
            "--",
            sys.executable,
            str(SCRIPT),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[1] rank 1 of 2: devices 2 sum 3.0" in result.stdout
