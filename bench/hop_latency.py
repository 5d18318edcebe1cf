"""One-way latency of a small tensor between two worker processes on this host: pipefb's
same-host hop socket, its gRPC stream and a raw TCP socket, interleaved in one run.

An echo process holds what a worker holds to receive: a StageWorker gRPC server whose
`Activations` decodes into an inbox (`calibration.links.Receiver`) and a hop socket
(`calibration.links.serve_hops`) delivering into the same inbox. Each probe is a
`GrpcTransport.send` of one tensor and the `recv` of its echo, on the hop socket
(`local_hops` on) or the gRPC stream (off); the raw TCP echo reads the bytes and writes
them back. One way is half the round trip. Probes go back to back, and after the link sat
idle `--gap` ms ([Note: idle links] in calibration/links.py), all paths taking turns.
Run: `python bench/hop_latency.py [--quick] [--out DIR]`. Target: <= 0.2 ms one way.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import machine
from bench.output import args_json, write_results
from bench.stats import fmt, summary
from bench.store import recv_into
from calibration.links import serve, serve_hops
from dataplane.grpc_transport import SWITCH_INTERVAL_SECONDS, GrpcTransport, inbox_key
from dataplane.inbox import Inbox
from dataplane.localhop import HopListener
from pipefb.errors import Aborted
from pipefb.schedule import Kind

TARGET_MS = 0.2
PATHS = ("hop", "grpc", "tcp")


def _listen(inbox: Inbox, address: str) -> tuple[Any, HopListener]:
    """A gRPC receiver and a hop socket, both delivering into `inbox`."""
    srv, address = serve(inbox, address)
    return srv, serve_hops(inbox, address)


def _echo(ready: Any, parent: Any) -> None:
    """The echo process: sends every probe back on the path it came by, until aborted."""
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)  # as a worker runs
    torch.set_num_threads(1)
    inbox = Inbox(timeout_seconds=60)
    srv, hops = _listen(inbox, "127.0.0.1:0")
    ready.put(f"127.0.0.1:{hops.path.stem.split('-')[1]}")
    back = _transports(parent.get())
    step = 0
    try:
        while True:
            x = inbox_take(inbox, step)
            if x is None:
                break
            back[bool(x["hop"])].send(Kind.RECV_F, 0, step, 0, 0, 0, x)
            step += 1
    finally:
        for t in back.values():
            t.close()
        hops.close()
        srv.stop(0)


def inbox_take(inbox: Inbox, step: int) -> dict[str, torch.Tensor] | None:
    """Probe `step`, or None when the run ended (a probe named "stop")."""
    try:
        x = inbox.take(inbox_key(str(Kind.RECV_F), step, 0, 0))
    except Aborted:
        return None
    return None if "stop" in x else x


def _transports(address: str) -> dict[bool, GrpcTransport]:
    """Transports to `address`: over its hop socket (True) and its gRPC stream (False)."""
    out = {}
    for hop in (True, False):
        out[hop] = GrpcTransport("bench", [address], None, Inbox())
        out[hop].local_hops = hop
    return out


def _tcp_echo(ports: Any, size: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ports.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(size))
    while recv_into(conn, buf):
        conn.sendall(buf)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """`args.repeats` probes of every path, back to back and after `args.gap` ms idle."""
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    ready, parent, ports = ctx.Queue(), ctx.Queue(), ctx.Queue()
    echo = ctx.Process(target=_echo, args=(ready, parent), daemon=True)
    tcp = ctx.Process(target=_tcp_echo, args=(ports, args.bytes), daemon=True)
    echo.start()
    tcp.start()
    inbox = Inbox(timeout_seconds=60)
    srv, hops = _listen(inbox, "127.0.0.1:0")
    parent.put(f"127.0.0.1:{hops.path.stem.split('-')[1]}")
    out = _transports(ready.get(timeout=120))
    conn = socket.create_connection(("127.0.0.1", ports.get(timeout=120)))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    x = torch.ones(max(1, args.bytes // 4))
    raw = memoryview(bytearray(args.bytes))
    step = 0

    def probe(hop: bool) -> Callable[[], None]:
        def go() -> None:
            nonlocal step
            out[hop].send(Kind.RECV_F, 0, step, 0, 0, 0, {"x": x, "hop": torch.tensor(hop)})
            inbox.take(inbox_key(str(Kind.RECV_F), step, 0, 0))
            step += 1
        return go

    def tcp_probe() -> None:
        conn.sendall(raw)
        recv_into(conn, raw)

    probes = {"hop": probe(True), "grpc": probe(False), "tcp": tcp_probe}
    times: dict[str, dict[str, list[float]]] = {g: {p: [] for p in PATHS}
                                                for g in ("back_to_back", "idle")}
    try:
        for i in range(args.warmup + args.repeats):
            for gap_name, gap in (("back_to_back", 0.0), ("idle", args.gap / 1e3)):
                for name in PATHS:
                    if gap:
                        time.sleep(gap)
                    started = time.perf_counter()
                    probes[name]()
                    if i >= args.warmup:
                        times[gap_name][name].append((time.perf_counter() - started) / 2)
    finally:
        out[True].send(Kind.RECV_F, 0, step, 0, 0, 0, {"stop": x, "hop": torch.tensor(True)})
        for t in out.values():
            t.flush()
            t.close()
        conn.close()
        echo.join(30)
        tcp.join(30)
        hops.close()
        srv.stop(0)
    return {"bench": "hop_latency", "machine": machine.describe(), "args": args_json(args),
            "command": " ".join(["python", "bench/hop_latency.py", *sys.argv[1:]]),
            "target_ms": TARGET_MS,
            "one_way_seconds": {g: {p: summary(v) for p, v in paths.items()}
                                for g, paths in times.items()}}


def doc_section(cmd: str, res: dict[str, Any]) -> list[str]:
    """Markdown of the bench for docs/benchmarks.md."""
    a, one_way = res["args"], res["one_way_seconds"]
    lines = ["## Same-host hop latency: hop socket, gRPC stream, raw TCP", "", f"`{cmd}`", "",
             f"A {a['bytes']} B tensor to an echo process and back, {a['repeats']} probes per "
             f"path back to back and as many after the link sat idle {a['gap']:g} ms, all "
             "paths taking turns; one way is half the round trip ([Note: local hops] in "
             "dataplane/localhop.py). ms, median [min-max].", "",
             "| path | back to back | after idle |", "| --- | --- | --- |"]
    lines += [f"| {p} | {fmt(one_way['back_to_back'][p], 1e3, 3)} | "
              f"{fmt(one_way['idle'][p], 1e3, 3)} |" for p in PATHS]
    hop = one_way["idle"]["hop"]["median"] * 1e3
    return [*lines, "", f"Hop socket after idle: **{hop:.3f} ms** (target <= {TARGET_MS})."
            f" `hop` is what ranks on one host use, `grpc` what the others use.", ""]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's flags; `--quick` runs 20 probes."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="20 probes per path (CI)")
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    p.add_argument("--bytes", type=int, default=1024, help="probe tensor bytes")
    p.add_argument("--repeats", type=int, default=500, help="timed probes per path and gap")
    p.add_argument("--warmup", type=int, default=20, help="untimed probes first")
    p.add_argument("--gap", type=float, default=5.0, help="idle ms before an idle probe")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 20, 5
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench, prints it, writes `results.json` to `--out`."""
    args = parse_args(argv)
    res = run(args)
    for gap, paths in res["one_way_seconds"].items():
        for name, s in paths.items():
            print(f"{gap:12s} {name:5s} {fmt(s, 1e3, 3)} ms one way")
    hop = res["one_way_seconds"]["idle"]["hop"]["median"] * 1e3
    print(f"hop after idle {hop:.3f} ms, target <= {TARGET_MS}: "
          f"{'meets' if hop <= TARGET_MS else 'MISSES'}")
    write_results(args.out, res)
    return res


if __name__ == "__main__":
    main()
