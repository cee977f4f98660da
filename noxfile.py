"""Sessions: `nox -s tests` (8 simulated CPU devices), `nox -s jax_matrix` (the oldest and
newest supported Python and JAX), `nox -s slow`, `nox -s exhaustive`, `nox -s lint`,
`nox -s multihost`, `nox -s bench`, `nox -s bench_peer`, `nox -s bench_maxtext`,
`nox -s examples`."""

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint"]

# 8 simulated devices, with XLA:CPU's patience at collectives raised as
# `rc.simulate_devices` raises it (`redcoast._simulated.SIMULATED_XLA_FLAGS`): two test
# processes compiling on two cores can starve a device thread past XLA's 40 s.
SIMULATED = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8 "
    "--xla_cpu_collective_call_terminate_timeout_seconds=600",
    "JAX_PLATFORMS": "cpu",
}
# The tests run small programs many times over and compile hundreds: LLVM's
# optimisations of the CPU code cost more time than they save there (the fast suite 245 s
# instead of about 290; the slow tests 2,405 s of work instead of 3,122). The programs,
# their numbers and XLA's memory figures are the same; the examples and benchmarks keep
# the default level.
FAST_COMPILE = {
    **SIMULATED,
    "XLA_FLAGS": SIMULATED["XLA_FLAGS"] + " --xla_backend_optimization_level=0",
}
# Two test processes: most of a test's time is XLA compiling, one core each.
WORKERS = ("-n", "2")
FAST = ("-m", "not slow and not multihost")

# The oldest and the newest supported (Python, JAX) pairs: the bounds in pyproject.toml.
JAX_MATRIX = [("3.11", "0.10.2"), ("3.13", "0.12.0.1")]
# torch==2.13.0 (the `hf` extra) is a wheel on disk for Python 3.11 only; elsewhere pip
# would download gigabytes of CUDA wheels, so other Pythons go without.
HF_PYTHONS = ("3.11",)


@nox.session
def tests(session: nox.Session) -> None:
    """Unit and integration tests on 8 simulated CPU devices (slow ones excluded)."""
    session.log(
        "installing redcoast with its test and hf extras: JAX, PyTorch (CPU), transformers, "
        "datasets (about 2 GB, a few minutes the first time; later runs reuse .nox/tests)"
    )
    session.install("-e", ".[test,hf]")
    session.run("pytest", *WORKERS, *FAST, *session.posargs, env=FAST_COMPILE)


@nox.session
@nox.parametrize(("python", "jax"), JAX_MATRIX)
def jax_matrix(session: nox.Session, jax: str) -> None:
    """The fast tests on the oldest and the newest supported Python and JAX.

    `nox -s jax_matrix` runs both pairs; one is `nox -s "jax_matrix(python='3.13',
    jax='0.12.0.1')"`. Python 3.13 gets no PyTorch (see `HF_PYTHONS`), so the tests
    that compare the zoo with `transformers` (`pytest.importorskip("torch")`) are
    skipped there and run in the 3.11 session.
    """
    extras = "test,hf" if session.python in HF_PYTHONS else "test"
    session.log(
        f"installing redcoast[{extras}] with JAX {jax} on Python {session.python}"
        + (" (PyTorch and transformers: about 2 GB the first time)" if "hf" in extras else "")
    )
    session.install("-e", f".[{extras}]", f"jax=={jax}", f"jaxlib=={jax}")
    session.run("pytest", *WORKERS, *FAST, *session.posargs, env=FAST_COMPILE)


@nox.session
def slow(session: nox.Session) -> None:
    """The long tests: killed and resumed runs, launchers and dead peers, examples via the CLI,
    and plans compiled by the TPU compiler (the `tpu` extra)."""
    session.log(
        "installing redcoast with its test, examples, hf and tpu extras: PyTorch (CPU), "
        "transformers, gymnax, scikit-learn, libtpu (about 3 GB the first time; reused after)"
    )
    session.install("-e", ".[test,examples,hf,tpu]")
    session.run(
        "pytest",
        *WORKERS,
        "-m",
        "slow and not multihost and not exhaustive",
        *session.posargs,
        env=FAST_COMPILE,
    )


@nox.session
def exhaustive(session: nox.Session) -> None:
    """The slow checks `slow` runs on a few cases, on every case: every model family, 2
    and 8 devices, and the masks, meshes and layouts tests/conftest.py's `LATER` names."""
    session.log("installing redcoast with its test and hf extras: PyTorch (CPU), transformers")
    session.install("-e", ".[test,hf]")
    session.run("pytest", *WORKERS, "-m", "exhaustive", *session.posargs, env=FAST_COMPILE)


@nox.session
def multihost(session: nox.Session) -> None:
    """Real multi-process jobs: 2 x 4 and 4 x 2 processes x devices against 1 x 8."""
    session.log("installing redcoast with its test extra (JAX, pytest; a minute the first time)")
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "multihost", "tests/multihost", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check and pyright on src/."""
    session.log("installing redcoast with ruff, pyright and nox (a minute the first time)")
    session.install("-e", ".[dev]")
    session.run("ruff", "check", "src", "tests", "scripts", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "scripts", "examples", "noxfile.py")
    session.run("pyright", "src")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks in scripts/: each prints a table and writes JSON under bench-results/."""
    session.log("installing redcoast[hf] and datasets for the benchmarks (about 2 GB once)")
    session.install("-e", ".[hf]", "datasets>=3")  # bench_text's recipe is datasets'
    for script in sorted(Path("scripts").glob("bench_*.py")):
        # The peers (redco, MaxText) are never installed here: they have their own sessions.
        if script.name not in ("bench_peer.py", "bench_maxtext.py"):
            session.run("python", str(script), *session.posargs, env=SIMULATED)


@nox.session
def bench_peer(session: nox.Session) -> None:
    """redcoast beside redco 0.4.23 (Flax), FSDP and a hand-written step: scripts/bench_peer.py.

    redco, Flax and tqdm (which redco imports without declaring it) go into this
    session's environment only; they are never dependencies of redcoast.
    """
    session.log("installing redco 0.4.23, Flax and tqdm beside redcoast (this session only)")
    session.install("-e", ".", "redco==0.4.23", "flax", "tqdm")
    session.run("python", "scripts/bench_peer.py", *session.posargs, env=SIMULATED)


# MaxText 0.2.5 needs Python >= 3.12 and jax >= 0.11.1; 0.11.1 is the JAX both run on.
# `jax[tpu]` brings the libtpu that JAX release pins (the TPU compiler, for `--tpu`): both
# sides compile with the same JAX and the same libtpu.
MAXTEXT = ("maxtext==0.2.5", "jax[tpu]==0.11.1", "jaxlib==0.11.1")


@nox.session(python="3.12")
def bench_maxtext(session: nox.Session) -> None:
    """MaxText 0.2.5's trainer beside redcoast on one LLaMA: scripts/bench_maxtext.py.

    MaxText goes in without its declared dependencies (they include the CUDA wheels),
    then its own decoupled CPU requirements (the file its wheel ships under
    `dependencies/`: no Google Cloud clients) and libtpu (for `--tpu`: both steps
    compiled for a v5e-8 by the TPU compiler, on this CPU machine), in this session's
    environment only; none of it is ever a dependency of redcoast.
    """
    session.log(
        "installing MaxText 0.2.5, then its CPU requirements and libtpu (several minutes once)"
    )
    session.install("--no-deps", MAXTEXT[0])
    requirements = session.run_install(
        "python",
        "-c",
        "import importlib.util, pathlib; "
        "root = pathlib.Path(importlib.util.find_spec('maxtext').origin).parents[1]; "
        "print(root / 'dependencies/requirements/generated_requirements' "
        "/ 'decoupled-requirements.txt')",
        silent=True,
    )
    assert isinstance(requirements, str)
    session.install("-r", requirements.strip(), *MAXTEXT[1:])
    session.install("-e", ".", *MAXTEXT[1:])
    session.run("python", "scripts/bench_maxtext.py", *session.posargs, env=SIMULATED)


@nox.session
def examples(session: nox.Session) -> None:
    """Every example at full length (minutes each): checks its bar, writes examples/RESULTS.md."""
    session.log("installing redcoast with the examples' packages: gymnax, scikit-learn, ...")
    session.install("-e", ".[examples]")
    session.run("python", "scripts/run_examples.py", *session.posargs)
