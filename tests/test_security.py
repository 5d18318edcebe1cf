"""Transport security with real processes: TLS and mTLS with certificates made by openssl
here, the bearer token, the refusal to listen beyond loopback unprotected, and a job that
trains through all of it exactly as one process does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.pki import make_ca, make_signed
from pipefb.errors import ConfigError
from pipefb.secretfiles import verifier
from protos import coordinator_pb2, coordinator_pb2_grpc, security
from tests.conftest import WORKER_THREADS
from tests.test_transparency import assert_same_training, make_job, run_on_cluster

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token-for-tests"
SERVICE_TOKEN = "s3cret-service-credential-for-tests"
COORDINATOR_TOKEN = "s3cret-coordinator-credential-for-tests"
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A test CA with one service certificate, and a rogue CA with its own certificate."""
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d, "ca")
    cert, key = make_signed(d, "service", ca)
    rogue, rogue_key = make_signed(d, "rogue", make_ca(d, "rogue-ca"))
    token = d / "token"
    token.write_text(TOKEN + "\n")
    service = d / "service-token"
    service.write_text(SERVICE_TOKEN + "\n")
    boss, check = d / "coordinator-token", d / "coordinator-verifier"
    boss.write_text(COORDINATOR_TOKEN + "\n")
    check.write_text(verifier(COORDINATOR_TOKEN) + "\n")
    return {"ca": ca[0], "cert": cert, "key": key, "rogue": rogue, "rogue_key": rogue_key,
            "token": token, "service": service, "coordinator": boss, "verifier": check}


def _service_env(pki: dict[str, Path]) -> dict[str, str]:
    """The service credentials: the shared one, the coordinator's and its verifier."""
    return {"PIPEFB_SERVICE_TOKEN_FILE": str(pki["service"]),
            "PIPEFB_COORDINATOR_TOKEN_FILE": str(pki["coordinator"]),
            "PIPEFB_COORDINATOR_VERIFIER_FILE": str(pki["verifier"])}


def _env(pki: dict[str, Path], mtls: bool) -> dict[str, str]:
    return {"PIPEFB_TLS_CERT": str(pki["cert"]), "PIPEFB_TLS_KEY": str(pki["key"]),
            "PIPEFB_TLS_CA": str(pki["ca"]), "PIPEFB_MTLS": "1" if mtls else "0",
            "PIPEFB_TOKEN_FILE": str(pki["token"]), **_service_env(pki)}


@contextmanager
def _coordinator(env: dict[str, str], log: Path) -> Iterator[str]:
    """A real coordinator process with `env`; its address. SIGTERM at the end: exit 0."""
    env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "coordinator", "--listen",
                                 "127.0.0.1:0", "--store", "127.0.0.1:1"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=out, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ready "), log.read_text()
        yield line.split()[1]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM: a graceful stop


@pytest.fixture(scope="module")
def coordinator(pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[str]:
    """A coordinator serving over mTLS with the token."""
    with _coordinator(_env(pki, mtls=True), tmp_path_factory.mktemp("coord") / "log") as a:
        yield a


def test_on_loopback_the_token_works_without_tls(pki: dict[str, Path], tmp_path: Path) -> None:
    """Plaintext on 127.0.0.1 with a token: the token rides in the metadata (gRPC allows no
    call credentials there), and a call without it is refused."""
    with _coordinator({"PIPEFB_TOKEN_FILE": str(pki["token"]), **_service_env(pki)},
                      tmp_path / "log") as address:
        assert list(_call(address, security.Security(token=TOKEN)).workers) == []
        with pytest.raises(grpc.RpcError) as error:
            _call(address, security.Security())
    assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED


def _call(address: str, sec: security.Security) -> coordinator_pb2.ListWorkersReply:
    with security.secure_channel(address, [], sec) as ch:
        return coordinator_pb2_grpc.CoordinatorStub(ch).ListWorkers(
            coordinator_pb2.ListWorkersRequest(), timeout=10)


def _settings(pki: dict[str, Path], cert: str = "cert", key: str = "key", token: str = TOKEN
              ) -> security.Security:
    return security.Security(cert=pki[cert].read_bytes() if cert else None,
                             key=pki[key].read_bytes() if key else None,
                             ca=pki["ca"].read_bytes(), token=token)


def test_the_right_certificate_and_token_are_served(coordinator: str,
                                                    pki: dict[str, Path]) -> None:
    assert list(_call(coordinator, _settings(pki)).workers) == []


@pytest.mark.parametrize("token", ["", "wrong-token"])
def test_a_missing_or_wrong_token_is_unauthenticated(coordinator: str, pki: dict[str, Path],
                                                     token: str) -> None:
    with pytest.raises(grpc.RpcError) as error:
        _call(coordinator, _settings(pki, token=token))
    assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_health_needs_no_token_for_probes(coordinator: str, pki: dict[str, Path]) -> None:
    with security.secure_channel(coordinator, [], _settings(pki, token="")) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                     timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("who", ["no certificate", "a rogue CA's certificate", "plaintext"])
def test_mtls_refuses_clients_without_a_certificate_from_the_ca(
        coordinator: str, pki: dict[str, Path], who: str) -> None:
    if who == "plaintext":
        ch = grpc.insecure_channel(coordinator)
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.RpcError) as error:
            stub.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=10)
        ch.close()
    else:
        sec = (_settings(pki, cert="", key="") if who == "no certificate"
               else _settings(pki, cert="rogue", key="rogue_key"))
        with pytest.raises(grpc.RpcError) as error:
            _call(coordinator, sec)
    assert error.value.code() is grpc.StatusCode.UNAVAILABLE  # the handshake failed


@pytest.mark.parametrize("missing", ["tls", "token"])
def test_a_server_beyond_loopback_without_tls_or_token_refuses_to_start(
        pki: dict[str, Path], missing: str) -> None:
    env = {**os.environ, **_env(pki, mtls=False), "PYTHONPATH": str(ROOT)}
    if missing == "tls":
        del env["PIPEFB_TLS_CERT"], env["PIPEFB_TLS_KEY"]
    else:  # on loopback as well: authentication is always on ([Note: access])
        for name in ("PIPEFB_TOKEN_FILE", *_service_env(pki)):
            del env[name]
    proc = subprocess.run([sys.executable, "-m", "worker", "--listen", "0.0.0.0:0"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert ("beyond loopback" if missing == "tls" else "needs PIPEFB_SERVICE_TOKEN_FILE"
            ) in lines[0]


def test_settings_are_checked_and_a_token_never_goes_out_in_plaintext(
        pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="go together"):
        security.from_env({"PIPEFB_TLS_CERT": str(pki["cert"])})
    with pytest.raises(ConfigError, match="PIPEFB_MTLS=1 needs"):
        security.from_env({"PIPEFB_MTLS": "1"})
    with pytest.raises(ConfigError, match="No such file"):
        security.from_env({"PIPEFB_TOKEN_FILE": str(tmp_path / "absent")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        security.from_env({"PIPEFB_TOKEN_FILE": str(tmp_path / "empty")})
    with pytest.raises(ConfigError, match="plaintext"):
        security.secure_channel("10.1.2.3:50051", [], security.Security(token=TOKEN))
    assert security.from_env({}) == security.Security()
    assert [security.is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost",
                                              "0.0.0.0", "10.0.0.1", "pipefb-coordinator")
            ] == [True, True, True, True, False, False, False]


@pytest.mark.timeout(300)
def test_a_job_trains_over_mtls_with_the_token_as_one_process_does(
        pki: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every RPC of a real job (registration, assignment, activation and gradient streams,
    weight pushes, export) goes over mTLS with the token: the client here, the coordinator
    and the workers all read the same environment."""
    from coordinator.client import CoordinatorClient
    from pipefb.app.local import LocalServices

    env = _env(pki, mtls=True)
    service = {name: env.pop(name) for name in _service_env(pki)}
    for name, value in env.items():  # this process is a user: it holds no service credential
        monkeypatch.setenv(name, value)
    job = make_job("mlp", "pipefb", 2, "adamw")
    with LocalServices(2, tmp_path, threads=WORKER_THREADS, extra_env=service) as cluster, \
            CoordinatorClient(cluster.coordinator) as client:
        client.wait_for_workers(2)
        reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)
