"""Same-host hops (dataplane/localhop.py): tensors arrive bit for bit, a real worker
process refuses on its hop socket what it refuses on gRPC, with the same status, and the
transport picks the hop socket only where one serves the peer."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dataplane.grpc_transport import GrpcTransport
from dataplane.inbox import Inbox
from dataplane.localhop import HopListener, HopSender, socket_path
from offload_store import RedisServer, open_store
from offload_store.writer import StashWriter
from pipefb.errors import WorkerFailed
from pipefb.processes import Process
from pipefb.schedule import Kind
from protos import server, tensor_pb2, worker_pb2, worker_pb2_grpc
from tests.conftest import Credentials, credentials
from tests.test_worker_service import second_rank_assignment

ROOT = str(Path(__file__).resolve().parent.parent)
Received = list[tuple[tensor_pb2.Transfer, dict[str, torch.Tensor]]]


@pytest.fixture()
def hop_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "hops"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("PIPEFB_HOP_DIR", str(folder))
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture()
def listener(hop_dir: Path) -> Iterator[tuple[HopListener, Received, int]]:
    got: Received = []
    port = free_port()
    hops = HopListener.serve(port, lambda t, x: got.append((t, x)), lambda: 1 << 20)
    yield hops, got, port
    hops.close()


def wait_for(condition: object, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        if time.monotonic() > end:
            raise TimeoutError("condition not met")
        time.sleep(0.01)


def refused(sender: HopSender, transfer: tensor_pb2.Transfer,
            tensors: dict[str, torch.Tensor]) -> str:
    """The refusal of a transfer: raised by the send itself when the receiver hung up
    before the last byte, else by a later check."""
    try:
        sender.send(transfer, tensors)
    except WorkerFailed as error:
        return str(error)
    return refusal(sender)


def refusal(sender: HopSender) -> str:
    """The refusal the receiver sent back (it arrives after the send returned)."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            sender.check()
        except WorkerFailed as error:
            return str(error)
        time.sleep(0.01)
    raise TimeoutError("no refusal")


TENSORS = {
    "f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16),
    "i64": torch.arange(-4, 4), "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5, dtype=torch.float64), "empty": torch.zeros(0, 4),
    "big": torch.randn(200_000), "strided": torch.randn(6, 4).t(),
}


def test_tensors_arrive_bit_for_bit_in_order(listener: tuple[HopListener, Received, int]
                                             ) -> None:
    _, got, port = listener
    path = socket_path(f"127.0.0.1:{port}")
    assert path is not None and path.exists()
    sender = HopSender(path, "peer", "", 10)
    for step in range(3):
        sender.send(tensor_pb2.Transfer(job_id="j", step=step, kind="RECV_F"), TENSORS)
    wait_for(lambda: len(got) == 3)
    sender.close()
    assert [t.step for t, _ in got] == [0, 1, 2]
    for transfer, tensors in got:
        assert transfer.tensor_count == len(TENSORS) and list(tensors) == list(TENSORS)
        for name, tensor in TENSORS.items():
            assert tensors[name].dtype == tensor.dtype and tensors[name].shape == tensor.shape
            assert torch.equal(tensors[name], tensor), name


@pytest.fixture()
def held(hop_dir: Path) -> Iterator[tuple[HopListener, Received, int, threading.Event]]:
    """A listener whose delivery waits for the event: its reader takes nothing more."""
    got: Received = []
    gate, port = threading.Event(), free_port()

    def deliver(transfer: tensor_pb2.Transfer, tensors: dict[str, torch.Tensor]) -> None:
        gate.wait(30)
        got.append((transfer, tensors))

    hops = HopListener.serve(port, deliver, lambda: 64 << 20)
    yield hops, got, port, gate
    gate.set()
    hops.close()


def sender_to(port: int, timeout: float) -> HopSender:
    """A hop sender to the listener on `port`, failing a send after `timeout` s."""
    path = socket_path(f"127.0.0.1:{port}")
    assert path is not None
    return HopSender(path, "peer", "", timeout)


def test_a_large_transfer_leaves_the_callers_thread_and_keeps_its_place(
        held: tuple[HopListener, Received, int, threading.Event]) -> None:
    _, got, port, gate = held
    sender = sender_to(port, 30)
    small, big = torch.arange(4.0), torch.randn(4 << 20)  # 16 MiB: more than the socket holds
    sender.send(tensor_pb2.Transfer(job_id="j", step=0, kind="RECV_F"), {"x": small})
    sender.send(tensor_pb2.Transfer(job_id="j", step=1, kind="RECV_F"), {"x": big})
    sender.send(tensor_pb2.Transfer(job_id="j", step=2, kind="RECV_F"), {"x": small})
    assert got == [] and not gate.is_set()  # the sends returned with the receiver stalled
    gate.set()
    sender.check()  # returns once the writer wrote everything
    wait_for(lambda: len(got) == 3)
    sender.close()
    assert [t.step for t, _ in got] == [0, 1, 2]
    assert torch.equal(got[1][1]["x"], big) and torch.equal(got[2][1]["x"], small)


def test_a_peer_that_takes_no_data_fails_the_check(
        held: tuple[HopListener, Received, int, threading.Event]) -> None:
    _, _, port, _ = held
    sender = sender_to(port, 1)
    sender.send(tensor_pb2.Transfer(job_id="j", step=0, kind="RECV_F"), {"x": torch.ones(1)})
    sender.send(tensor_pb2.Transfer(job_id="j", step=1, kind="RECV_F"),
                {"x": torch.randn(4 << 20)})
    with pytest.raises(WorkerFailed, match="peer"):
        sender.check()
    with pytest.raises(WorkerFailed, match="closed"):
        sender.send(tensor_pb2.Transfer(job_id="j", step=2, kind="RECV_F"), {"x": torch.ones(1)})
    sender.close()


def test_oversized_and_malformed_frames_are_refused_before_allocation(
        listener: tuple[HopListener, Received, int]) -> None:
    _, got, port = listener
    path = socket_path(f"127.0.0.1:{port}")
    assert path is not None
    sender = HopSender(path, "peer", "", 10)
    message = refused(sender, tensor_pb2.Transfer(job_id="j", kind="RECV_F"),
                      {"x": torch.zeros(1 << 19)})
    assert "INVALID_ARGUMENT" in message and "exceeds" in message, message
    with pytest.raises(WorkerFailed, match="closed"):
        sender.send(tensor_pb2.Transfer(job_id="j", kind="RECV_F"), {"x": torch.zeros(1)})
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(str(path))
    raw.sendall(struct.pack("<I", 0))  # no credential needed: this listener knows none
    assert raw.recv(1) == b"\x01"
    raw.sendall(struct.pack("<I", 1 << 30))  # a header frame of 1 GiB
    assert b"exceeds" in raw.recv(4096)
    raw.close()
    assert got == []


def test_peers_off_this_host_or_without_a_private_folder_get_none(hop_dir: Path) -> None:
    assert socket_path("10.0.0.5:5000") is None
    assert socket_path("worker-1.workers:5000") is None
    assert socket_path("127.0.0.1:5000") == hop_dir / "hop-5000.sock"
    hop_dir.chmod(0o755)  # others may enter: no socket there is trusted
    assert socket_path("127.0.0.1:5000") is None
    with pytest.raises(Exception, match="only it may enter"):
        HopListener.serve(5000, lambda t, x: None, lambda: 1)


def test_transport_sends_over_the_hop_socket_only_where_one_serves(
        listener: tuple[HopListener, Received, int]) -> None:
    _, got, port = listener
    x = torch.randn(4, 8)
    inbox = Inbox(10)
    transport = GrpcTransport("j", [f"127.0.0.1:{port}"], None, inbox)
    transport.send(Kind.RECV_F, 0, 5, 1, 2, 5, {"x": x})
    assert transport.flush() == x.nbytes
    wait_for(lambda: len(got) == 1)
    transfer, tensors = got[0]
    assert (transfer.job_id, transfer.kind, transfer.step, transfer.stage,
            transfer.microbatch, transfer.version) == ("j", "RECV_F", 5, 1, 2, 5)
    assert torch.equal(tensors["x"], x)
    transport.close()
    from calibration.links import serve  # a gRPC receiver with no hop socket

    srv, address = serve(inbox)
    try:
        plain = GrpcTransport("j", [address], None, inbox)
        plain.send(Kind.RECV_F, 0, 6, 0, 0, 0, {"x": x})
        assert torch.equal(plain.recv(Kind.RECV_F, 6, 0, 0)["x"], x)
        plain.close()
    finally:
        srv.stop(0)
    assert len(got) == 1


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    return credentials(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, keys: Credentials
           ) -> Iterator[tuple[str, Path]]:
    """A real worker process with its hop socket in a folder of this test's."""
    folder = tmp_path_factory.mktemp("hopdir")
    folder.chmod(0o700)
    env = {**os.environ, "PYTHONPATH": ROOT, **keys.env, "PIPEFB_HOP_DIR": str(folder)}
    proc = Process("worker", ["-m", "worker", "--listen", "127.0.0.1:0"],
                   tmp_path_factory.mktemp("worker"), env)
    try:
        address = proc.wait_ready()
        yield address, folder / f"hop-{address.rsplit(':', 1)[1]}.sock"
    finally:
        proc.stop()


def activation(step: int = 1, microbatch: int = 0, stage: int = 1, name: str = "x",
               shape: tuple[int, ...] = (2, 128), attempt: int = 0, job: str = "win"
               ) -> tuple[tensor_pb2.Transfer, dict[str, torch.Tensor]]:
    """A RECV_F transfer for job "win" (the default mlp's hidden width is 128)."""
    return (tensor_pb2.Transfer(job_id=job, kind="RECV_F", step=step, microbatch=microbatch,
                                stage=stage, attempt=attempt), {name: torch.zeros(shape)})


REFUSED = {  # what the worker must refuse on its hop socket, its status and a named word
    "step beyond the window": (activation(step=3), "INVALID_ARGUMENT", "window"),
    "microbatch out of range": (activation(microbatch=4), "INVALID_ARGUMENT", "microbatch 4"),
    "stage it does not own": (activation(stage=0), "INVALID_ARGUMENT", "stage 0"),
    "wrong tensor name": (activation(name="y"), "INVALID_ARGUMENT", "['y']"),
    "wrong shape": (activation(shape=(2, 64)), "INVALID_ARGUMENT", "[2, 64]"),
    "tensor over the rank's largest": (activation(shape=(2, 1 << 20)), "INVALID_ARGUMENT",
                                       "exceeds"),
    "another attempt": (activation(attempt=1), "FAILED_PRECONDITION", "attempt 1"),
    "another job": (activation(job="other"), "FAILED_PRECONDITION", "'other'"),
}


def test_worker_refuses_on_its_hop_socket_what_it_refuses_on_grpc(
        worker: tuple[str, Path], keys: Credentials) -> None:
    address, path = worker
    assert path.exists()
    with pytest.raises(WorkerFailed, match="refused this worker's service credential"):
        HopSender(path, "worker", "not-the-token", 10)
    token = keys.service.service_token
    with server.channel(address, keys.coordinator) as ch:  # control calls: the coordinator's
        stub = worker_pb2_grpc.StageWorkerStub(ch)
        stub.Assign(second_rank_assignment(), timeout=60)
        try:
            for k, (case, ((transfer, tensors), code, named)) in enumerate(REFUSED.items()):
                sender = HopSender(path, "worker", token, 10)
                sender.send(*activation(step=k // 4, microbatch=k % 4))  # accepted
                message = refused(sender, transfer, tensors)
                assert code in message and named in message, (case, message)
        finally:
            stub.Drain(worker_pb2.DrainRequest(job_id="win"), timeout=30)


def test_hop_latency_bench_quick(tmp_path: Path) -> None:
    from bench import hop_latency

    res = hop_latency.main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "results.json").exists()
    for gap in ("back_to_back", "idle"):
        assert set(res["one_way_seconds"][gap]) == {"hop", "grpc", "tcp"}
        for s in res["one_way_seconds"][gap].values():
            assert s["n"] == 20 and 0 < s["min"] <= s["median"] <= s["max"]
    page = "\n".join(hop_latency.doc_section("cmd", res))
    assert "| hop |" in page and "| grpc |" in page and "| tcp |" in page


def test_a_fenced_transfer_takes_the_hop_once_the_stashes_before_it_are_written(
        hop_dir: Path) -> None:
    """A PipeFB forward rank's transfer leaves after its earlier stashes are in the store
    ([Note: background stash]): the hop's writer thread waits for them, then sends. A
    48 MiB stash takes Redis tens of milliseconds; the small transfer sent right after it
    arrives only once the write is done, and by the hop (no gRPC server listens)."""
    written_at_arrival: list[bool] = []
    with RedisServer(maxmemory="512mb") as srv:
        writer = StashWriter(open_store(srv.address, "fence", 0), cap_bytes=1 << 30)
        port = free_port()
        hops = HopListener.serve(port, lambda t, x: written_at_arrival.append(
            writer.is_written(1)), lambda: 1 << 20)
        transport = GrpcTransport("fence", [f"127.0.0.1:{port}"], None, Inbox(10))
        transport.writer, transport.fence_sends = writer, True
        try:
            writer.put(0, 0, 0, {0: {"a": torch.randn(12 << 20)}})
            assert not writer.is_written(1)  # still being written
            transport.send(Kind.RECV_L, 0, 0, 0, 0, 0, {"loss": torch.ones(())})
            transport.flush()  # waits for the hop's writer thread to send it
            wait_for(lambda: written_at_arrival)
            assert written_at_arrival == [True]
            transport.send(Kind.RECV_L, 0, 1, 0, 0, 0, {"loss": torch.ones(())})  # no wait
            wait_for(lambda: len(written_at_arrival) == 2)
        finally:
            transport.close()
            writer.close()
            hops.close()
