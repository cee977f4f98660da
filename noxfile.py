"""Sessions: `nox -s tests` (8 simulated CPU devices), `nox -s jax_matrix` (the oldest and
newest supported Python and JAX), `nox -s slow`, `nox -s exhaustive`, `nox -s lint`,
`nox -s multihost`, `nox -s bench`, `nox -s bench_peer`, `nox -s bench_maxtext`,
`nox -s examples`."""

import json
import os
import sys
import tomllib
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
# Two test processes: most of a test's time is XLA compiling, one core each. The tests
# of a fixture that compiles for long go to one worker (tests/conftest.py).
WORKERS = ("-n", "2", "--dist", "loadgroup")
FAST = ("-m", "not slow and not multihost")

# The oldest and the newest supported (Python, JAX) pairs: the bounds in pyproject.toml.
JAX_MATRIX = [("3.11", "0.10.2"), ("3.13", "0.12.0.1")]
# torch==2.13.0 (the `hf` extra) is a wheel on disk for Python 3.11 only; elsewhere pip
# would download gigabytes of CUDA wheels, so other Pythons go without.
HF_PYTHONS = ("3.11",)


# The packages a first install spends its minutes on, largest first, with their sizes
# (Linux x86-64 wheels for Python 3.11).
LARGE = {
    "torch": "PyTorch, CPU build: 190 MB to download, 750 MB installed",
    "libtpu": "the TPU compiler: 210 MB to download, 700 MB installed",
    "jaxlib": "JAX's XLA compiler: 85 MB to download, 350 MB installed",
    "pyarrow": "Arrow, for datasets: 50 MB to download, 170 MB installed",
    "transformers": "13 MB to download, 130 MB installed",
    "bitsandbytes": "125 MB installed",
    "scipy": "36 MB to download, 110 MB installed",
}


def _requirements(args: tuple[str, ...]) -> list[str]:
    """`pip install ARGS` with `-e .[extras]` spelt out as pyproject.toml's requirements,
    so that pip can say what it would install without building redcoast first."""
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    out, words = [], iter(args)
    for word in words:
        if word != "-e":
            out.append(word)
            continue
        extras = next(words).partition("[")[2].rstrip("]")
        out += project["dependencies"]
        out += [r for e in extras.split(",") if e for r in project["optional-dependencies"][e]]
    return out


def _install(session: nox.Session, what: str, *args: str, python: str = "python") -> None:
    """`pip install ARGS`, naming what goes in, the large packages first.

    nox shows none of pip's output, so a first install (20 minutes on a busy machine)
    would say nothing throughout. pip says first what it would install; the `LARGE`
    packages among them go in one at a time, each named with its size and with pip's
    own output (its download bar in a terminal), then the rest. A reused environment
    has them all: one line.
    """
    report = Path(session.create_tmp()) / "pip-report.json"
    report.unlink(missing_ok=True)
    pip = (python, "-m", "pip", "install")
    dry = (*pip, "--dry-run", "--quiet", "--report", str(report))
    # Skipped by --no-install; not echoed: a reused environment's install stays one line.
    session.run_install(*dry, *_requirements(args), silent=True, log=False, external=True)
    planned = json.loads(report.read_text())["install"] if report.exists() else []
    versions = {p["metadata"]["name"].lower(): p["metadata"]["version"] for p in planned}
    large = [(name, size) for name, size in LARGE.items() if name in versions]
    if large:
        names = ", ".join(name for name, _ in large)
        session.log(f"first the large packages, one at a time: {names}")
    for i, (name, size) in enumerate(large, 1):
        session.log(f"installing {name} {versions[name]} ({i} of {len(large)}): {size}")
        package = f"{name}=={versions[name]}"
        session.run_install(*pip, package, "--no-deps", silent=False, external=True)
    rest = len(versions) - len(large)
    more = f" ({rest} more package{'s' * (rest > 1)})" if rest else ""
    session.log(f"installing {what}{more}")
    session.run_install(*pip, *args, external=True)


# `slow`, `multihost` and `lint` run in `tests`' environment, each adding what it needs:
# one environment of PyTorch, JAX and transformers on this Python, not four (a first
# install of each took 1-4 minutes, 10 in all).
SHARED = Path(__file__).parent / ".nox" / "tests"


def _shared(session: nox.Session, what: str, extras: str) -> tuple[Path, dict[str, str]]:
    """`-e .[extras]` installed into `tests`' environment (made if it is missing): its
    `bin` folder, where the commands are (nox would look for them on its own PATH), and
    the variables that run them there (pyright finds the environment's Python on PATH)."""
    bin_dir = SHARED / "bin"
    if not (bin_dir / "python").exists():
        session.run(sys.executable, "-m", "venv", str(SHARED), external=True)
    what = f"{what} into tests' environment"
    _install(session, what, "-e", f".[{extras}]", python=str(bin_dir / "python"))
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return bin_dir, {"VIRTUAL_ENV": str(SHARED), "PATH": path}


@nox.session
def tests(session: nox.Session) -> None:
    """Unit and integration tests on 8 simulated CPU devices (slow ones excluded)."""
    what = "redcoast with its test, hf, eval and vision extras"
    _install(session, what, "-e", ".[test,hf,eval,vision]")
    session.run("pytest", *WORKERS, *FAST, *session.posargs, env=FAST_COMPILE)


@nox.session
@nox.parametrize(("python", "jax"), JAX_MATRIX)
def jax_matrix(session: nox.Session, jax: str) -> None:
    """The fast tests on the oldest and the newest supported Python and JAX.

    `nox -s jax_matrix` runs both pairs; one is `nox -s "jax_matrix(python='3.13',
    jax='0.12.0.1')"`, without the longest fast tests (tests/conftest.py's `ONCE`: CI
    runs them once, in `nox -s tests`). Python 3.13 gets no PyTorch (see `HF_PYTHONS`), so the tests
    that compare the zoo with `transformers` (`pytest.importorskip("torch")`) are
    skipped there and run in the 3.11 session.
    """
    extras = "test,hf,eval,vision" if session.python in HF_PYTHONS else "test,vision"
    what = f"redcoast[{extras}] with JAX {jax} on Python {session.python}"
    _install(session, what, "-e", f".[{extras}]", f"jax=={jax}", f"jaxlib=={jax}")
    # The newest pair leaves out the longest fast tests, which `tests` runs (`ONCE`).
    marks = FAST if (session.python, jax) != JAX_MATRIX[-1] else ("-m", f"{FAST[1]} and not once")
    session.run("pytest", *WORKERS, *marks, *session.posargs, env=FAST_COMPILE)


@nox.session(venv_backend="none")
def slow(session: nox.Session) -> None:
    """The long tests: killed and resumed runs, launchers and dead peers, examples via the CLI,
    and plans compiled by the TPU compiler (the `tpu` extra)."""
    bin_dir, env = _shared(
        session, "the examples' packages and the TPU compiler", "test,examples,hf,tpu,eval,vision"
    )
    session.run(
        str(bin_dir / "pytest"),
        *WORKERS,
        "-m",
        "slow and not multihost and not exhaustive",
        *session.posargs,
        env={**env, **FAST_COMPILE},
        external=True,
    )


@nox.session(venv_backend="none")
def exhaustive(session: nox.Session) -> None:
    """The slow checks `slow` runs on a few cases, on every case: every model family, 2
    and 8 devices, and the masks, meshes and layouts tests/conftest.py's `LATER` names."""
    bin_dir, env = _shared(session, "redcoast with its test and hf extras", "test,hf")
    run = (str(bin_dir / "pytest"), *WORKERS, "-m", "exhaustive", *session.posargs)
    session.run(*run, env={**env, **FAST_COMPILE}, external=True)


@nox.session(venv_backend="none")
def multihost(session: nox.Session) -> None:
    """Real multi-process jobs: 2 x 4 and 4 x 2 processes x devices against 1 x 8."""
    bin_dir, env = _shared(session, "redcoast with its test extra", "test")
    marks = "multihost and not exhaustive"
    run = (str(bin_dir / "pytest"), "-m", marks, "tests/multihost", *session.posargs)
    session.run(*run, env=env, external=True)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check and pyright on src/."""
    bin_dir, env = _shared(session, "ruff, pyright and nox", "dev,eval,vision")
    ruff, paths = str(bin_dir / "ruff"), ("src", "tests", "scripts", "examples", "noxfile.py")
    session.run(ruff, "check", *paths, env=env, external=True)
    session.run(ruff, "format", "--check", *paths, env=env, external=True)
    session.run(str(bin_dir / "pyright"), "src", env=env, external=True)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks in scripts/: each prints a table and writes JSON under bench-results/."""
    # bench_text's recipe is datasets'.
    _install(session, "redcoast[hf] and datasets", "-e", ".[hf]", "datasets>=3")
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
    what = "redco 0.4.23, Flax and tqdm beside redcoast (this session only)"
    _install(session, what, "-e", ".", "redco==0.4.23", "flax", "tqdm")
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
    _install(session, "MaxText 0.2.5 alone", "--no-deps", MAXTEXT[0])
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
    _install(session, "MaxText's CPU requirements", "-r", requirements.strip(), *MAXTEXT[1:])
    _install(session, "redcoast beside it", "-e", ".", *MAXTEXT[1:])
    session.run("python", "scripts/bench_maxtext.py", *session.posargs, env=SIMULATED)


@nox.session
def examples(session: nox.Session) -> None:
    """Every example at full length (minutes each): checks its bar, writes examples/RESULTS.md."""
    _install(session, "redcoast with the examples' packages", "-e", ".[examples,eval,vision]")
    session.run("python", "scripts/run_examples.py", *session.posargs)
