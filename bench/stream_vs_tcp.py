"""MB/s of one float32 activation through pipefb's gRPC tensor stream vs a raw loopback socket.

The receiver is a separate process holding both servers: a `StageWorker` servicer whose
`Activations` is the real decode path (`protos.wire.decode_stream`, then an Ack), and a TCP
server that reads a length header, allocates the tensor and `recv_into`s its bytes. Both
clocks stop when the receiver has materialised the tensor and acknowledged it. Also times
each piece of the gRPC path in one process (encode, serialise, parse, decode) to show where
time goes. Then a weight push: every parameter of the bench's `mlp` and `gpt` (what a
1F+1B PipeFB backward worker pushes each step) on the same stream, packed as
`wire.encode_stream` sends it ([Note: packed messages]) against one tensor per message
(unpacked, which the decoder also accepts). Run: `python bench/stream_vs_tcp.py [--quick]
[--out DIR]`. Target gRPC/TCP >= 0.5.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import torch

from bench import machine
from bench.output import args_json, write_results
from bench.stats import fmt, ratio, summary
from dataplane.grpc_transport import PeerStream
from protos import server, tensor_pb2, wire, worker_pb2_grpc

TARGET = 0.5  # gRPC stream MB/s / raw TCP MB/s
_LEN = struct.Struct("<q")  # TCP frame: payload byte count, then the bytes; ack: bytes received
MiB = 1 << 20


class ActivationsOnly(worker_pb2_grpc.StageWorkerServicer):
    """A StageWorker that only receives activations, through the workers' decode path
    (`wire.decode_transfers`: one stream may carry many transfers); it reports each
    materialised transfer's byte count on `done`."""

    def __init__(self, done: Any) -> None:
        self.done = done

    def Activations(self, request_iterator: Iterator[tensor_pb2.TensorChunk],
                    context: grpc.ServicerContext) -> tensor_pb2.Ack:
        total = 0
        for _, tensors in wire.decode_transfers(request_iterator):
            nbytes = sum(t.nbytes for t in tensors.values())
            self.done.put(nbytes)
            total += nbytes
        return tensor_pb2.Ack(bytes=total)


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    while view:
        n = conn.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed mid-frame")
        view = view[n:]


def _tcp_serve(listener: socket.socket) -> None:
    """Per frame: read the length, allocate a float32 tensor, fill it, ack its byte count."""
    conn, _ = listener.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = bytearray(_LEN.size)
        while True:
            try:
                _recv_exact(conn, memoryview(header))
            except ConnectionError:
                return
            (nbytes,) = _LEN.unpack(header)
            tensor = torch.empty(nbytes // 4, dtype=torch.float32)
            _recv_exact(conn, memoryview(tensor.view(torch.uint8).numpy()))
            conn.sendall(_LEN.pack(tensor.nbytes))


def _receiver(ports: Any, done: Any, stop: Any) -> None:
    """The receiving process: both servers, until `stop` is set."""
    torch.set_num_threads(1)
    srv, port, health = server.create_server(
        lambda s: worker_pb2_grpc.add_StageWorkerServicer_to_server(ActivationsOnly(done), s))
    server.ready(health)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_tcp_serve, args=(listener,), daemon=True).start()
    ports.put((port, listener.getsockname()[1]))
    stop.wait()
    srv.stop(0)


def _check(done: Any, nbytes: int) -> None:
    got = done.get(timeout=60)
    if got != nbytes:
        raise RuntimeError(f"gRPC receiver got {got} of {nbytes} bytes")


def grpc_call_sender(port: int, done: Any) -> tuple[Callable[[torch.Tensor], None],
                                                      Callable[[], None]]:
    """(send one tensor in a new Activations call and wait until it is materialised, close)."""
    chan = server.channel(f"127.0.0.1:{port}")
    stub = worker_pb2_grpc.StageWorkerStub(chan)

    def send(t: torch.Tensor) -> None:
        transfer = tensor_pb2.Transfer(job_id="bench", kind="RECV_F", tensor_count=1)
        stub.Activations(wire.encode_stream(transfer, {"x": t}), timeout=60)
        _check(done, t.nbytes)

    return send, chan.close


def grpc_stream_sender(port: int, done: Any) -> tuple[Callable[[torch.Tensor], None],
                                                        Callable[[], None]]:
    """(send one tensor on the workers' long-lived PeerStream, wait until materialised, close)."""
    chan = server.channel(f"127.0.0.1:{port}")
    stream = PeerStream(worker_pb2_grpc.StageWorkerStub(chan).Activations, "bench receiver")

    def send(t: torch.Tensor) -> None:
        transfer = tensor_pb2.Transfer(job_id="bench", kind="RECV_F", tensor_count=1)
        stream.put(wire.encode_stream(transfer, {"x": t}))
        _check(done, t.nbytes)

    def close() -> None:
        stream.close()
        stream.future.result(timeout=60)
        chan.close()

    return send, close


def unpacked_stream(transfer: tensor_pb2.Transfer, tensors: dict[str, torch.Tensor]
                    ) -> Iterator[tensor_pb2.TensorChunk]:
    """The unpacked layout: every tensor starts a message of its own (a valid stream)."""
    transfer.tensor_count = len(tensors)
    for k, (name, tensor) in enumerate(tensors.items()):
        one = list(wire.encode_stream(tensor_pb2.Transfer(), {name: tensor}))
        if k:
            one[0].ClearField("transfer")
        else:
            one[0].transfer.CopyFrom(transfer)
        yield from one


def weights(model: str) -> dict[str, torch.Tensor]:
    """Every parameter of the bench's `model`, named as a weight push names them."""
    from bench.pipeline_throughput import MODELS
    from pipefb.models import build_model

    layers = build_model(model, MODELS[model]["model_config"])
    return {f"{i}.{name}": p.detach() for i, layer in enumerate(layers)
            for name, p in layer.named_parameters()}


def push_sender(stream: PeerStream, done: Any, packed: bool
                ) -> Callable[[dict[str, torch.Tensor]], None]:
    """Sends one weight push on `stream` and waits until the receiver materialised it."""
    encode = wire.encode_stream if packed else unpacked_stream

    def send(tensors: dict[str, torch.Tensor]) -> None:
        transfer = tensor_pb2.Transfer(job_id="bench", kind="RECV_F")
        stream.put(encode(transfer, tensors))
        _check(done, sum(t.nbytes for t in tensors.values()))

    return send


def push(port: int, done: Any, repeats: int) -> dict[str, Any]:
    """Seconds of each model's weight push, packed and one tensor per message, interleaved
    on one stream after a warm-up of each."""
    chan = server.channel(f"127.0.0.1:{port}")
    stream = PeerStream(worker_pb2_grpc.StageWorkerStub(chan).Activations, "bench receiver")
    out: dict[str, Any] = {}
    try:
        for model in ("mlp", "gpt"):
            tensors = weights(model)
            senders = {k: push_sender(stream, done, k == "packed")
                       for k in ("packed", "one_tensor_per_message")}
            times: dict[str, list[float]] = {k: [] for k in senders}
            for i in range(repeats + 1):
                for name, send in senders.items():
                    seconds = _timed(lambda send=send, w=tensors: send(w))
                    if i:
                        times[name].append(seconds)
            speedup = [u / p for p, u in zip(times["packed"], times["one_tensor_per_message"],
                                              strict=True)]
            out[model] = {"tensors": len(tensors),
                          "bytes": sum(t.nbytes for t in tensors.values()),
                          "messages": {k: len(list(e(tensor_pb2.Transfer(), tensors)))
                                       for k, e in (("packed", wire.encode_stream),
                                                    ("one_tensor_per_message",
                                                     unpacked_stream))},
                          "seconds": {k: summary(v) for k, v in times.items()},
                          "speedup": summary(speedup)}
    finally:
        stream.close()
        stream.future.result(timeout=60)
        chan.close()
    return out


def tcp_sender(port: int) -> tuple[Callable[[torch.Tensor], None], Callable[[], None]]:
    """(send one tensor's bytes and wait for the ack, close)."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = bytearray(_LEN.size)

    def send(t: torch.Tensor) -> None:
        conn.sendall(_LEN.pack(t.nbytes))
        conn.sendall(memoryview(t.contiguous().view(torch.uint8).numpy()))
        _recv_exact(conn, memoryview(ack))
        if _LEN.unpack(ack)[0] != t.nbytes:
            raise RuntimeError("TCP receiver got the wrong byte count")

    return send, conn.close


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def breakdown(t: torch.Tensor, repeats: int) -> dict[str, dict[str, float]]:
    """Seconds of each piece of the gRPC path, in this process, without the network."""
    transfer = tensor_pb2.Transfer(job_id="bench", kind="RECV_F", tensor_count=1)
    msgs = list(wire.encode_stream(transfer, {"x": t}))
    wire_bytes = [m.SerializeToString() for m in msgs]
    pieces: dict[str, Callable[[], Any]] = {
        "memcpy (t.clone)": t.clone,
        "encode_stream (one copy per chunk)":
            lambda: list(wire.encode_stream(transfer, {"x": t})),
        "SerializeToString": lambda: [m.SerializeToString() for m in msgs],
        "TensorChunk.FromString": lambda: [tensor_pb2.TensorChunk.FromString(b)
                                           for b in wire_bytes],
        "decode_stream": lambda: wire.decode_stream(iter(msgs)),
    }
    return {name: summary([_timed(fn) for _ in range(repeats)]) for name, fn in pieces.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Times both paths `args.repeats` times, interleaved, after one warm-up each."""
    torch.set_num_threads(1)
    t = torch.randn(args.mib * MiB // 4)  # (N,) float32
    ctx = mp.get_context("spawn")
    ports, done, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_receiver, args=(ports, done, stop), daemon=True)
    proc.start()
    try:
        grpc_port, tcp_port = ports.get(timeout=120)
        senders = {"grpc": grpc_stream_sender(grpc_port, done),
                   "tcp": tcp_sender(tcp_port),
                   "grpc_call_per_transfer": grpc_call_sender(grpc_port, done)}
        times: dict[str, list[float]] = {k: [] for k in senders}
        for i in range(args.repeats + 1):
            for name, (send, _) in senders.items():
                seconds = _timed(lambda send=send: send(t))
                if i:  # the first transfer of each path warms it up
                    times[name].append(seconds)
        for _, close in senders.values():
            close()
        pushes = push(grpc_port, done, args.repeats)
    finally:
        stop.set()
        proc.join(10)
    mbps = {k: [t.nbytes / 1e6 / s for s in v] for k, v in times.items()}
    per_repeat = [g / c for g, c in zip(mbps["grpc"], mbps["tcp"], strict=True)]
    per_call = [g / c for g, c in zip(mbps["grpc_call_per_transfer"], mbps["tcp"], strict=True)]
    return {"bench": "stream_vs_tcp", "machine": machine.describe(), "args": args_json(args),
            "command": " ".join(["python", "bench/stream_vs_tcp.py", *sys.argv[1:]]),
            "tensor_bytes": t.nbytes, "target": TARGET,
            "mb_per_second": {k: summary(v) for k, v in mbps.items()},
            "seconds": {k: summary(v) for k, v in times.items()},
            "ratio_grpc_over_tcp": summary(per_repeat),
            "ratio_grpc_call_per_transfer_over_tcp": summary(per_call),
            "pooled_ratio_range": ratio(mbps["grpc"], mbps["tcp"]),
            "breakdown_seconds": breakdown(t, args.repeats), "weight_push": pushes}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the bench's flags; `--quick` sends 1 MiB 3 times."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="1 MiB, 3 repeats (CI)")
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    p.add_argument("--mib", type=int, default=16, help="tensor size in MiB (float32)")
    p.add_argument("--repeats", type=int, default=15, help="timed transfers per path (>= 10)")
    args = p.parse_args(argv)
    if args.quick:
        args.mib, args.repeats = 1, 3
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench, prints it, writes `results.json` to `--out`."""
    args = parse_args(argv)
    res = run(args)
    for k, v in res["mb_per_second"].items():
        print(f"{k:20s} {fmt(v)} MB/s  ({fmt(res['seconds'][k], 1e3)} ms per transfer)")
    r = res["ratio_grpc_over_tcp"]
    print(f"gRPC/TCP {fmt(r, digits=2)}  target >= {TARGET}: "
          f"{'meets' if r['median'] >= TARGET else 'MISSES'}")
    r = res["ratio_grpc_call_per_transfer_over_tcp"]
    print(f"gRPC (a new call per transfer)/TCP {fmt(r, digits=2)}")
    for name, s in res["breakdown_seconds"].items():
        print(f"  {name:48s} {fmt(s, 1e3, 2)} ms")
    for model, w in res["weight_push"].items():
        sec, msgs = w["seconds"], w["messages"]
        print(f"weight push, {model} ({w['tensors']} tensors, {w['bytes'] / 1e6:.1f} MB): "
              f"packed {fmt(sec['packed'], 1e3)} ms in {msgs['packed']} messages, one tensor "
              f"per message {fmt(sec['one_tensor_per_message'], 1e3)} ms in "
              f"{msgs['one_tensor_per_message']}; speedup {fmt(w['speedup'], digits=2)}")
    write_results(args.out, res)
    return res


if __name__ == "__main__":
    main()
