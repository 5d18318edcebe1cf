"""Attacks on the coordinator's limits, against a real Coordinator server on loopback
(coordinator/limits.py, coordinator/registry.py, pipefb/job/size.py): floods bounded in
count and time, each refusal one clear status with a retry hint, nothing lost."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.driver import Driver
from coordinator.limits import Admission, Limits, check_worker
from coordinator.registry import Registry
from coordinator.service import CoordinatorServicer
from pipefb.errors import ConfigError
from pipefb.job.config import MAX_CONFIG_DEPTH, JobConfig, parse_json_object
from pipefb.job.size import SizeLimits
from pipefb.secretfiles import write_private
from protos import coordinator_pb2, coordinator_pb2_grpc, server
from protos.aioserver import create_aio_server
from protos.convert import job_to_proto
from protos.security import Security
from tests.conftest import rss

TINY = JobConfig(model="mlp", dataset="digits", schedule="gpipe", workers=2, steps=2)
PUSHBACK = server.RETRY_PUSHBACK_KEY


@dataclass
class Coordinator:
    """A Coordinator served in this process, with its parts."""

    address: str
    stub: coordinator_pb2_grpc.CoordinatorStub
    servicer: CoordinatorServicer
    registry: Registry


@contextmanager
def coordinator(limits: Limits, heartbeat_timeout: float = 5.0, listen: str = "127.0.0.1"
                ) -> Iterator[Coordinator]:
    """A Coordinator server on `listen` (loopback) with `limits`; no store, no workers
    (jobs stay PENDING until the end, when they are drained)."""
    registry = Registry(timeout_seconds=heartbeat_timeout,
                        expire_seconds=limits.worker_expiry_seconds,
                        max_workers=limits.max_workers)
    driver = Driver(registry, "127.0.0.1:1", worker_wait_seconds=120.0)
    servicer = CoordinatorServicer(registry, driver, limits.size)
    srv, port, _ = create_aio_server(  # as python -m coordinator serves it
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
        f"{listen}:0", interceptors=(Admission(limits, servicer.unfinished),),
        max_workers=limits.threads)
    channel = server.channel(f"127.0.0.1:{port}")
    try:
        yield Coordinator(f"127.0.0.1:{port}", coordinator_pb2_grpc.CoordinatorStub(channel),
                          servicer, registry)
    finally:
        channel.close()
        driver.drain_all(5.0)
        srv.stop(0).wait()


def code_of(call: object) -> grpc.StatusCode:
    """The status code of a finished call or of the RpcError it raised."""
    return call.code()  # type: ignore[attr-defined, no-any-return]


def pushback_ms(error: grpc.RpcError) -> int:
    """The retry hint of a refusal (the gRPC retry pushback, milliseconds)."""
    trailers = dict(error.trailing_metadata())  # type: ignore[attr-defined]
    return int(trailers[PUSHBACK])


def refused(fn: object, *args: object) -> grpc.RpcError:
    """The RpcError a call raises (failing the test if it succeeds)."""
    with pytest.raises(grpc.RpcError) as caught:
        fn(*args, timeout=30)  # type: ignore[operator]
    return caught.value


# --- Limits at submit ---------------------------------------------------------------


def test_a_job_id_with_a_trailing_newline_is_refused() -> None:
    for bad in ("job-1\n", "job\n1", "a" * 65, ""):
        if bad:
            with pytest.raises(ConfigError, match="job id"):
                JobConfig(job_id=bad)
    assert JobConfig(job_id="job-1").job_id == "job-1"


def test_json_configs_are_capped_in_depth_and_size_without_recursion() -> None:
    deep = "[" * 50_000 + "]" * 50_000
    with pytest.raises(ConfigError, match=f"nested deeper than {MAX_CONFIG_DEPTH}"):
        parse_json_object('{"a": ' + deep + "}", "model config")
    just_deep_enough = '{"a": ' + "[" * (MAX_CONFIG_DEPTH - 1) + "]" * (MAX_CONFIG_DEPTH - 1) + "}"
    assert parse_json_object(just_deep_enough, "model config")
    too_deep = '{"a": ' + "[" * MAX_CONFIG_DEPTH + "]" * MAX_CONFIG_DEPTH + "}"
    with pytest.raises(ConfigError, match="nested deeper"):
        parse_json_object(too_deep, "model config")
    nested: dict[str, object] = {}
    node = nested
    for _ in range(10_000):  # a dict from a job file parsed elsewhere: no recursion either
        node["a"] = node = {}
    with pytest.raises(ConfigError, match="nested deeper"):
        parse_json_object(nested, "job file")
    with pytest.raises(ConfigError, match="characters; at most"):
        parse_json_object(json.dumps({"a": "x" * (2 << 20)}), "dataset config")


def test_deep_or_huge_json_over_grpc_is_one_line_of_invalid_argument() -> None:
    with coordinator(Limits()) as c:
        spec = job_to_proto(TINY)
        spec.model_config_json = '{"a": ' + "[" * 50_000 + "]" * 50_000 + "}"
        error = refused(c.stub.SubmitJob, spec)
        assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == (  # type: ignore[attr-defined]
            f"ConfigError: model config is nested deeper than {MAX_CONFIG_DEPTH} levels")
        spec = job_to_proto(TINY)
        spec.dataset_config_json = json.dumps({"a": "x" * (3 << 20)})
        error = refused(c.stub.SubmitJob, spec)
        assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT
        assert "dataset config has" in error.details()  # type: ignore[attr-defined]
        assert not c.servicer.unfinished()


def test_a_huge_model_is_refused_before_anything_is_allocated() -> None:
    limits = Limits(size=SizeLimits(max_layers=64, max_parameters=10_000_000,
                                    max_activation_bytes=1 << 20))
    with coordinator(limits) as c:
        reply = c.stub.SubmitJob(job_to_proto(TINY), timeout=30)  # warm: imports, dataset
        assert reply.state == coordinator_pb2.PENDING
        before, start = rss_self(), time.monotonic()
        cases = {  # spec -> what the one-line refusal names
            '{"hidden": 100000}': "has 20007700010 parameters; this coordinator accepts "
                                  "at most 10000000",
            '{"depth": 5000}': "has 5002 layers (loss included); this coordinator accepts "
                               "at most 64",
            '{"hidden": 4096, "depth": 8}': "parameters; this coordinator accepts at most",
        }
        for model_config, message in cases.items():
            spec = job_to_proto(TINY)
            spec.model_config_json = model_config
            error = refused(c.stub.SubmitJob, spec)
            assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT
            assert message in error.details(), error.details()  # type: ignore[attr-defined]
            assert "\n" not in error.details()  # type: ignore[attr-defined]
        wide = job_to_proto(JobConfig(model="mlp", dataset="digits", schedule="gpipe",
                                      workers=2, batch_size=4096, microbatches=4,
                                      model_config={"hidden": 1024, "depth": 2}))
        # 4 micro-batches x (1024 x (64 + 1024 + 1024 + 10) x 4 B + 1024 int64 targets)
        error = refused(c.stub.SubmitJob, wide)
        assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == (  # type: ignore[attr-defined]
            "ConfigError: model 'mlp' with micro-batches of 1024 samples makes 34799616 "
            "bytes of activations per step; this coordinator accepts at most 1048576")
        seconds, grown = time.monotonic() - start, rss_self() - before
        print(f"4 oversized submits refused in {seconds:.2f} s, +{grown >> 20} MiB resident")
        assert seconds < 20 and grown < 64 << 20  # 20 G parameters would be 80 GB
        assert c.servicer.unfinished() == {reply.job_id}  # the refused ones left nothing


def rss_self() -> int:
    """This process's resident bytes."""
    import os

    return rss(os.getpid())


# --- Registrations ------------------------------------------------------------------


def test_worker_addresses_are_validated() -> None:
    for good in ("127.0.0.1:5000", "pipefb-worker-0.pipefb-worker:50052", "[::1]:1",
                 "localhost:65535"):
        check_worker(good, "w")
    for bad in ("", "host", "host:0", "host:65536", "host:port", "a b:1", "-x:1", "[::zz]:1",
                "h\n:1", "héllo:1", "x" * 300 + ":1", "host:١٢"):
        with pytest.raises(ConfigError, match="worker address"):
            check_worker(bad, "w")
    with pytest.raises(ConfigError, match="worker name has 129 characters"):
        check_worker("h:1", "n" * 129)


def register_many(c: Coordinator, addresses: list[str]) -> dict[grpc.StatusCode, int]:
    """Registers each address in turn; the count of each status code. Every refusal is
    INVALID_ARGUMENT or RESOURCE_EXHAUSTED with a retry hint."""
    codes: dict[grpc.StatusCode, int] = {}
    for k, address in enumerate(addresses):
        try:
            c.stub.RegisterWorker(coordinator_pb2.RegisterWorkerRequest(
                address=address, name=f"w{k}"), timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = code_of(error)
            assert code in (grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.RESOURCE_EXHAUSTED), error
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert 0 < pushback_ms(error) <= 60_000
        codes[code] = codes.get(code, 0) + 1
    return codes


def still_serves(c: Coordinator, workers: int, capsys: pytest.CaptureFixture[str]) -> None:
    """ListWorkers lists `workers` short addresses, `pipefb status` prints them, and user
    calls are answered."""
    from pipefb.app.cli import main

    listed = c.stub.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=10).workers
    assert len(listed) == workers and all(len(w.address) < 40 for w in listed)
    capsys.readouterr()
    assert main(["status", "--coordinator", c.address]) == 0
    assert len(capsys.readouterr().out.splitlines()) == workers
    error = refused(c.stub.GetJob, coordinator_pb2.GetJobRequest(job_id="none"))
    assert code_of(error) == grpc.StatusCode.NOT_FOUND


def test_a_registration_flood_is_refused_or_bounded_and_listing_still_works(
        capsys: pytest.CaptureFixture[str]) -> None:
    no_rate = Limits(max_workers=100, registrations_per_second=1e6, registration_burst=10**6)
    with coordinator(no_rate) as c:
        addresses = (["x" * 1024 + f":{k}" for k in range(1000)]  # 1 KB addresses
                     + [f"bad host {k}:1" for k in range(1000)]  # malformed ones
                     + [f"10.0.{k // 250}.{k % 250}:1000" for k in range(1000)])
        start = time.monotonic()
        codes = register_many(c, addresses)
        print(f"3000 registrations in {time.monotonic() - start:.1f} s: {codes}")
        assert codes == {grpc.StatusCode.INVALID_ARGUMENT: 2000, grpc.StatusCode.OK: 100,
                         grpc.StatusCode.RESOURCE_EXHAUSTED: 900}  # the table's cap
        still_serves(c, 100, capsys)
    rate = Limits(registrations_per_second=50.0)
    with coordinator(rate) as c:
        start = time.monotonic()
        codes = register_many(c, [f"10.1.{k // 250}.{k % 250}:1000" for k in range(1000)])
        seconds = time.monotonic() - start
        print(f"1000 registrations in {seconds:.1f} s: {codes}")
        ok = codes[grpc.StatusCode.OK]
        assert rate.registration_burst <= ok <= rate.registration_burst + 50 * seconds + 1
        assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] == 1000 - ok
        still_serves(c, ok, capsys)


def test_the_worker_table_is_capped_and_silent_workers_expire() -> None:
    limits = Limits(max_workers=5, worker_expiry_seconds=1.5)
    with coordinator(limits, heartbeat_timeout=1.0) as c:
        for k in range(5):
            c.stub.RegisterWorker(coordinator_pb2.RegisterWorkerRequest(
                address=f"127.0.0.1:{2000 + k}", name=f"w{k}"), timeout=10)
        error = refused(c.stub.RegisterWorker, coordinator_pb2.RegisterWorkerRequest(
            address="127.0.0.1:3000", name="late"))
        assert code_of(error) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "5 workers registered, its limit; retry in 1.5 s" in error.details()
        assert pushback_ms(error) == 1500
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # one worker keeps heartbeating
            assert c.stub.Heartbeat(coordinator_pb2.HeartbeatRequest(
                worker_id=0, address="127.0.0.1:2000"), timeout=5).known
            time.sleep(0.2)
        time.sleep(1.0)
        assert c.stub.Heartbeat(coordinator_pb2.HeartbeatRequest(
            worker_id=0, address="127.0.0.1:2000"), timeout=5).known
        listed = c.stub.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=10).workers
        assert [w.address for w in listed] == ["127.0.0.1:2000"]
        assert not c.stub.Heartbeat(coordinator_pb2.HeartbeatRequest(  # told to register
            worker_id=1, address="127.0.0.1:2001"), timeout=5).known
        c.stub.RegisterWorker(coordinator_pb2.RegisterWorkerRequest(
            address="127.0.0.1:3000", name="late"), timeout=10)


# --- Streams and submits ------------------------------------------------------------


def test_followers_beyond_the_limit_are_refused_and_heartbeats_still_answered() -> None:
    limits = Limits(max_streams=4, max_streams_per_caller=3, max_calls=2, max_submits=1)
    with coordinator(limits) as c:
        job = c.stub.SubmitJob(job_to_proto(TINY), timeout=30).job_id  # PENDING: no workers
        worker = c.stub.RegisterWorker(coordinator_pb2.RegisterWorkerRequest(
            address="127.0.0.1:2000", name="w"), timeout=10).worker_id
        calls = [c.stub.Train(coordinator_pb2.TrainRequest(job_id=job)) for _ in range(40)]
        results: list[grpc.RpcError | None] = [None] * 40

        def follow(k: int) -> None:
            try:
                for _ in calls[k]:
                    pass
            except grpc.RpcError as error:
                results[k] = error

        threads = [threading.Thread(target=follow, args=(k,), daemon=True) for k in range(40)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        refusals = [r for r in results if r is not None]
        assert len(refusals) == 40 - limits.max_streams_per_caller
        for error in refusals:
            assert code_of(error) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "follows 3 streams, its limit; retry in 5 s" in error.details()
            assert pushback_ms(error) == 5000
        start = time.monotonic()  # the followers hold their threads; heartbeats still pass
        for _ in range(100):
            assert c.stub.Heartbeat(coordinator_pb2.HeartbeatRequest(
                worker_id=worker, address="127.0.0.1:2000"), timeout=2).known
        print(f"100 heartbeats beside 3 followers in {time.monotonic() - start:.2f} s")
        assert c.stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job), timeout=5).job_id == job
        for call in calls:
            call.cancel()
        for t in threads:
            t.join(10)
        deadline = time.monotonic() + 5.0  # the slots come back once the handlers see it
        while True:
            again = c.stub.Train(coordinator_pb2.TrainRequest(job_id=job))
            time.sleep(0.3)
            if again.running() or time.monotonic() > deadline:
                break
        assert again.running()
        again.cancel()


def test_simultaneous_submits_beyond_the_limit_are_refused_and_none_is_lost() -> None:
    limits = Limits(max_jobs=6, max_jobs_per_caller=4, max_submits=2)
    with coordinator(limits) as c:
        replies: list[coordinator_pb2.JobStatus | grpc.RpcError] = []
        lock, go = threading.Lock(), threading.Event()

        def submit() -> None:
            go.wait()
            try:
                reply: coordinator_pb2.JobStatus | grpc.RpcError = c.stub.SubmitJob(
                    job_to_proto(TINY), timeout=60)
            except grpc.RpcError as error:
                reply = error
            with lock:
                replies.append(reply)

        threads = [threading.Thread(target=submit) for _ in range(60)]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join(120)
        accepted = [r for r in replies if isinstance(r, coordinator_pb2.JobStatus)]
        refusals = [r for r in replies if isinstance(r, grpc.RpcError)]
        assert len(replies) == 60 and 1 <= len(accepted) <= limits.max_jobs_per_caller
        for error in refusals:
            assert code_of(error) == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            assert "its limit; retry in" in error.details()
            assert pushback_ms(error) > 0
        ids = {r.job_id for r in accepted}
        assert len(ids) == len(accepted) and c.servicer.unfinished() == ids  # none lost
        for job_id in ids:
            status = c.stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id), timeout=5)
            assert status.state == coordinator_pb2.PENDING
        while len(c.servicer.unfinished()) < limits.max_jobs_per_caller:  # fill up, in turn
            c.stub.SubmitJob(job_to_proto(TINY), timeout=60)
        error = refused(c.stub.SubmitJob, job_to_proto(TINY))
        assert "has 4 unfinished jobs, its limit; retry in 10 s" in error.details()
        stopped = sorted(c.servicer.unfinished())[0]
        c.stub.StopJob(coordinator_pb2.StopJobRequest(job_id=stopped), timeout=5)
        deadline = time.monotonic() + 10
        while stopped in c.servicer.unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stub.SubmitJob(job_to_proto(TINY), timeout=60).state == coordinator_pb2.PENDING


def follow(stub: coordinator_pb2_grpc.CoordinatorStub, job: str, count: int
           ) -> list[grpc.Future]:
    """`count` Train streams of `job` opened at once (each waits for the PENDING job)."""
    return [stub.Train(coordinator_pb2.TrainRequest(job_id=job)) for _ in range(count)]


def test_per_caller_limits_follow_the_user_not_the_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Alice and bob on one machine, alice calling over IPv4 and IPv6 (two peer hosts):
    alice's flood of 12 followers gets her 3 (`max_streams_per_caller`) whichever host
    they come from, the other 9 RESOURCE_EXHAUSTED with a retry hint, while bob's 3 are
    served; the same for unfinished jobs (2 each). [Note: callers] in coordinator/limits.py."""
    tokens = {name: secrets.token_hex(16) for name in ("admin", "alice", "bob")}
    monkeypatch.setenv("PIPEFB_TOKEN_FILE", str(write_private(tmp_path / "admin",
                                                              tokens["admin"])))
    monkeypatch.setenv("PIPEFB_USERS_FILE", str(write_private(
        tmp_path / "users", f"alice {tokens['alice']}\nbob {tokens['bob']}\n")))
    limits = Limits(max_streams=8, max_streams_per_caller=3, max_jobs_per_caller=2)
    with coordinator(limits, listen="localhost") as c:
        port = c.address.rsplit(":", 1)[1]

        def stub(host: str, user: str) -> coordinator_pb2_grpc.CoordinatorStub:
            channel = server.channel(f"{host}:{port}", Security(token=tokens[user]))
            return coordinator_pb2_grpc.CoordinatorStub(channel)

        alice = [stub("127.0.0.1", "alice"), stub("[::1]", "alice")]
        bob = stub("127.0.0.1", "bob")
        jobs = [a.SubmitJob(job_to_proto(TINY), timeout=30).job_id for a in alice]
        error = refused(alice[1].SubmitJob, job_to_proto(TINY))
        assert code_of(error) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "alice has 2 unfinished jobs, its limit; retry in 10 s" in error.details()
        bobs = bob.SubmitJob(job_to_proto(TINY), timeout=30).job_id
        start = time.monotonic()
        floods = follow(alice[0], jobs[0], 2) + follow(alice[1], jobs[1], 10)
        time.sleep(1.0)
        served = follow(bob, bobs, 3)
        time.sleep(1.5)
        assert time.monotonic() - start < 10.0
        try:
            assert sum(call.running() for call in floods) == limits.max_streams_per_caller
            assert all(call.running() for call in served)  # bob's budget is his own
            refusals = [call for call in floods if not call.running()]
            for call in refusals:
                assert code_of(call) == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "alice follows 3 streams, its limit; retry in 5 s" in call.details()
                assert pushback_ms(call) == 5000  # type: ignore[arg-type]
        finally:
            for call in floods + served:
                call.cancel()


def test_the_workers_port_serves_workers_only(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' own port ([Note: workers' path] in coordinator/workerpath.py): a worker
    (the service credential) registers and heartbeats there, and the reply of a
    registration names that port; a user token is PERMISSION_DENIED, no token
    UNAUTHENTICATED, a user RPC and the health service UNIMPLEMENTED."""
    from coordinator.workerpath import serve_worker_path

    tokens = {name: secrets.token_hex(16) for name in ("admin", "service")}
    monkeypatch.setenv("PIPEFB_TOKEN_FILE", str(write_private(tmp_path / "a", tokens["admin"])))
    monkeypatch.setenv("PIPEFB_SERVICE_TOKEN_FILE",
                       str(write_private(tmp_path / "s", tokens["service"])))
    with coordinator(Limits()) as c:
        admission = Admission(Limits(), c.servicer.unfinished)
        workers, port = serve_worker_path(c.servicer, "127.0.0.1:0", admission)
        try:
            def stub(token: Security | None) -> coordinator_pb2_grpc.CoordinatorStub:
                channel = (server.channel(f"127.0.0.1:{port}", token) if token else
                           grpc.insecure_channel(f"127.0.0.1:{port}"))
                return coordinator_pb2_grpc.CoordinatorStub(channel)

            worker = stub(Security(service_token=tokens["service"]))
            request = coordinator_pb2.RegisterWorkerRequest(address="127.0.0.1:2000", name="w")
            reply = worker.RegisterWorker(request, timeout=10)
            assert reply.heartbeat_port == port
            main = coordinator_pb2_grpc.CoordinatorStub(server.channel(
                c.address, Security(service_token=tokens["service"])))
            assert main.RegisterWorker(request, timeout=10).heartbeat_port == port
            assert worker.Heartbeat(coordinator_pb2.HeartbeatRequest(
                worker_id=reply.worker_id, address="127.0.0.1:2000"), timeout=10).known
            beat = coordinator_pb2.HeartbeatRequest(worker_id=reply.worker_id)
            for token, code in ((Security(token=tokens["admin"]),
                                 grpc.StatusCode.PERMISSION_DENIED),
                                (None, grpc.StatusCode.UNAUTHENTICATED)):
                assert code_of(refused(stub(token).Heartbeat, beat)) == code
            assert code_of(refused(stub(Security(token=tokens["admin"])).GetJob,
                                   coordinator_pb2.GetJobRequest(job_id="x"))
                           ) == grpc.StatusCode.UNIMPLEMENTED
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                assert code_of(refused(health.Check, health_pb2.HealthCheckRequest())
                               ) == grpc.StatusCode.UNIMPLEMENTED
        finally:
            workers.stop(0).wait()
