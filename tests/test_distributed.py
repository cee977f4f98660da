"""Distributed start-up: SLURM parsing, the environment, and real local processes."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

import redcoast as rc
from redcoast import distributed
from redcoast.distributed import (
    EXIT_PEER_LOST,
    expand_nodelist,
    free_port,
    heartbeat_timeout,
    resolve,
)
from redcoast.distributed._watchdog import silent_peers

SCRIPT = Path(__file__).parent / "scripts" / "allsum.py"
TRAIN = Path(__file__).parent / "scripts" / "train_forever.py"


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu17", ["gpu17"]),
        ("gpu-[1-2],cpu3", ["gpu-1", "gpu-2", "cpu3"]),
        ("a[1-2],b3,c[08-10]", ["a1", "a2", "b3", "c08", "c09", "c10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("node-[9-11]", ["node-9", "node-10", "node-11"]),
        ("nid[001998-002001]", ["nid001998", "nid001999", "nid002000", "nid002001"]),
        ("  login1.cluster.org  ", ["login1.cluster.org"]),
    ],
)
def test_slurm_nodelists_expand(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "problem"),
    [
        ("node[01-04", "expected host names"),
        ("node01-04]", "expected host names"),
        ("a,,b", "expected host names"),
        ("", "expected host names"),
        ("node[a-c]", "'a-c' is not a number"),
        ("node[4-2]", "'4-2' is not a number"),
    ],
)
def test_malformed_nodelists_say_what_is_wrong(nodelist: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        expand_nodelist(nodelist)


PORT = 12000 + 123456 % 20000  # SLURM_JOB_ID 123456

# What srun sets, as seen on real clusters (trimmed to the variables that matter).
SLURM_JOBS = {
    "sbatch -N4 --ntasks-per-node=2, srun on two of the nodes": (
        {
            "SLURM_NTASKS": "8",
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_ID": "123456",
            "SLURM_JOB_NODELIST": "node[01-04]",
            "SLURM_STEP_NODELIST": "node[02-03]",
        },
        (f"node02:{PORT}", 8, 5, "slurm"),
    ),
    "mixed partitions, no step list (salloc + script)": (
        {
            "SLURM_NTASKS": "3",
            "SLURM_PROCID": "2",
            "SLURM_JOB_ID": "123456",
            "SLURM_JOB_NODELIST": "gpu-[1-2],cpu3",
        },
        (f"gpu-1:{PORT}", 3, 2, "slurm"),
    ),
    "one node, four tasks": (
        {
            "SLURM_NTASKS": "4",
            "SLURM_PROCID": "0",
            "SLURM_JOB_ID": "123456",
            "SLURM_JOB_NODELIST": "node07",
            "SLURM_STEP_NODELIST": "node07",
        },
        (f"node07:{PORT}", 4, 0, "slurm"),
    ),
    "no job id: the port falls back to 12000": (
        {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "n[8-9]"},
        ("n8:12000", 2, 1, "slurm"),
    ),
    "one task: nothing to start": (
        {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "node[01-04]"},
        (None, 1, 0, "single process"),
    ),
    "salloc shell, outside srun": (
        {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "node[01-02]"},
        (None, 1, 0, "single process"),
    ),
    "redcoast variables win over SLURM's": (
        {
            "SLURM_NTASKS": "8",
            "SLURM_PROCID": "5",
            "SLURM_JOB_NODELIST": "node[01-04]",
            "REDCOAST_COORDINATOR_ADDRESS": "10.0.0.1:1234",
            "REDCOAST_NUM_PROCESSES": "2",
            "REDCOAST_PROCESS_ID": "1",
        },
        ("10.0.0.1:1234", 2, 1, "environment"),
    ),
}


@pytest.mark.parametrize("job", SLURM_JOBS)
def test_slurm_environments(job: str) -> None:
    env, (address, n, rank, source) = SLURM_JOBS[job]
    config = resolve(env=env)
    assert isinstance(config, distributed.DistributedConfig)
    assert (config.coordinator_address, config.num_processes) == (address, n)
    assert (config.process_id, config.source) == (rank, source)


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, "neither SLURM_STEP_NODELIST nor"),
        (
            {"SLURM_NTASKS": "2", "SLURM_PROCID": "x", "SLURM_JOB_NODELIST": "n1"},
            "SLURM_PROCID='x' is not an integer",
        ),
        (
            {"SLURM_NTASKS": "2", "SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "n1"},
            r"process_id 2 is not in \[0, 2\) \(from slurm\)",
        ),
        (
            {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n[1-"},
            "cannot read the SLURM node list",
        ),
        (
            {
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": "0",
                "SLURM_JOB_NODELIST": "n1",
                "SLURM_JOB_ID": "abc",
            },
            "SLURM_JOB_ID='abc' is not an integer",
        ),
    ],
)
def test_slurm_environments_that_cannot_work_say_why(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        resolve(env=env)


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
        [sys.executable, str(SCRIPT)], nprocs=2, devices_per_proc=2, port=free_port(), timeout=120
    )
    out = capfd.readouterr().out
    assert code == 0, out
    # 2 devices of rank 0 hold 1, 2 devices of rank 1 hold 2: the global sum is 6.
    assert "[0] rank 0 of 2: devices 4 sum 6.0" in out
    assert "[1] rank 1 of 2: devices 4 sum 6.0" in out
    assert "[Gloo] Rank" not in out  # a connection line per device: left out unless --verbose


def test_launch_leaves_out_gloo_connection_lines_unless_verbose(
    capfd: pytest.CaptureFixture[str],
) -> None:
    expected = ". Expected number of connected peer ranks is : 1"
    # One line, and two written at once by Gloo's threads (as JAX 0.12's came out).
    noise = [
        f"[Gloo] Rank 0 is connected to 1 peer ranks{expected}",
        f"[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks{expected}",
        f"1 is connected to 1 peer ranks{expected}",
    ]
    code = (
        f"import sys; print({chr(10).join(noise)!r}, file=sys.stderr); print('[Gloo] other'); "
        "print('mine')"
    )
    for verbose in (False, True):
        command = [sys.executable, "-c", code]
        assert distributed.launch(command, nprocs=2, port=free_port(), verbose=verbose) == 0
        lines = sorted(capfd.readouterr().out.splitlines())
        quiet = ["[0] [Gloo] other", "[0] mine", "[1] [Gloo] other", "[1] mine"]
        loud = [f"[{rank}] {line}" for rank in (0, 1) for line in noise]
        assert lines == (sorted([*quiet, *loud]) if verbose else quiet)


@pytest.mark.slow
def test_launch_returns_the_failure_and_leaves_no_process(
    capfd: pytest.CaptureFixture[str],
) -> None:
    code = distributed.launch(
        [sys.executable, str(SCRIPT), "fail"],
        nprocs=2,
        devices_per_proc=1,
        port=free_port(),
        timeout=120,
    )
    err = capfd.readouterr().err
    assert code == 3
    assert "process 1 exited with code 3 first; stopping the other" in err
    leftover = subprocess.run(["pgrep", "-f", f"{SCRIPT} fail"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"processes left behind: {leftover.stdout}"


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
            str(free_port()),
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


def _clear_distributed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith(("REDCOAST_", "SLURM_")):
            monkeypatch.delenv(var)


def test_asking_for_processes_after_jax_started_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As in a script that touches devices before building the mesh under `redcoast
    # launch`: the backend starts in single-process mode first.
    assert len(jax.devices()) == 8
    _clear_distributed_env(monkeypatch)
    monkeypatch.setenv("REDCOAST_COORDINATOR_ADDRESS", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("REDCOAST_NUM_PROCESSES", "2")
    monkeypatch.setenv("REDCOAST_PROCESS_ID", "0")
    for start in (distributed.initialize, lambda: rc.make_mesh(2)):
        with pytest.raises(RuntimeError) as info:
            start()
        message = str(info.value)
        assert "asks for 2 processes (from environment" in message
        assert "Call rc.distributed.initialize() (or rc.make_mesh)" in message
        assert "before any other JAX call" in message


def test_make_mesh_in_a_single_process_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_distributed_env(monkeypatch)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert dict(rc.make_mesh(2).shape) == {"data": 4, "model": 2}
    assert not jax.distributed.is_initialized()


def test_heartbeat_timeout_from_argument_environment_or_default() -> None:
    assert heartbeat_timeout(env={}) == distributed.DEFAULT_HEARTBEAT_SECONDS <= 60
    assert heartbeat_timeout(env={"REDCOAST_HEARTBEAT_TIMEOUT": "7.5"}) == 7.5
    assert heartbeat_timeout(3, env={"REDCOAST_HEARTBEAT_TIMEOUT": "7.5"}) == 3
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(ValueError, match=r"REDCOAST_HEARTBEAT_TIMEOUT=.* positive number"):
            heartbeat_timeout(env={"REDCOAST_HEARTBEAT_TIMEOUT": bad})
    with pytest.raises(ValueError, match="heartbeat_timeout_seconds=0"):
        heartbeat_timeout(0)


def test_a_peer_is_lost_when_its_heartbeat_stops_advancing() -> None:
    silent = silent_peers
    seen = {1: ("", 0.0), 2: ("", 0.0), 3: ("", 0.0)}
    beats = [("redcoast/alive/0", "4"), ("redcoast/alive/1", "3"), ("redcoast/alive/2", "3")]
    lost, seen = silent(beats, seen, now=4.0, timeout=5.0)
    assert lost == [] and seen[1] == ("3", 4.0) and seen[3] == ("", 0.0)
    # Rank 3 never beat; rank 1 keeps beating; rank 2 finished normally.
    beats = [("redcoast/alive/1", "9"), ("redcoast/alive/2", "done")]
    lost, seen = silent(beats, seen, now=8.0, timeout=5.0)
    assert lost == [3] and set(seen) == {1, 3}
    lost, seen = silent([("redcoast/alive/1", "9")], seen, now=13.5, timeout=5.0)
    assert lost == [1, 3]


# ----------------------------------------------------------------------------- dead peers
# Real processes train with rc.fit; one is killed mid-training. The heartbeat
# timeout is short here so that the test is quick; the bound asserted is well below
# JAX's own backstop (1.5 x timeout + 10 s), so only redcoast's check can meet it.

TIMEOUT = 5


@contextlib.contextmanager
def _workers(nprocs: int, tag: str) -> Iterator[list[subprocess.Popen[str]]]:
    """`nprocs` bare processes of train_forever.py (no launcher, so the watchdog is asked
    for explicitly); all killed on the way out."""
    port = free_port()
    procs = []
    try:
        for rank in range(nprocs):
            env = {
                **os.environ,
                "REDCOAST_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "REDCOAST_NUM_PROCESSES": str(nprocs),
                "REDCOAST_PROCESS_ID": str(rank),
                "REDCOAST_HEARTBEAT_TIMEOUT": str(TIMEOUT),
                "REDCOAST_WATCHDOG": "1",
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(TRAIN), tag],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
        _assert_no_process_left(tag)


def _wait_for_training(proc: subprocess.Popen[str], prefix: str = "") -> int:
    """Read `proc`'s output until a process has collated 3 batches; return that pid."""
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        found = re.match(rf"{re.escape(prefix)}rank \d+ pid (\d+) batch 3$", line.strip())
        if found:
            return int(found.group(1))
    raise AssertionError("training never started:\n" + "".join(seen[-30:]))


def _assert_no_process_left(tag: str) -> None:
    left = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"


def _survivor(proc: subprocess.Popen[str], killed_at: float) -> tuple[int, str, float]:
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out, time.monotonic() - killed_at


# gloo (the CPU collectives) may read a killed peer's cut-off message and abort a
# survivor at once (SIGABRT) with its own message, before any heartbeat check.
TRANSPORT_ABORT = re.compile(r"gloo::EnforceNotMet|Gloo [\w-]+ failed")


@pytest.mark.slow
def test_a_hung_worker_stops_every_survivor_with_its_name() -> None:
    # SIGSTOP freezes the process with its sockets open: only a heartbeat can tell.
    tag = f"hung-worker-{uuid.uuid4().hex}"
    with _workers(3, tag) as (p0, p1, p2):
        _wait_for_training(p2)
        p2.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        survivors = [_survivor(p, stopped_at) for p in (p0, p1)]
    for rank, (code, out, elapsed) in enumerate(survivors):
        assert code == EXIT_PEER_LOST, out[-3000:]
        stopping = f"process {rank} of 3 is stopping (exit code 75): process 2 sent no heartbeat"
        assert stopping in out, out[-3000:]
        assert elapsed < 1.4 * TIMEOUT + 3, f"process {rank} took {elapsed:.1f} s"


@pytest.mark.slow
def test_a_dead_worker_stops_the_survivor() -> None:
    tag = f"dead-worker-{uuid.uuid4().hex}"
    with _workers(2, tag) as (p0, p1):
        _wait_for_training(p1)
        p1.kill()
        code, out, elapsed = _survivor(p0, time.monotonic())
    assert elapsed < 1.4 * TIMEOUT + 3, f"the survivor took {elapsed:.1f} s"
    if code == EXIT_PEER_LOST:
        assert "process 0 of 2 is stopping (exit code 75): process 1 sent no heartbeat" in out
    else:
        assert code == -signal.SIGABRT and TRANSPORT_ABORT.search(out), out[-3000:]


@pytest.mark.slow
def test_a_dead_coordinator_stops_the_survivor() -> None:
    tag = f"dead-coordinator-{uuid.uuid4().hex}"
    with _workers(2, tag) as (p0, p1):
        _wait_for_training(p0)
        p0.kill()
        code, out, elapsed = _survivor(p1, time.monotonic())
    assert code != 0, out[-3000:]
    # redcoast's check, JAX's coordination client (which sees the coordinator's
    # socket close) or gloo stops it, whichever is first.
    named = re.search(r"process 0, the coordinator|leader task was preempted/died", out)
    assert named or TRANSPORT_ABORT.search(out), out[-3000:]
    assert elapsed < 1.4 * TIMEOUT + 3, f"the survivor took {elapsed:.1f} s"


@pytest.mark.slow
def test_launch_names_the_dead_process_and_leaves_none(tmp_path: Path) -> None:
    tag = f"launched-{uuid.uuid4().hex}"
    launch = [sys.executable, "-m", "redcoast", "launch", "--nprocs", "2"]
    launch += ["--devices-per-proc", "2", "--port", str(free_port())]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        launcher = subprocess.Popen(
            [*launch, "--", sys.executable, str(TRAIN), tag],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "REDCOAST_HEARTBEAT_TIMEOUT": str(TIMEOUT)},
        )
        try:
            pid = _wait_for_training(launcher, prefix="[1] ")
            os.kill(pid, signal.SIGKILL)
            code, out, elapsed = _survivor(launcher, time.monotonic())
        finally:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGTERM)  # the launcher stops its children
                launcher.communicate(timeout=30)
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 128 + signal.SIGKILL, out[-2000:] + err
    assert "process 1 was killed by SIGKILL first; stopping the other 1 running process" in err
    assert elapsed < 10, f"the launcher took {elapsed:.1f} s"
    _assert_no_process_left(tag)


@pytest.mark.slow
def test_launch_asks_processes_to_stop_and_they_save_a_checkpoint(tmp_path: Path) -> None:
    # As when SLURM or a user stops the launcher: fit in every process saves a
    # checkpoint of the same step and exits; the launcher reports the signal.
    tag = f"stopped-{uuid.uuid4().hex}"
    launch = [sys.executable, "-m", "redcoast", "launch", "--nprocs", "2"]
    launch += ["--devices-per-proc", "2", "--port", str(free_port())]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        launcher = subprocess.Popen(
            [*launch, "--", sys.executable, str(TRAIN), tag, str(tmp_path / "run")],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            _wait_for_training(launcher, prefix="[1] ")
            launcher.send_signal(signal.SIGTERM)
            out, _ = launcher.communicate(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.communicate()
    err = (tmp_path / "stderr.txt").read_text()
    assert launcher.returncode == 128 + signal.SIGTERM, out[-2000:] + err
    assert "got SIGTERM; stopping all 2 processes" in err
    assert re.search(r"\[0\] redcoast: stopped after step \d+ \(SIGTERM received\)", out), out[
        -2000:
    ]
    saved = sorted((tmp_path / "run" / "ckpts").glob("step_*"))
    assert len(saved) == 1 and (saved[0] / "state.json").is_file()
    assert "killing" not in err  # they finished within the grace period
    _assert_no_process_left(tag)


@pytest.mark.slow
def test_launch_command_line_timeout_stops_everything() -> None:
    tag = f"sleeper-{uuid.uuid4().hex}"
    started = time.monotonic()
    launch = [sys.executable, "-m", "redcoast", "launch", "--nprocs", "2", "--timeout", "1"]
    result = subprocess.run(
        [*launch, "--", sys.executable, "-c", "import time; time.sleep(60)", tag],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 124, result.stdout + result.stderr
    assert "timed out after 1 s; stopping all 2 processes" in result.stderr
    assert time.monotonic() - started < 30
    _assert_no_process_left(tag)
