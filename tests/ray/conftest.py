"""Fixtures of the Ray replica tests: a tiny Llama checkpoint and a local Ray cluster bound to 127.0.0.1.

Nothing here imports ray at collection: each test module starts with `pytest.importorskip("ray.serve")`,
so a run without ray skips them. The cluster is `ray.init(address="local")` in this process,
2 CPUs and no dashboard; `ray.shutdown()` at the end stops every process it started. Serve's HTTP proxy
listens on 127.0.0.1 only; Ray itself turns a loopback node address into the machine's own
(`services.resolve_ip_for_localhost`) and its GCS and raylet listen on every interface, behind Ray
2.60's default token authentication.
"""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SERVER_TESTS = Path(__file__).resolve().parents[1] / "server"
CLUSTER_CPUS = 2
# One torch thread per replica, only the plugins the tiny model needs (a replica's worker inherits this
# process's environment on a local cluster; runtime_env makes it explicit).
REPLICA_ENV = {"OMP_NUM_THREADS": "1", "CORE_PLUGINS": "pytorch_backend,templates"}
REPLICA_CPUS = 0.5


def tiny_checkpoint_module() -> ModuleType:
    """tests/server/tiny_checkpoint.py, imported by path (the test folders are not packages)."""
    spec = importlib.util.spec_from_file_location("core_ray_tests_tiny_checkpoint", SERVER_TESTS / "tiny_checkpoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server tests' tiny Llama (greedy by default, printable ASCII only), built once."""
    pytest.importorskip("core_pytorch_backend", reason="the replicas run the pytorch backend")
    return tiny_checkpoint_module().build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """`free_port()`: a port free on 127.0.0.1 (for Serve's HTTP proxy or a `core serve` subprocess)."""
    return _free_port


@pytest.fixture(scope="session")
def replica_env() -> dict[str, str]:
    """The environment of every replica (REPLICA_ENV)."""
    return dict(REPLICA_ENV)


@pytest.fixture(scope="session")
def replica_actor_options(replica_env: dict[str, str]) -> dict[str, Any]:
    """Each replica's Ray options: half a CPU (2 replicas and a restart fit the 2-CPU cluster), REPLICA_ENV."""
    return {"num_cpus": REPLICA_CPUS, "runtime_env": {"env_vars": replica_env}}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A Ray instance of this process (2 CPUs, no dashboard), shut down after the module."""
    import ray

    context = ray.init(address="local", num_cpus=CLUSTER_CPUS, include_dashboard=False, log_to_driver=False)
    try:
        yield context
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
