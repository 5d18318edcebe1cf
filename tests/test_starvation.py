"""Attacks on a running cluster's coordinator and workers, with real processes on
127.0.0.1: many followers of a training job, a coordinator stopped past the heartbeat
timeout, a Profile whose caller gave up, SIGTERM during a Profile, a tensor stream past
its deadline."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.client import CoordinatorClient
from coordinator.limits import Limits
from pipefb.app.local import LocalServices
from pipefb.job.config import JobConfig
from pipefb.processes import Process
from pipefb.runtime.reference import SingleProcess
from protos import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    job_pb2,
    server,
    tensor_pb2,
    wire,
    worker_pb2,
    worker_pb2_grpc,
)
from protos.convert import ProfileQuery, job_from_proto
from protos.security import Security
from tests.conftest import WORKER_THREADS, Credentials, credentials, worker_threads

HEARTBEAT_TIMEOUT = 3.0  # short, so a stall past it keeps the test short
MAX_RPCS = 100  # the coordinator's main port serves this many calls at once (gRPC's cap)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServices]:
    """Redis, a coordinator whose workers count as dead after HEARTBEAT_TIMEOUT s and
    whose main port serves MAX_RPCS calls at once, and 2 workers."""
    env = {"PIPEFB_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT), "PIPEFB_MAX_RPCS": str(MAX_RPCS)}
    with LocalServices(2, tmp_path_factory.mktemp("starvation"), threads=WORKER_THREADS,
                       extra_env=env) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalServices) -> Iterator[CoordinatorClient]:
    with CoordinatorClient(cluster.coordinator) as c:
        c.wait_for_workers(2)
        yield c


def job(name: str, steps: int) -> JobConfig:
    """A small 2-rank GPipe job."""
    return JobConfig(model="mlp", dataset="digits", schedule="gpipe", workers=2, steps=steps,
                     optimizer="sgd", job_id=name)


def wait_state(client: CoordinatorClient, job_id: str, states: tuple[str, ...],
               timeout: float = 120.0, step: int = 0) -> coordinator_pb2.JobStatus:
    """Polls until the job is in one of `states` (at `step` or later)."""
    deadline = time.monotonic() + timeout
    while True:
        status = client.status(job_id)
        if coordinator_pb2.JobState.Name(status.state) in states and status.step >= step:
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


FOLLOWERS = 60  # well above the coordinator's thread pool (Limits().threads)


def test_sixty_followers_hold_no_threads_starve_no_heartbeats_and_each_sees_every_step(
        client: CoordinatorClient) -> None:
    """60 Train streams of one caller on a running job: more than the coordinator has
    threads, fewer than its stream limits. Each follows to the end and gets every step
    report, heartbeats stay fresh, and the job ends DONE without a restart."""
    limits = Limits()
    assert limits.threads < FOLLOWERS <= limits.max_streams_per_caller
    steps = 40
    client.submit(job("followed", steps))
    outcomes: list[list[int] | grpc.RpcError] = [[] for _ in range(FOLLOWERS)]

    def follow(k: int) -> None:
        try:
            outcomes[k] = [r.step for r in client.train("followed")]
        except grpc.RpcError as error:
            outcomes[k] = error

    threads = [threading.Thread(target=follow, args=(k,)) for k in range(FOLLOWERS)]
    for t in threads:
        t.start()
    oldest = 0.0  # the oldest heartbeat any worker had while the job trained
    while client.status("followed").state not in (coordinator_pb2.DONE, coordinator_pb2.FAILED):
        oldest = max([oldest, *(w.last_heartbeat_age_seconds for w in client.workers())])
        time.sleep(0.2)
    for t in threads:
        t.join(60)
    status = client.status("followed")
    print(f"{FOLLOWERS} followers: oldest heartbeat {oldest:.2f} s while the job trained")
    assert status.state == coordinator_pb2.DONE, status.error
    assert not status.restarts and oldest < HEARTBEAT_TIMEOUT
    assert outcomes == [list(range(steps))] * FOLLOWERS  # each got every step, in order


def test_a_stalled_coordinator_does_not_blame_the_workers(cluster: LocalServices,
                                                          client: CoordinatorClient) -> None:
    client.submit(job("stalled", 200))
    wait_state(client, "stalled", ("RUNNING",), step=2)
    coordinator = cluster.process("coordinator")
    os.kill(coordinator.pid, signal.SIGSTOP)
    try:
        time.sleep(HEARTBEAT_TIMEOUT + 2.0)  # every worker looks silent for longer
    finally:
        os.kill(coordinator.pid, signal.SIGCONT)
    status = wait_state(client, "stalled", ("DONE", "FAILED"))
    assert status.state == coordinator_pb2.DONE, status.error
    assert not status.restarts and status.step == 200
    assert all(w.alive for w in client.workers())


def test_a_flood_past_the_main_port_s_cap_leaves_heartbeats_alone(
        cluster: LocalServices, client: CoordinatorClient) -> None:
    """While a job runs, user Train streams and health Watch streams of nobody (no token)
    hold every call the coordinator's main port serves (MAX_RPCS), and nobody keeps
    opening more (50 a second, at most 400) so a slot that frees is taken again: for 2 x
    the heartbeat timeout a call there is RESOURCE_EXHAUSTED by gRPC itself, a worker's
    Heartbeat among them. The workers heartbeat on their own port ([Note: workers' path]
    in coordinator/workerpath.py), so the job trains on through the flood, ends DONE
    without a restart, and its losses and weights are those of one process."""
    config = job("flooded", 300)
    client.submit(config)
    wait_state(client, "flooded", ("RUNNING",), step=2)
    follower = client.stub.Train(coordinator_pb2.TrainRequest(job_id="flooded"))
    reports: list[coordinator_pb2.StepReport] = []

    def read() -> None:
        for report in follower:
            reports.append(report)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    users = [client.stub.Train(coordinator_pb2.TrainRequest(job_id="flooded"))
             for _ in range(40)]
    nobody = grpc.insecure_channel(cluster.coordinator)
    watchers: list[grpc.Future] = []
    stop = threading.Event()

    def flood() -> None:
        while not stop.wait(0.02) and len(watchers) < 400:
            watchers.append(health_pb2_grpc.HealthStub(nobody).Watch(
                health_pb2.HealthCheckRequest()))

    token = cluster.service_token_file.read_text().strip()  # a worker's credential
    worker = coordinator_pb2_grpc.CoordinatorStub(server.channel(
        cluster.coordinator, Security(service_token=token)))
    logs = [cluster.process(f"worker-{k}").log_path for k in range(2)]
    before = [len(log.read_bytes()) for log in logs]
    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    refused = 0
    try:
        time.sleep(2.0)
        during, start = len(reports), time.monotonic()
        while time.monotonic() - start < 2 * HEARTBEAT_TIMEOUT:
            try:
                worker.Heartbeat(coordinator_pb2.HeartbeatRequest(worker_id=0), timeout=5)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                refused += 1
            time.sleep(0.5)
        during = len(reports) - during
    finally:
        stop.set()
        flooder.join(10)
        for call in (*watchers, *users):
            call.cancel()
        nobody.close()
    failed = [line for log, size in zip(logs, before, strict=True)
              for line in log.read_bytes()[size:].decode().splitlines() if "heartbeat" in line]
    reader.join(120)
    status = wait_state(client, "flooded", ("DONE", "FAILED"))
    print(f"{during} steps trained during the {2 * HEARTBEAT_TIMEOUT:.0f} s flood of "
          f"{len(watchers)} watchers and 40 followers; the main port refused {refused} of "
          f"12 heartbeats")
    # the flood held the cap (how many steps reached a follower meanwhile depends on the
    # host's load: the job's end, DONE without a restart, is what it must reach)
    assert refused >= 10
    assert failed == []  # no worker's heartbeat failed during the flood
    assert status.state == coordinator_pb2.DONE, status.error
    assert not status.restarts and reports[-1].step == 299
    with worker_threads():
        single = SingleProcess(replace(config, schedule="single"))
        want = {s.step: s.loss for s in single.run()}
        want_weights = single.weights()
    torch.testing.assert_close(torch.tensor([r.loss for r in reports]),
                               torch.tensor([want[r.step] for r in reports]),
                               rtol=1e-5, atol=0)
    weights = client.weights("flooded")
    for name, tensor in want_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-7, msg=name)


def profile_request(repeats: int) -> object:
    """A Profile of a model big enough to keep a worker busy for many seconds."""
    big = JobConfig(model="mlp", dataset="digits", schedule="gpipe", workers=2,
                    batch_size=512, microbatches=2, model_config={"hidden": 1024, "depth": 6})
    return ProfileQuery(big, 256, None, 2, repeats).to_proto()


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture()
def keys(tmp_path: Path) -> Credentials:
    """The lone worker's service credential; the tests call it as its coordinator does."""
    (tmp_path / "keys").mkdir()
    return credentials(tmp_path / "keys")


@pytest.fixture()
def worker(tmp_path: Path, keys: Credentials) -> Iterator[Process]:
    """A worker process of its own (registered nowhere)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           **keys.env}
    proc = Process("lone-worker", ["-m", "worker", "--listen", "127.0.0.1:0", "--threads", "1"],
                   tmp_path, env)
    proc.wait_ready()
    yield proc
    if proc.popen.poll() is None:
        proc.popen.kill()
        proc.popen.wait()


def test_a_profile_stops_when_its_deadline_passes_and_sigterm_ends_the_worker(
        worker: Process, keys: Credentials) -> None:
    stub = worker_pb2_grpc.StageWorkerStub(server.channel(worker.address, keys.coordinator))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Profile(profile_request(100), timeout=3.0)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(1.0)  # the profile notices at its next timed call
    before = cpu_seconds(worker.pid)
    time.sleep(2.0)
    idle = cpu_seconds(worker.pid) - before
    print(f"after the deadline the worker used {idle:.2f} CPU s in 2 s")
    assert idle < 0.5

    call = stub.Profile.future(profile_request(100), timeout=120.0)
    time.sleep(2.0)
    assert call.running()
    start = time.monotonic()
    worker.popen.send_signal(signal.SIGTERM)
    code = worker.popen.wait(timeout=30)
    seconds = time.monotonic() - start
    print(f"SIGTERM during a Profile: exit {code} after {seconds:.1f} s")
    assert seconds < 8.0
    assert call.exception() is not None


def test_step_calls_past_their_deadline_give_their_threads_back(worker: Process,
                                                                keys: Credentials) -> None:
    """40 Step calls for a step far ahead, each with a 1 s deadline: they wait for their
    turn only until then, so the worker's 32 threads come back and it keeps answering;
    one without a deadline waits until the job is drained."""
    from tests.test_worker_service import second_rank_assignment

    stub = worker_pb2_grpc.StageWorkerStub(server.channel(worker.address, keys.coordinator))
    stub.Assign(second_rank_assignment(), timeout=60)
    calls = [stub.Step.future(worker_pb2.StepRequest(job_id="win", step=5), timeout=1.0)
             for _ in range(40)]
    for call in calls:
        assert call.exception(timeout=30).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(1.0)
    with server.channel(worker.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    waiting = stub.Step.future(worker_pb2.StepRequest(job_id="win", step=5))  # no deadline
    time.sleep(1.0)
    assert waiting.running()  # it waits for its turn until the job is drained
    assert stub.Drain(worker_pb2.DrainRequest(job_id="win"), timeout=10).drained
    assert waiting.exception(timeout=30).code() == grpc.StatusCode.ABORTED


def test_a_running_step_whose_caller_gave_up_stops_and_the_worker_is_free(
        worker: Process, keys: Credentials) -> None:
    """A rank's step 0 waits for activations that never come. Its caller's 1 s deadline
    passes (DEADLINE_EXCEEDED), then a second Step's caller cancels: each running step
    stops at its wait within a second ([Note: callers that give up] in worker/caller.py),
    the next Step is told why at once (it waited out its own 5 s deadline before, while
    the step waited 300 s for the inbox), and a new Assign takes the worker at once."""
    from tests.test_worker_service import second_rank_assignment

    stub = worker_pb2_grpc.StageWorkerStub(server.channel(worker.address, keys.coordinator))
    for leave in ("deadline", "cancel"):
        stub.Assign(second_rank_assignment(), timeout=60)
        if leave == "deadline":
            with pytest.raises(grpc.RpcError) as caught:
                stub.Step(worker_pb2.StepRequest(job_id="win", step=0), timeout=1.0)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            running = stub.Step.future(worker_pb2.StepRequest(job_id="win", step=0))
            time.sleep(1.0)
            assert running.running()
            running.cancel()
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as next_step:
            stub.Step(worker_pb2.StepRequest(job_id="win", step=1), timeout=5.0)
        seconds = time.monotonic() - start
        print(f"{leave}: the next Step was answered after {seconds:.2f} s")
        assert next_step.value.code() == grpc.StatusCode.ABORTED
        assert "step 0 stopped: its caller gave up" in next_step.value.details()
        assert seconds < 2.0
        start = time.monotonic()
        assert stub.Assign(second_rank_assignment(), timeout=10).role == "combined"
        assert time.monotonic() - start < 5.0
        assert stub.Drain(worker_pb2.DrainRequest(job_id="win"), timeout=10).drained


def test_an_assign_whose_caller_gave_up_installs_nothing(worker: Process,
                                                         keys: Credentials) -> None:
    """An Assign of a large model outlives its caller's 0.3 s deadline: it stops at its
    next phase, says so in the worker's log, and leaves the worker unassigned (a Step of
    that job is FAILED_PRECONDITION), free for the next Assign."""
    from tests.test_worker_service import second_rank_assignment

    stub = worker_pb2_grpc.StageWorkerStub(server.channel(worker.address, keys.coordinator))
    big = second_rank_assignment()
    big.job.job_id = "big"
    big.job.model_config_json = '{"hidden": 2048, "depth": 8}'
    big.job.batch_size = 4096
    big.plan.forward_partition[:] = big.plan.backward_partition[:] = [0, 4, 9]
    big.plan.policy[:] = ["keep"] * 9
    big.plan.microbatch_size = 1024
    with pytest.raises(grpc.RpcError) as caught:
        stub.Assign(big, timeout=0.3)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 60.0
    while "Assign of job big rank 1 stopped: its caller gave up" not in (
            worker.log_path.read_text()):
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.1)
    with pytest.raises(grpc.RpcError) as step:
        stub.Step(worker_pb2.StepRequest(job_id="big", step=0), timeout=5.0)
    assert step.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.Assign(second_rank_assignment(), timeout=30).role == "combined"


@pytest.fixture()
def pair(tmp_path: Path, keys: Credentials) -> Iterator[list[Process]]:
    """Two worker processes of their own (registered nowhere): the two ranks of a job the
    test drives as its coordinator does."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           **keys.env}
    procs = [Process(f"rank-{r}", ["-m", "worker", "--listen", "127.0.0.1:0", "--threads",
                                   str(WORKER_THREADS)], tmp_path, env) for r in range(2)]
    for proc in procs:
        proc.wait_ready()
    yield procs
    for proc in procs:
        proc.stop()


def test_a_tensor_stream_past_its_deadline_ends_and_the_job_is_unharmed(
        pair: list[Process], keys: Credentials) -> None:
    """A peer's Activations stream to rank 1 sends half of step 0's first transfer, then
    stalls past its 1 s deadline: the stream ends DEADLINE_EXCEEDED, the half transfer
    never reaches the inbox (rank 0's own delivery of it is no duplicate, nor zeros), and
    the 2-rank job then trains its 2 steps as one process does, losses and weights."""
    from tests.test_worker_service import second_rank_assignment

    addresses = [p.address for p in pair]
    boss = [worker_pb2_grpc.StageWorkerStub(server.channel(a, keys.coordinator))
            for a in addresses]
    for rank in (0, 1):
        assign = second_rank_assignment()
        assign.job.steps, assign.rank, assign.peers[:] = 2, rank, addresses
        boss[rank].Assign(assign, timeout=60)
    (half,) = wire.encode_stream(tensor_pb2.Transfer(job_id="win", kind="RECV_F", stage=1),
                                 {"x": torch.ones(2, 128)})  # one message of 1024 bytes

    def stalled() -> Iterator[tensor_pb2.TensorChunk]:
        yield tensor_pb2.TensorChunk(transfer=half.transfer, headers=half.headers,
                                     data=half.data[:512])  # 512 of its 1024 bytes
        time.sleep(2.5)  # past the deadline
        yield tensor_pb2.TensorChunk(data=half.data[512:])

    peer = worker_pb2_grpc.StageWorkerStub(server.channel(addresses[1], keys.service))
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        peer.Activations(stalled(), timeout=1.0)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 2.0  # at its deadline, not at its next message
    losses: list[float] = []
    for step in (0, 1):
        calls = [stub.Step.future(worker_pb2.StepRequest(job_id="win", step=step), timeout=60)
                 for stub in boss]
        replies = [call.result() for call in calls]
        losses.append(sum(replies[1].losses) / len(replies[1].losses))
    weights: dict[str, torch.Tensor] = {}
    for stub in boss:
        weights.update(wire.decode_stream(stub.ExportWeights(
            job_pb2.ExportWeightsRequest(job_id="win"), timeout=30))[1])
    job = job_from_proto(second_rank_assignment().job)
    with worker_threads():
        single = SingleProcess(replace(job, steps=2, schedule="single"))
        want = [s.loss for s in single.run()]
        want_weights = single.weights()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0)
    assert sorted(weights) == sorted(want_weights)
    for name, tensor in want_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
    for stub in boss:
        assert stub.Drain(worker_pb2.DrainRequest(job_id="win"), timeout=30).drained


def lone_rank_assignment(address: str) -> worker_pb2.AssignRequest:
    """The only rank of a 1-rank gpipe job whose step computes for many seconds with no
    send or receive: 32 micro-batches through 8 layers of 2048 x 2048."""
    from tests.test_worker_service import second_rank_assignment

    big = second_rank_assignment()
    big.job.job_id, big.job.workers = "alone", 1
    big.job.model_config_json = '{"hidden": 2048, "depth": 8}'
    big.job.batch_size, big.job.microbatches = 4096, 32
    big.plan.microbatches, big.plan.microbatch_size = 32, 128
    big.plan.forward_partition[:] = big.plan.backward_partition[:] = [0, 9]
    big.plan.policy[:] = ["keep"] * 9
    big.plan.ClearField("assignment")
    big.plan.assignment.add(rank=0, role="combined", stage=0)
    big.rank, big.peers[:] = 0, [address]
    return big


def test_a_computing_step_whose_caller_gave_up_stops_at_its_next_action(
        worker: Process, keys: Credentials) -> None:
    """A step that only computes (no receive to end) outlives its caller's 2 s deadline:
    it stops before its next micro-batch's action ([Note: callers that give up] in
    worker/caller.py), so the worker is idle within a second or two (it computed on for
    the whole step before, tens of seconds), the next Step is ABORTED naming why, and the
    next Assign takes the worker."""
    from tests.test_worker_service import second_rank_assignment

    stub = worker_pb2_grpc.StageWorkerStub(server.channel(worker.address, keys.coordinator))
    stub.Assign(lone_rank_assignment(worker.address), timeout=120)
    start = cpu_seconds(worker.pid)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Step(worker_pb2.StepRequest(job_id="alone", step=0), timeout=2.0)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    busy = cpu_seconds(worker.pid) - start
    time.sleep(1.5)  # the step notices before its next action
    before = cpu_seconds(worker.pid)
    time.sleep(2.0)
    idle = cpu_seconds(worker.pid) - before
    print(f"the step used {busy:.2f} CPU s before its deadline, {idle:.2f} CPU s in 2 s "
          "from 1.5 s after it")
    assert busy > 0.5 and idle < 0.15  # it computed, then stopped
    with pytest.raises(grpc.RpcError) as next_step:
        stub.Step(worker_pb2.StepRequest(job_id="alone", step=1), timeout=5.0)
    assert next_step.value.code() == grpc.StatusCode.ABORTED
    assert "step 0 stopped: its caller gave up" in next_step.value.details()
    start = time.monotonic()  # no step runs: the Assign need not wait for one to end
    assert stub.Assign(second_rank_assignment(), timeout=30).role == "combined"
    print(f"the next Assign took {time.monotonic() - start:.2f} s")
    assert time.monotonic() - start < 3.0
    assert stub.Drain(worker_pb2.DrainRequest(job_id="win"), timeout=10).drained
