"""Progress that reaches a log: lines at intervals when stdout is no terminal, a bar when it
is; compilation labelled; `fit`, `predict` and `redcoast plan` report (`tokenize`: in
test_text.py); and the speed: tokens/s, seconds per step and MFU in metrics.jsonl."""

import functools
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redcoast as rc
from redcoast import _progress
from redcoast.train import throughput
from redcoast.train.logging import ProgressBar

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_forced_terminal(monkeypatch):
    """rich treats stdout as a terminal when these say so; the tests decide themselves."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lines_come_at_the_interval_and_at_the_end(capsys) -> None:
    clock = _Clock()
    with _progress.Progress("train", 100, unit="step", seconds=30, clock=clock, live=False) as p:
        for step in range(1, 101):
            clock.now += 1.0  # one step a second
            p.update(step, info="loss 0.5")
    lines = capsys.readouterr().out.splitlines()
    # At 30, 60 and 90 s, then the end; each with the rate, the time left and the figures.
    assert [line.split(",")[0] for line in lines] == [
        "train: 30/100 steps (30%)",
        "train: 60/100 steps (60%)",
        "train: 90/100 steps (90%)",
        "train: 100/100 steps (100%)",
    ]
    assert lines[0] == "train: 30/100 steps (30%), 1 step/s, ETA 1m 10s; loss 0.5"
    assert "ETA" not in lines[-1]


def test_a_rate_is_written_one_way_and_counts_agree_with_their_nouns() -> None:
    rate = _progress.rate
    assert (rate(2393.4, "step"), rate(2.314, "step"), rate(1.0, "step")) == (
        "2,393 steps/s",
        "2.31 steps/s",
        "1 step/s",
    )
    # Slower than one a second: seconds each, never a fraction of a step a second.
    assert (rate(1 / 36.7, "step"), rate(1 / 250, "example")) == ("36.7 s/step", "250 s/example")
    assert rate(1.5e6, _progress.BYTES) == "1.5 MB/s"
    counted = _progress.counted
    assert [counted(1, "device"), counted(4, "device"), counted(2, "process")] == [
        "1 device",
        "4 devices",
        "2 processes",
    ]
    assert _progress.elapsed(8.34) == "8.3 s" and _progress.elapsed(102.5) == "1m 42s"


def test_a_short_task_prints_one_line_at_its_end_and_bytes_read_as_sizes(capsys) -> None:
    clock = _Clock()
    with _progress.Progress("tokenize x", 2e6, unit=_progress.BYTES, clock=clock, live=False) as p:
        clock.now = 2.0
        p.advance(2e6)
    assert capsys.readouterr().out == "tokenize x: 2.0 MB/2.0 MB (100%), 1.0 MB/s\n"
    with _progress.Progress("off", 10, enabled=False, live=False) as p:
        p.update(10)
    assert capsys.readouterr().out == ""


def test_the_interval_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(_progress.ENV_SECONDS, "2.5")
    assert _progress.line_seconds() == 2.5
    monkeypatch.setenv(_progress.ENV_SECONDS, "soon")
    with pytest.raises(ValueError, match="REDCOAST_PROGRESS_SECONDS='soon': give a positive"):
        _progress.line_seconds()
    monkeypatch.delenv(_progress.ENV_SECONDS)
    assert _progress.line_seconds() == 30.0


def test_a_terminal_gets_a_bar_and_no_lines(capsys) -> None:
    with _progress.Progress("train", 10, live=True, seconds=0.0) as p:
        for step in range(1, 11):
            p.update(step, info="loss 0.5")
    out = capsys.readouterr().out
    assert "train: " not in out  # no log lines; rich drew (and closed) its bar


def test_the_fit_bar_shows_the_speed(capsys) -> None:
    clock = _Clock()
    with ProgressBar(10, live=False, seconds=5, clock=clock) as bar:
        for step in range(1, 11):
            clock.now += 1.0
            bar.advance(step)
            bar.show({"loss": 0.25, "lr": 1e-3, "tokens_per_s": 1234.5, "step_s": 0.5, "mfu": 0.4})
    last = capsys.readouterr().out.splitlines()[-1]
    # One rate, the one the records measured on the devices (0.5 s a step), shown once.
    assert last == (
        "train: 10/10 steps (100%), 2 steps/s; loss 0.25  lr 0.001  1,234 tokens/s  MFU 40.0%"
    )


def test_steps_dispatched_at_once_show_the_devices_rate(capsys) -> None:
    """Two 17 s steps: the loop dispatches both at once, and the devices finish them
    17 and 34 s later; the bar never shows the dispatch's thousands of steps a second."""
    clock = _Clock()
    with ProgressBar(2, live=False, seconds=30, clock=clock) as bar:
        bar.advance(1)
        clock.now += 0.0002
        bar.advance(2)
        clock.now = 17.0
        bar.show({"loss": 0.5, "step_s": 17.0})  # step 1's record
        clock.now = 34.0
        bar.show({"loss": 0.4, "step_s": 17.0})  # step 2's
    assert capsys.readouterr().out == "train: 2/2 steps (100%), 17 s/step; loss 0.4\n"


def test_compiling_is_labelled_with_its_seconds(capsys) -> None:
    with _progress.compiling("compiling the train step"):
        pass
    assert capsys.readouterr().out.startswith("compiling the train step… 0.0 s")
    with pytest.raises(RuntimeError), _progress.compiling("compiling x"):
        raise RuntimeError("boom")
    assert capsys.readouterr().out == "compiling x… failed\n"
    # A long compile says it goes on, then ends on a line of its own.
    with _progress.compiling("compiling y", live=False, seconds=0.05):
        time.sleep(0.3)
    first, *beats, last = capsys.readouterr().out.splitlines()
    assert first == "compiling y…" and beats and set(beats) == {"compiling y: 0s so far"}
    assert last.startswith("compiling y… 0.") and last.endswith(" s")
    assert not any(t.name == "redcoast-heartbeat" for t in threading.enumerate())


def test_a_silent_stretch_says_it_is_still_working(capsys) -> None:
    stdout = sys.stdout
    with _progress.while_silent("redcoast demo", live=False, seconds=0.2):
        for _ in range(6):  # 0.6 s of lines 0.1 s apart: nothing added
            print("step", flush=True)
            time.sleep(0.1)
        print("compiling…", end="", flush=True)  # an open line is its owner's
        time.sleep(0.5)
        print(" 0.5 s", flush=True)
        time.sleep(0.5)  # silent: said
    assert sys.stdout is stdout
    lines = capsys.readouterr().out.splitlines()
    assert lines[:7] == ["step"] * 6 + ["compiling… 0.5 s"]
    assert lines[7:] and all(
        line.startswith("redcoast demo: still working, ") and line.endswith(" so far")
        for line in lines[7:]
    )
    assert not any(t.name == "redcoast-heartbeat" for t in threading.enumerate())


def test_a_heartbeat_says_a_wait_goes_on_and_leaves_no_thread(capsys) -> None:
    with _progress.heartbeat("planning x", live=False, seconds=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 2 and all(line.startswith("planning x: 0s so far") for line in lines)
    time.sleep(0.1)
    assert capsys.readouterr().out == ""
    assert not any(t.name == "redcoast-heartbeat" for t in threading.enumerate())


def _collate(examples):
    return {"x": np.stack([e["x"] for e in examples]), "y": np.array([e["y"] for e in examples])}


def _data(n=64):
    rng = np.random.default_rng(0)
    return [{"x": x, "y": int(x.sum() > 0)} for x in rng.normal(size=(n, 4)).astype(np.float32)]


def test_predict_labels_its_compilation_and_counts_examples(capsys) -> None:
    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    out = rc.predict(
        model,
        _data(40),
        collate_fn=_collate,
        pred_fn=lambda m, b, k: jax.vmap(m)(b["x"]).argmax(-1),
        mesh=rc.make_mesh(1),
        per_device_batch_size=2,
    )
    assert len(out) == 40
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("compiling the predict step… ") and printed[0].endswith(" s")
    assert printed[-1].startswith("predict: 40/40 examples (100%)")
    rc.predict(
        model,
        _data(8),
        collate_fn=_collate,
        pred_fn=lambda m, b, k: jax.vmap(m)(b["x"]),
        mesh=rc.make_mesh(1),
        per_device_batch_size=1,
        progress=False,
    )
    assert capsys.readouterr().out == ""


FIT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import equinox as eqx, jax, numpy as np, optax
    import redcoast as rc

    rc.simulate_devices(1)
    seen = Path(sys.argv[1])
    data = [{"x": x} for x in np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)]

    def slowly(state):
        # Steps of 20 ms; from step 30 on, wait until the test has read the log.
        time.sleep(0.02)
        deadline = time.monotonic() + 120
        while state.step == 30 and not seen.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    rc.fit(
        eqx.nn.Linear(4, 1, key=jax.random.key(0)), optax.sgd(1e-2), data,
        collate_fn=lambda ex: {"x": np.stack([e["x"] for e in ex])},
        loss_fn=lambda m, b, k: (jax.vmap(m)(b["x"]) ** 2).mean(),
        per_device_batch_size=4, max_steps=40, log_every=1,
        hooks=[rc.every(1, slowly)],
    )
    print("done", flush=True)
    """
)


def test_a_run_piped_to_a_file_prints_progress_while_it_runs(tmp_path) -> None:
    script, log, seen = tmp_path / "fit.py", tmp_path / "log.txt", tmp_path / "seen"
    script.write_text(FIT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env[_progress.ENV_SECONDS] = "0.2"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(seen)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
        try:
            deadline = time.monotonic() + 300
            while "train: " not in log.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.05)
            during = log.read_text()
            assert proc.poll() is None  # the run still waits at step 30
            seen.touch()
            assert proc.wait(timeout=300) == 0, log.read_text()
        finally:
            proc.kill()
    assert "compiling the train step… " in during and "train: " in during
    assert "steps (" in during and "ETA" in during
    after = log.read_text()
    assert "train: 40/40 steps (100%)" in after and after.rstrip().endswith("done")
    # One way of writing the rate on every line; the last says why there is no MFU.
    assert not [line for line in after.splitlines() if "steps/s" in line and "s/step" in line]
    (summary,) = [line for line in after.splitlines() if line.startswith("redcoast: 40 steps in")]
    assert summary.endswith(
        "no MFU: a CPU's peak FLOP/s is not assumed (set REDCOAST_PEAK_FLOPS to one device's; "
        "a simulated device's is the CPU's over their number)"
    )


class _NoxSession:
    """What a nox session does, recorded; `pip install --dry-run` reports `planned`."""

    python = "3.11"
    posargs: tuple[str, ...] = ()

    def __init__(self, tmp: Path, planned: dict[str, str]):
        self.tmp, self.planned, self.did = tmp, planned, []

    def create_tmp(self) -> str:
        return str(self.tmp)

    def log(self, text: str) -> None:
        self.did.append(("log", text))

    def install(self, *args: str, silent: bool | None = None) -> None:
        self.did.append(("install", args, silent))

    def run_install(self, *args: str, silent: bool | None = None, **kwargs: object) -> str:
        if "--dry-run" in args:
            report = Path(args[args.index("--report") + 1])
            install = [{"metadata": {"name": n, "version": v}} for n, v in self.planned.items()]
            report.write_text(json.dumps({"install": install}))
            return ""
        if args[1:4] == ("-m", "pip", "install"):  # an environment's Python, running pip
            self.did.append(("install", args[4:], silent))
            return ""
        return str(self.tmp / "requirements.txt")  # bench_maxtext asks where MaxText's are

    def run(self, *args: str, **kwargs: object) -> None:
        self.did.append(("run", args))


def _noxfile(monkeypatch) -> types.ModuleType:
    """noxfile.py, imported with a stand-in for nox, which the tests do not install."""
    fake = types.ModuleType("nox")
    fake.options = types.SimpleNamespace()
    fake.Session = _NoxSession
    fake.session = lambda f=None, **kw: f if callable(f) else (lambda g: g)
    fake.parametrize = lambda *a, **kw: lambda f: f
    monkeypatch.setitem(sys.modules, "nox", fake)
    monkeypatch.chdir(ROOT)  # nox runs a noxfile from its folder
    spec = importlib.util.spec_from_file_location("noxfile", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_long_install_in_nox_says_what_it_does(tmp_path, monkeypatch) -> None:
    noxfile = _noxfile(monkeypatch)
    first = {"torch": "2.13.0+cpu", "jaxlib": "0.10.2", "numpy": "2.4.6", "optax": "0.2.6"}
    session = _NoxSession(tmp_path, first)
    noxfile.tests(session)
    installs = [d for d in session.did if d[0] != "run"]
    # The large ones one at a time, each named with its size and pip's output shown,
    # then the rest, named.
    assert [(kind, *rest) for kind, *rest in installs[1:]] == [
        ("log", "installing torch 2.13.0+cpu (1 of 2): " + noxfile.LARGE["torch"]),
        ("install", ("torch==2.13.0+cpu", "--no-deps"), False),
        ("log", "installing jaxlib 0.10.2 (2 of 2): " + noxfile.LARGE["jaxlib"]),
        ("install", ("jaxlib==0.10.2", "--no-deps"), False),
        ("log", "installing redcoast with its test, hf, eval and vision extras (2 more packages)"),
        ("install", ("-e", ".[test,hf,eval,vision]"), None),
    ]
    assert installs[0] == ("log", "first the large packages, one at a time: torch, jaxlib")
    assert all("MB" in size for size in noxfile.LARGE.values())
    # Run again in the environment it made: one line, pip quiet.
    again = _NoxSession(tmp_path, {})
    noxfile.tests(again)
    assert [d for d in again.did if d[0] != "run"] == [
        ("log", "installing redcoast with its test, hf, eval and vision extras"),
        ("install", ("-e", ".[test,hf,eval,vision]"), None),
    ]
    # Every session installs this way: whatever large package it brings is named first.
    every_large = dict.fromkeys(noxfile.LARGE, "1.0")
    sessions = [f for f in vars(noxfile).values() if getattr(f, "__module__", "") == "noxfile"]
    sessions = [f for f in sessions if callable(f) and not f.__name__.startswith("_")]
    assert len(sessions) == 10
    for fn in sessions:
        session = _NoxSession(tmp_path, every_large)
        fn(session, jax="0.10.2") if fn.__name__ == "jax_matrix" else fn(session)
        did = [d for d in session.did if d[0] != "run"]
        for before, install in itertools.pairwise(did):
            if install[0] == "install":
                assert before[0] == "log", fn.__name__
                assert install[2] is None or "MB" in before[1], (fn.__name__, before)


# ----------------------------------------------------------------------------- speed


class _Tokens(eqx.Module):
    embed: eqx.nn.Embedding
    head: eqx.nn.Linear

    def __call__(self, ids):
        return jax.vmap(self.head)(jax.vmap(self.embed)(ids))


def _token_loss(model, batch, key):
    losses = optax.softmax_cross_entropy_with_integer_labels(
        jax.vmap(model)(batch["ids"]), batch["ids"]
    )
    mask = batch["mask"]
    return (losses * mask).sum() / mask.sum(), {"tokens": mask.sum()}


def test_metrics_jsonl_has_tokens_per_s_step_s_and_mfu(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(throughput.ENV_PEAK, "1e9")  # a peak for the CPU, as a user gives one
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 16, size=(128, 8)).astype(np.int32)
    mask = np.zeros((128, 8), np.int32)
    mask[:, 2:] = 1  # 6 tokens of 8 count
    data = [{"ids": i, "mask": m} for i, m in zip(ids, mask, strict=True)]
    keys = jax.random.split(jax.random.key(0))
    model = _Tokens(eqx.nn.Embedding(16, 8, key=keys[0]), eqx.nn.Linear(8, 16, key=keys[1]))
    before = (sys.excepthook, sys.stdout, threading.active_count())
    result = rc.fit(
        model,
        optax.sgd(1e-2),
        data,
        collate_fn=lambda ex: {k: np.stack([e[k] for e in ex]) for k in ("ids", "mask")},
        loss_fn=_token_loss,
        mesh=rc.make_mesh(1),
        per_device_batch_size=2,
        accumulate_grad_batches=2,
        max_steps=4,
        log_every=2,
        workdir=tmp_path,
    )
    assert (sys.excepthook, sys.stdout, threading.active_count()) == before  # nothing left behind
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    flops = result.history["flops"]
    assert flops["peak"] == 1e9 and flops["per_device_step"] > 0
    for r in records:
        # 8 devices x 2 rows x 2 micro-batches of 6 counted tokens: the loss's `tokens`,
        # summed over the micro-batches (not the 8 ids a row has).
        assert r["tokens_per_s"] / r["steps_per_s"] == pytest.approx(8 * 2 * 2 * 6)
        assert r["step_s"] == pytest.approx(1 / r["steps_per_s"])
        assert r["mfu"] == pytest.approx(flops["per_device_step"] * r["steps_per_s"] / 1e9)
    assert rc.median_speed(result.history["train"]).keys() == {"tokens_per_s", "step_s", "mfu"}
    monkeypatch.setenv(throughput.ENV_PEAK, "fast")
    with pytest.raises(ValueError, match="REDCOAST_PEAK_FLOPS='fast'"):
        throughput.peak_flops(jax.devices()[0])
    monkeypatch.delenv(throughput.ENV_PEAK)
    assert throughput.peak_flops(jax.devices()[0]) is None  # a CPU's peak is not assumed


def test_tokens_are_counted_from_the_mask_else_the_ids() -> None:
    ids = np.ones((4, 8), np.int32)
    mask = np.tril(np.ones((4, 8), np.int32))
    count = functools.partial(throughput.step_tokens, micro_batches=1, data_shards=1)
    assert float(count({"input_ids": ids, "loss_mask": mask}, {})) == mask.sum()
    assert float(count({"input_ids": ids, "attention_mask": mask}, {})) == mask.sum()
    assert float(count({"input_ids": ids}, {})) == 32
    assert count({"x": np.ones((4, 8), np.float32)}, {}) is None  # no tokens: no tokens/s


def test_a_loop_s_flops_are_counted_per_iteration() -> None:
    w = jnp.ones((4, 64, 64))

    def scanned(x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    def unrolled(x):
        for i in range(4):
            x = jnp.tanh(x @ w[i])
        return x

    x = jnp.ones((32, 64))
    full, once = throughput.matmul_flops(jax.make_jaxpr(scanned)(x))
    assert (full, once) == (4 * 2 * 32 * 64 * 64, 2 * 32 * 64 * 64)
    compiled = jax.jit(scanned).lower(x).compile()
    flops, how = throughput.step_flops(compiled, lambda: jax.make_jaxpr(scanned)(x), n_devices=1)
    plain, _ = throughput.step_flops(
        jax.jit(unrolled).lower(x).compile(), lambda: None, n_devices=1
    )
    assert "per iteration" in how and flops == pytest.approx(plain, rel=0.05)
