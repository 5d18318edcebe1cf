"""A real worker process answers hostile or out-of-place requests with status codes, and
keeps serving."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipefb.processes import Process
from protos import job_pb2, server, tensor_pb2, wire, worker_pb2
from tests.conftest import Credentials, RoleStub, credentials, role_stub

ROOT = str(Path(__file__).resolve().parent.parent)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    """The worker's credentials; this module calls it as its coordinator and peers do."""
    return credentials(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, keys: Credentials) -> Iterator[str]:
    env = {**os.environ, "PYTHONPATH": ROOT, **keys.env}
    proc = Process("worker", ["-m", "worker", "--listen", "127.0.0.1:0"],
                   tmp_path_factory.mktemp("worker"), env)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def stub(worker: str, keys: Credentials) -> Iterator[RoleStub]:
    with role_stub(worker, keys) as both:
        yield both


def serving(address: str) -> bool:
    with server.channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def chunk(dtype: int = 3, shape: tuple[int, ...] = (2,), nbytes: int = 8, data: bytes = b"\0" * 8,
          job: str = "nojob") -> tensor_pb2.TensorChunk:
    return tensor_pb2.TensorChunk(
        transfer=tensor_pb2.Transfer(job_id=job, kind="RECV_F", tensor_count=1),
        headers=[tensor_pb2.TensorHeader(name="x", dtype=dtype, shape=shape, nbytes=nbytes)],
        data=data)


MALFORMED = {
    "bad dtype": [chunk(dtype=0)],
    "huge shape": [chunk(shape=(2**40, 2**40), nbytes=8)],
    "byte count mismatch": [chunk(nbytes=12)],
    "extra data": [chunk(data=b"\0" * 9)],
    "no transfer": [tensor_pb2.TensorChunk(data=b"\0")],
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("method", ["Activations", "Gradients", "Weights"])
def test_malformed_tensor_stream_gets_invalid_argument(stub: RoleStub,
                                                       worker: str, case: str,
                                                       method: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(iter(MALFORMED[case]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert serving(worker)


def test_wrong_receive_kind_is_invalid(stub: RoleStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Gradients(iter([chunk()]), timeout=10)  # a RECV_F transfer on the gradient RPC
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "RECV_F" in info.value.details()


def test_tensor_for_an_unassigned_job_is_a_failed_precondition(
        stub: RoleStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Activations(iter([chunk(job="other")]), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'other'" in info.value.details()


def test_step_without_assignment_is_a_failed_precondition(
        stub: RoleStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Step(worker_pb2.StepRequest(job_id="nojob", step=0), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(("field", "value", "named"), [
    ("model", "nope", "nope"), ("model_config_json", "{bad", "model config"),
    ("microbatches", 3, "microbatches 3"), ("schedule", "zigzag", "zigzag")])
def test_bad_assignment_is_invalid_argument(stub: RoleStub, field: str,
                                            value: object, named: str) -> None:
    spec = job_pb2.JobSpec(job_id="j", model="mlp", dataset="digits", loss="cross_entropy",
                           optimizer="sgd", lr=0.1, batch_size=8, microbatches=4, steps=1,
                           schedule="gpipe", workers=1, mode="sync")
    setattr(spec, field, value)
    plan = job_pb2.Plan(schedule="gpipe", microbatches=4, microbatch_size=2,
                        forward_partition=[0, 5], backward_partition=[0, 5],
                        policy=["keep"] * 5,
                        assignment=[job_pb2.WorkerAssignment(rank=0, role="combined")])
    with pytest.raises(grpc.RpcError) as info:
        stub.Assign(worker_pb2.AssignRequest(job=spec, plan=plan, rank=0, peers=["x:1"]),
                    timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in info.value.details()


def second_rank_assignment() -> worker_pb2.AssignRequest:
    """Rank 1 (stage 1: layers 2.. of the default mlp) of a 2-stage gpipe job."""
    spec = job_pb2.JobSpec(job_id="win", model="mlp", dataset="digits", loss="cross_entropy",
                           optimizer="sgd", lr=0.1, batch_size=8, microbatches=4, steps=1,
                           schedule="gpipe", workers=2, mode="sync")
    plan = job_pb2.Plan(schedule="gpipe", microbatches=4, microbatch_size=2,
                        forward_partition=[0, 2, 5], backward_partition=[0, 2, 5],
                        policy=["keep"] * 5,
                        assignment=[job_pb2.WorkerAssignment(rank=0, role="combined", stage=0),
                                    job_pb2.WorkerAssignment(rank=1, role="combined", stage=1)])
    return worker_pb2.AssignRequest(job=spec, plan=plan, rank=1,
                                    peers=["127.0.0.1:1", "127.0.0.1:2"])


def activation(step: int = 0, microbatch: int = 0, stage: int = 1, name: str = "x",
               shape: tuple[int, ...] = (2, 128), attempt: int = 0
               ) -> list[tensor_pb2.TensorChunk]:
    """A RECV_F transfer for job "win" (the default mlp's hidden width is 128)."""
    tensors = {name: torch.zeros(shape)}
    transfer = tensor_pb2.Transfer(job_id="win", kind="RECV_F", step=step,
                                   microbatch=microbatch, stage=stage, attempt=attempt)
    return list(wire.encode_stream(transfer, tensors))


REFUSED = {  # what the worker must refuse, and a word its message names
    "step beyond the window": (activation(step=3), "window"),
    "absurd step": (activation(step=10**9), "window"),
    "microbatch out of range": (activation(microbatch=4), "microbatch 4"),
    "stage it does not own": (activation(stage=0), "stage 0"),
    "wrong tensor name": (activation(name="y"), "['y']"),
    "wrong shape": (activation(shape=(2, 64)), "[2, 64]"),
    "tensor over the rank's largest": (activation(shape=(2, 1 << 20)), "exceeds"),
}


def test_only_expected_transfers_are_accepted(stub: RoleStub) -> None:
    stub.Assign(second_rank_assignment(), timeout=60)
    try:
        ack = stub.Activations(iter(activation(step=1)), timeout=10)  # a step ahead: fine
        assert ack.bytes == 2 * 128 * 4 and ack.tensors == 1
        for case, (messages, named) in REFUSED.items():
            with pytest.raises(grpc.RpcError) as info:
                stub.Activations(iter(messages), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
            assert named in info.value.details(), (case, info.value.details())
    finally:
        stub.Drain(worker_pb2.DrainRequest(job_id="win"), timeout=30)


def test_calls_of_another_attempt_are_fenced_off(stub: RoleStub,
                                                 worker: str) -> None:
    """[Note: attempt fencing]: after a restart assigned attempt 2, a transfer or Step of
    attempt 1 (a worker back from SIGSTOP, a stream from before) is refused, a late Drain
    of attempt 1 leaves the assignment alone, and attempt 2's own transfers pass."""
    request = second_rank_assignment()
    request.attempt = 2
    stub.Assign(request, timeout=60)
    try:
        for stale in (1, 3):
            with pytest.raises(grpc.RpcError) as info:
                stub.Activations(iter(activation(attempt=stale)), timeout=10)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"attempt {stale} of job 'win' is over" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(worker_pb2.StepRequest(job_id="win", step=0, attempt=1), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        late = stub.Drain(worker_pb2.DrainRequest(job_id="win", attempt=1), timeout=30)
        assert not late.drained
        ack = stub.Activations(iter(activation(attempt=2)), timeout=10)
        assert ack.tensors == 1
        assert serving(worker)
    finally:
        assert stub.Drain(worker_pb2.DrainRequest(job_id="win", attempt=2), timeout=30).drained


def test_migrate_serves_only_an_owner_s_paused_layers(stub: RoleStub
                                                      ) -> None:
    """`Migrate` streams layers a combined rank owns, at the step it is paused at; a layer
    it does not own, another step or another attempt is refused; a forward rank refuses
    outright (it owns nothing, and its next weight version must stay in its inbox)."""
    stub.Assign(second_rank_assignment(), timeout=60)  # rank 1: combined, layers 2..4
    request = worker_pb2.MigrateRequest(job_id="win", attempt=0, step=0, layers=[2],
                                        optimizer_layers=[2])
    _, tensors = wire.decode_stream(stub.Migrate(request, timeout=30))
    assert sorted(tensors) == ["layers.2.0.bias", "layers.2.0.weight"]  # SGD: no state yet
    for change, code in (({"layers": [0]}, grpc.StatusCode.INVALID_ARGUMENT),
                         ({"step": 3}, grpc.StatusCode.FAILED_PRECONDITION),
                         ({"attempt": 4}, grpc.StatusCode.FAILED_PRECONDITION)):
        bad = worker_pb2.MigrateRequest()
        bad.CopyFrom(request)
        for field, value in change.items():
            if isinstance(value, list):
                del getattr(bad, field)[:]
                getattr(bad, field).extend(value)
            else:
                setattr(bad, field, value)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Migrate(bad, timeout=30))
            pytest.fail(f"{change} was served")
        assert info.value.code() == code, info.value.details()
    forward = second_rank_assignment()
    forward.job.schedule = forward.plan.schedule = "pipefb"
    forward.job.job_id = "fwd"
    del forward.plan.assignment[:]
    forward.plan.assignment.extend([job_pb2.WorkerAssignment(rank=0, role="forward"),
                                    job_pb2.WorkerAssignment(rank=1, role="backward")])
    forward.plan.forward_partition[:] = forward.plan.backward_partition[:] = [0, 5]
    forward.plan.policy[:] = ["offload"] * 5
    forward.rank = 0
    stub.Assign(forward, timeout=60)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Migrate(worker_pb2.MigrateRequest(job_id="fwd", attempt=0, step=0,
                                                    layers=[0]), timeout=30))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "forward rank; it owns no layers" in refused.value.details()
