"""Shared fixtures: one real local cluster (Redis, coordinator, 4 workers) per test session."""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

PLUGIN_PATH = Path(__file__).parent / "plugin_pkg"  # a distribution with a pipefb.models entry
WORKER_THREADS = 1  # torch threads per worker; references must use as many to be bit-equal
# local clusters leave their user tokens here, not in the home folder of whoever runs tests
os.environ.setdefault("PIPEFB_TOKEN_DIR", tempfile.mkdtemp(prefix="pipefb-test-tokens-"))


@dataclass(frozen=True)
class Credentials:
    """A fresh service credential, coordinator credential and admin token, for a test that
    starts a worker or a coordinator itself: the environment naming their files (`env`
    for a worker: the coordinator's verifier, not its token; `coordinator_env` for a
    coordinator), and the `protos.security.Security` of a client calling as a peer worker
    (`service`), as the coordinator calls a worker (`coordinator`) or as the admin user."""

    env: dict[str, str]
    service: Any
    user: Any
    coordinator: Any
    coordinator_env: dict[str, str]


def credentials(folder: Path) -> Credentials:
    """Writes a fresh service token, coordinator token and its verifier, and admin token
    (each 0600) into `folder`."""
    from pipefb.secretfiles import verifier, write_private
    from protos.security import Security

    service, user, boss = secrets.token_hex(16), secrets.token_hex(16), secrets.token_hex(32)
    env = {"PIPEFB_SERVICE_TOKEN_FILE": str(write_private(folder / "service-token", service)),
           "PIPEFB_TOKEN_FILE": str(write_private(folder / "token", user)),
           "PIPEFB_COORDINATOR_VERIFIER_FILE": str(write_private(
               folder / "coordinator-verifier", verifier(boss)))}
    coordinator_env = {**env, "PIPEFB_COORDINATOR_TOKEN_FILE": str(write_private(
        folder / "coordinator-token", boss))}
    return Credentials(env, Security(service_token=service), Security(token=user),
                       Security(coordinator_token=boss), coordinator_env)


@contextmanager
def worker_threads() -> Iterator[None]:
    """Runs a one-process reference with the workers' torch thread count, then restores it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(WORKER_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def plugin_path() -> Iterator[Path]:
    """Makes the toy model distribution importable here (workers get it via PYTHONPATH)."""
    sys.path.insert(0, str(PLUGIN_PATH))
    yield PLUGIN_PATH
    sys.path.remove(str(PLUGIN_PATH))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, plugin_path: Path) -> Iterator[object]:
    """Real processes on 127.0.0.1: redis-server, a coordinator and 4 workers."""
    from pipefb.app.local import LocalServices

    env = {"PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")]),
           "PIPEFB_CHECKPOINT_ROOT": str(tmp_path_factory.mktemp("checkpoints")),
           "PIPEFB_DATA_ROOT": str(tmp_path_factory.mktemp("data"))}
    with LocalServices(4, tmp_path_factory.mktemp("cluster"), threads=WORKER_THREADS,
                      extra_env=env) as c:
        c.checkpoint_root = Path(env["PIPEFB_CHECKPOINT_ROOT"])  # type: ignore[attr-defined]
        c.data_root = Path(env["PIPEFB_DATA_ROOT"])  # type: ignore[attr-defined]
        yield c


@pytest.fixture(scope="session")
def client(cluster: object) -> Iterator[object]:
    """A coordinator client with all 4 workers registered, sending the cluster's user
    token (which `CoordinatorClient` would also find in its `token_path` file)."""
    from coordinator.client import CoordinatorClient
    from protos.security import Security

    with CoordinatorClient(cluster.coordinator,  # type: ignore[attr-defined]
                           Security(token=cluster.token)) as c:  # type: ignore[attr-defined]
        c.wait_for_workers(4)
        yield c


def store_client(cluster: object) -> Any:
    """A client of the local cluster's store, as its service user (the default user is
    off)."""
    from offload_store import connect

    return connect(cluster.store, username=cluster.store_user,  # type: ignore[attr-defined]
                   password=cluster.store_password)  # type: ignore[attr-defined]


def rss(pid: int) -> int:
    """Resident bytes of a process (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


PEER_METHODS = ("Activations", "Gradients", "Weights", "Migrate")  # a worker's peers call these


class RoleStub:
    """A worker's stub that calls each RPC as its legitimate caller does ([Note: access] in
    protos/security.py): the tensor streams as a peer worker, the rest as the
    coordinator."""

    def __init__(self, coordinator: Any, peer: Any) -> None:
        self.coordinator, self.peer = coordinator, peer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.peer if name in PEER_METHODS else self.coordinator, name)


@contextmanager
def role_stub(address: str, keys: Credentials) -> Iterator[RoleStub]:
    """A `RoleStub` of the worker at `address`, with `keys`' credentials."""
    from protos import server, worker_pb2_grpc

    with server.channel(address, keys.coordinator) as boss, \
            server.channel(address, keys.service) as peer:
        yield RoleStub(worker_pb2_grpc.StageWorkerStub(boss),
                       worker_pb2_grpc.StageWorkerStub(peer))


def assert_submit_refused(client: Any, spec: Any, fields: dict[str, Any], message: str) -> None:
    """Submits the JobSpec `spec` with `fields` set: refused with INVALID_ARGUMENT and one
    line that holds `message`."""
    import grpc

    for name, value in fields.items():
        setattr(spec, name, value)
    with pytest.raises(grpc.RpcError) as info:
        client.stub.SubmitJob(spec, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details() and "\n" not in info.value.details()
