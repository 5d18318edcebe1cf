"""Authentication and ownership, tried as attacks by a second client on loopback against a
real local cluster (Redis, a coordinator, 2 workers): a call without a token, a user
token on a worker's RPCs, an Assign naming another store, another job's store user, and
another submitter's job and weights ([Note: access] in protos/security.py,
[Note: job store users] in offload_store/acl.py)."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import grpc
import pytest
import redis
import torch

from coordinator.client import CoordinatorClient
from coordinator.journal import Entry
from offload_store import connect, open_store
from offload_store.acl import SERVICE_USER, job_user
from offload_store.admin import RedisAdmin
from pipefb.app.local import LocalServices
from pipefb.errors import ConfigError
from pipefb.secretfiles import token_path, write_private
from protos import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    security,
    server,
    worker_pb2,
    worker_pb2_grpc,
)
from protos.security import Security
from tests.conftest import WORKER_THREADS
from tests.test_transparency import assert_same_training, make_job
from tests.test_worker_service import second_rank_assignment

ROOT = Path(__file__).resolve().parent.parent
USERS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdef"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServices]:
    """A local cluster whose coordinator also knows the users alice and bob."""
    folder = tmp_path_factory.mktemp("auth")
    users = write_private(folder / "users", "\n".join(f"{n} {t}" for n, t in USERS.items()))
    with LocalServices(2, folder / "cluster", threads=WORKER_THREADS,
                       extra_env={"PIPEFB_USERS_FILE": str(users)}) as c:
        with CoordinatorClient(c.coordinator, Security(token=c.token)) as admin:
            admin.wait_for_workers(2)
        yield c


def user(cluster: LocalServices, name: str) -> CoordinatorClient:
    """A client of the cluster's coordinator sending `name`'s token."""
    return CoordinatorClient(cluster.coordinator, Security(token=USERS[name]))


def service(cluster: LocalServices) -> Security:
    """The cluster's service credential (what its coordinator and workers send)."""
    return Security(service_token=cluster.service_token_file.read_text().strip())


def coordinator(cluster: LocalServices) -> Security:
    """The cluster's coordinator's own credential (what it sends to workers)."""
    return Security(coordinator_token=cluster.coordinator_token_file.read_text().strip())


def worker_stub(cluster: LocalServices, settings: Security) -> worker_pb2_grpc.StageWorkerStub:
    return worker_pb2_grpc.StageWorkerStub(server.channel(cluster.workers()[0].address,
                                                          settings))


def steering_calls(stub: worker_pb2_grpc.StageWorkerStub, job_id: str
                   ) -> list[Callable[[], object]]:
    """Calls that would end or derail a running rank of `job_id` if obeyed: a Drain of
    any attempt, an Assign of another job, a Step far ahead."""
    return [lambda: stub.Drain(worker_pb2.DrainRequest(job_id=job_id, reason="attack",
                                                       attempt=1 << 30), timeout=10),
            lambda: stub.Assign(second_rank_assignment(), timeout=10),
            lambda: stub.Step(worker_pb2.StepRequest(job_id=job_id, step=99), timeout=10)]


def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()  # type: ignore[operator]
    return error.value.code()  # type: ignore[no-any-return]


@pytest.mark.parametrize("token", ["", "not-a-token"])
def test_without_a_known_token_every_service_says_unauthenticated(
        cluster: LocalServices, token: str) -> None:
    nobody = Security(token=token)
    with CoordinatorClient(cluster.coordinator, nobody) as client:
        assert code_of(client.workers) is grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: client.submit(make_job("mlp", "gpipe", 2, "sgd"))) is (
            grpc.StatusCode.UNAUTHENTICATED)
    stub = worker_stub(cluster, nobody)
    assert code_of(lambda: stub.Drain(worker_pb2.DrainRequest(job_id="x"), timeout=10)) is (
        grpc.StatusCode.UNAUTHENTICATED)
    assert code_of(lambda: stub.Assign(second_rank_assignment(), timeout=10)) is (
        grpc.StatusCode.UNAUTHENTICATED)


def test_a_user_token_cannot_pose_as_a_worker_and_a_service_one_cannot_submit(
        cluster: LocalServices) -> None:
    """A user registering a worker of its own would be handed other users' ranks."""
    with user(cluster, "alice") as alice:
        before = [w.address for w in alice.workers()]
        register = coordinator_pb2.RegisterWorkerRequest(address="127.0.0.1:9", name="rogue")
        assert code_of(lambda: alice.stub.RegisterWorker(register, timeout=10)) is (
            grpc.StatusCode.PERMISSION_DENIED)
        assert code_of(lambda: alice.stub.Heartbeat(
            coordinator_pb2.HeartbeatRequest(worker_id=0), timeout=10)) is (
            grpc.StatusCode.PERMISSION_DENIED)
        assert [w.address for w in alice.workers()] == before
    with server.channel(cluster.coordinator, service(cluster)) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        assert code_of(lambda: stub.ListWorkers(coordinator_pb2.ListWorkersRequest(),
                                                timeout=10)) is grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.timeout(300)
def test_no_user_nor_worker_credential_steers_a_rank_and_the_job_is_unharmed(
        cluster: LocalServices) -> None:
    """Mid-job, a user (the admin, even), a client holding everything a worker holds (the
    service credential, and the coordinator's verifier sent as a token) call Drain,
    Assign and Step on a rank: a user token and the verifier are UNAUTHENTICATED, the
    service credential PERMISSION_DENIED (only the coordinator's own credential steers a
    rank), and the job trains on exactly as one process does."""
    job = make_job("mlp", "pipefb", 2, "adamw", steps=12)
    verifier = cluster.verifier_file.read_text().strip()
    attackers = ((Security(token=cluster.token), grpc.StatusCode.UNAUTHENTICATED),
                 (Security(token=verifier), grpc.StatusCode.UNAUTHENTICATED),
                 (service(cluster), grpc.StatusCode.PERMISSION_DENIED))
    with CoordinatorClient(cluster.coordinator, Security(token=cluster.token)) as client:
        job_id = client.submit(job).job_id
        follow = client.train(job_id)
        reports = [next(follow)]
        for settings, code in attackers:
            for call in steering_calls(worker_stub(cluster, settings), job_id):
                assert code_of(call) is code
        reports += list(follow)
        status = client.status(job_id)
        assert status.state == coordinator_pb2.DONE and not status.restarts, status.error
        weights = client.weights(job_id)
    assert_same_training(job, reports, weights)


def test_an_assign_naming_another_store_is_refused_and_nothing_reaches_it(
        cluster: LocalServices) -> None:
    """Even with the coordinator's credential, an Assign cannot make a worker dial a store
    of the caller's choosing: it stashes only in the store of its own configuration."""
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.settimeout(1.0)
        request = second_rank_assignment()
        request.store_address = f"127.0.0.1:{trap.getsockname()[1]}"
        request.store_user, request.store_password = "pipefb", "stolen?"
        stub = worker_stub(cluster, coordinator(cluster))
        with pytest.raises(grpc.RpcError) as error:
            stub.Assign(request, timeout=30)
        assert error.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert f"uses only its own, '{cluster.store}'" in error.value.details()
        with pytest.raises(TimeoutError):
            trap.accept()  # no connection, so no AUTH, ever arrived


def test_another_job_s_store_user_gets_noperm(cluster: LocalServices) -> None:
    """Two jobs' users on the cluster's store: each reads and takes only its own keys,
    lists none, and a dropped user is locked out."""
    admin = RedisAdmin(cluster.store, connect(cluster.store, username=SERVICE_USER,
                                              password=cluster.store_password))
    creds = {job: admin.grant_job(job) for job in ("job-a", "job-b")}
    assert [u for u, _ in creds.values()] == [job_user("job-a"), job_user("job-b")]
    stores = {job: open_store(cluster.store, job, 0, username=u, password=p)
              for job, (u, p) in creds.items()}
    x = torch.arange(6.0)
    stores["job-a"].put(0, 0, 0, {0: {"x": x}})
    thief = connect(cluster.store, username=creds["job-b"][0], password=creds["job-b"][1])
    key = stores["job-a"].key(0, 0, 0, 0, "x")  # type: ignore[attr-defined]
    for steal in (lambda: thief.getdel(key), lambda: thief.get(key),
                  lambda: thief.unlink(key), lambda: list(thief.scan_iter())):
        with pytest.raises(redis.exceptions.NoPermissionError):
            steal()
    with pytest.raises(redis.exceptions.NoPermissionError):
        thief.set(key, b"forged")
    torch.testing.assert_close(stores["job-a"].take(0, 0, 0, {0: ["x"]})[0]["x"], x)
    for job in creds:
        admin.revoke_job(job)
    with pytest.raises(redis.exceptions.AuthenticationError):
        thief.ping()
    for store in stores.values():
        store.close()
    admin.close()
    thief.close()


@pytest.mark.timeout(300)
def test_another_submitter_s_job_and_weights_are_refused(cluster: LocalServices) -> None:
    """bob sees alice's job as missing (the same words as an unknown id): no status, no
    reports, no weights, no stop; the admin sees it. Ids are random, chosen ones too are
    alice's alone."""
    job = make_job("mlp", "gpipe", 2, "sgd")
    with user(cluster, "alice") as alice, user(cluster, "bob") as bob, \
            CoordinatorClient(cluster.coordinator, Security(token=cluster.token)) as admin:
        job_id = alice.submit(job).job_id
        assert re.fullmatch(r"job-[0-9a-f]{16}", job_id)
        reports = list(alice.train(job_id))
        weights = alice.weights(job_id)
        for call in (lambda: bob.status(job_id), lambda: bob.weights(job_id),
                     lambda: list(bob.train(job_id)), lambda: bob.stop(job_id),
                     lambda: bob.checkpoint(job_id, timeout=10)):
            with pytest.raises(grpc.RpcError) as error:
                call()
            assert error.value.code() is grpc.StatusCode.NOT_FOUND
            assert error.value.details() == f"KeyError: no job {job_id!r}"
        with pytest.raises(grpc.RpcError) as unknown:
            bob.status("job-0")
        assert unknown.value.details() == "KeyError: no job 'job-0'"
        for name, tensor in admin.weights(job_id).items():
            assert torch.equal(tensor, weights[name]), name
        chosen = alice.submit(make_job("mlp", "gpipe", 2, "sgd", job_id="alices-run"))
        assert chosen.job_id == "alice.alices-run"  # [Note: job ids]
        list(alice.train("alices-run"))
        for name in ("alices-run", "alice.alices-run"):
            assert code_of(partial(bob.weights, name)) is grpc.StatusCode.NOT_FOUND
    assert_same_training(job, reports, weights)


def test_the_cli_finds_the_local_cluster_s_token_only_in_a_private_file(
        cluster: LocalServices) -> None:
    path = token_path(cluster.coordinator)
    assert path.read_text().strip() == cluster.token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PIPEFB_TOKEN_FILE", None)  # the CLI finds the token by the address alone

    def status() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pipefb.app.cli", "status",
                               "--coordinator", cluster.coordinator], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    found = status()
    assert found.returncode == 0, found.stderr
    assert "worker-0" in found.stdout
    path.chmod(0o644)
    try:
        refused = status()
    finally:
        path.chmod(0o600)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"pipefb: error: token file {str(path)!r} is open to others (mode 644): chmod 600 it"]


def test_workers_hold_neither_the_user_token_nor_the_store_password_nor_the_coordinator_s(
        cluster: LocalServices) -> None:
    for proc in cluster.workers():
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        names = {line.split(b"=", 1)[0].decode() for line in environ if line}
        assert {"PIPEFB_SERVICE_TOKEN_FILE", "PIPEFB_COORDINATOR_VERIFIER_FILE"} <= names
        assert not names & {"PIPEFB_TOKEN_FILE", "PIPEFB_STORE_PASSWORD", "PIPEFB_USERS_FILE",
                            "PIPEFB_COORDINATOR_TOKEN_FILE"}


@pytest.mark.parametrize(("method", "who", "allowed"), [
    ("/pipefb.v1.StageWorker/Drain", "coordinator", True),
    ("/pipefb.v1.StageWorker/Drain", "service", False),
    ("/pipefb.v1.StageWorker/Drain", "admin", False),
    ("/pipefb.v1.StageWorker/Assign", "service", False),
    ("/pipefb.v1.StageWorker/Step", "service", False),
    ("/pipefb.v1.StageWorker/Profile", "coordinator", True),
    ("/pipefb.v1.StageWorker/Activations", "service", True),
    ("/pipefb.v1.StageWorker/Migrate", "service", True),
    ("/pipefb.v1.StageWorker/Activations", "coordinator", False),
    ("/pipefb.v1.Coordinator/RegisterWorker", "coordinator", False),
    ("/pipefb.v1.Coordinator/SubmitJob", "coordinator", False),
    ("/pipefb.v1.StageWorker/Assign", "alice", False),
    ("/pipefb.v1.Coordinator/RegisterWorker", "service", True),
    ("/pipefb.v1.Coordinator/RegisterWorker", "admin", False),
    ("/pipefb.v1.Coordinator/Heartbeat", "alice", False),
    ("/pipefb.v1.Coordinator/SubmitJob", "alice", True),
    ("/pipefb.v1.Coordinator/ExportWeights", "admin", True),
    ("/pipefb.v1.Coordinator/GetJob", "service", False),
    ("/pipefb.calibration.Echo/Send", "service", True),
])
def test_the_access_policy_table(method: str, who: str, allowed: bool) -> None:
    assert security.allowed(method, who) is allowed


def test_a_users_file_is_checked_line_by_line(tmp_path: Path) -> None:
    good = write_private(tmp_path / "good", "# who\nalice a-token  # ops\n\nbob b-token")
    assert security.from_env({"PIPEFB_USERS_FILE": str(good)}).users == (
        ("alice", "a-token"), ("bob", "b-token"))
    for text, line in (("alice", 1), ("alice a b", 1), ("ok t\nadmin x", 2),
                       ("ok t\nservice x", 2), ("ok t\ncoordinator x", 2), ("al.ice t", 1),
                       ("a" * 33 + " t", 1)):
        bad = write_private(tmp_path / "bad", text)
        with pytest.raises(ConfigError, match=f"line {line}: write NAME TOKEN"):
            security.from_env({"PIPEFB_USERS_FILE": str(bad)})


@pytest.mark.timeout(300)
def test_a_chosen_id_another_user_holds_tells_nothing(cluster: LocalServices) -> None:
    """Ids are per owner ([Note: job ids]): bob choosing the id alice holds gets what an id
    nobody holds gets (accepted, his own job), each sees only their own under that name,
    and only a second submit of one's own id is refused."""
    job = make_job("mlp", "gpipe", 2, "sgd", job_id="shared-name", steps=2)
    with user(cluster, "alice") as alice, user(cluster, "bob") as bob:
        held = alice.submit(job).job_id
        taken = bob.submit(job).job_id  # alice holds "shared-name"
        fresh = bob.submit(replace(job, job_id="nobody-has-it")).job_id
        assert (held, taken, fresh) == ("alice.shared-name", "bob.shared-name",
                                        "bob.nobody-has-it")
        sneaky = bob.submit(replace(job, job_id="alice.shared-name")).job_id
        assert sneaky == "bob.alice.shared-name"  # still bob's own namespace
        assert alice.status("shared-name").job_id == held
        assert bob.status("shared-name").job_id == taken
        for again, mine in ((alice, "shared-name"), (bob, "nobody-has-it")):
            with pytest.raises(grpc.RpcError) as error:
                again.submit(replace(job, job_id=mine))
            assert error.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert error.value.details() == (
                f"FailedPrecondition: job id {mine!r} is already in use")
        with pytest.raises(grpc.RpcError) as long:
            bob.submit(replace(job, job_id="x" * 61))
        assert long.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "bob's ids have at most 60 characters" in long.value.details()
        for client, job_id in ((alice, held), (bob, taken), (bob, fresh), (bob, sneaky)):
            client.stop(job_id)
        for client, job_id in ((alice, held), (bob, taken), (bob, fresh), (bob, sneaky)):
            list(client.train(job_id))  # to its end: the workers are free for what follows


def test_a_journaled_job_keeps_its_owner() -> None:
    entry = Entry(make_job("mlp", "gpipe", 2, "sgd", job_id="j"), owner="alice")
    assert Entry.from_dict(entry.to_dict()).owner == "alice"
    old = entry.to_dict()
    del old["owner"]  # written before jobs had owners: the admin's
    assert Entry.from_dict(old).owner == "admin"
    with pytest.raises(ConfigError, match="owner"):
        Entry.from_dict({**entry.to_dict(), "owner": ""})
