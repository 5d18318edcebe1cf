"""`python -m worker`: serve a StageWorker, register with the coordinator, heartbeat."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

import grpc
import torch

from dataplane.grpc_transport import SWITCH_INTERVAL_SECONDS
from dataplane.localhop import HopListener
from offload_store.shm import check_tier
from offload_store.writer import STASH_IN_FLIGHT_BYTES
from pipefb.allocator import keep_freed_memory
from pipefb.cpus import parse_cpu_list, pin
from pipefb.job.dataroots import add_data_root_flag, configure_from_args
from pipefb.runtime.checkpoint import add_root_flag
from protos import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    monitoring,
    security,
    server,
    worker_pb2_grpc,
)
from worker.metrics import WorkerMetrics
from worker.service import StageWorkerServicer

log = logging.getLogger("worker")
# After SIGTERM: the step's abort (at most DRAIN_WAIT_SECONDS) and the server's grace,
# then the process ends even if a thread is stuck on a peer that died
EXIT_WITHIN_SECONDS = 16.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags, each with an environment fallback for containers."""
    p = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    p.add_argument("--listen", default=os.environ.get("PIPEFB_LISTEN", "127.0.0.1:0"),
                   help="host:port to serve on (port 0: any free port)")
    p.add_argument("--advertise", default=os.environ.get("PIPEFB_ADVERTISE", ""),
                   help="host peers use to reach this worker (default: the listen host)")
    p.add_argument("--coordinator", default=os.environ.get("PIPEFB_COORDINATOR", ""),
                   help="host:port of the coordinator to register with")
    p.add_argument("--name", default=os.environ.get("PIPEFB_NAME", f"worker-{os.getpid()}"))
    p.add_argument("--store", default=os.environ.get("PIPEFB_STORE", ""),
                   help="host:port of the offload store; the worker stashes only there, "
                        "as the job's store user its Assign names (default: no store)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("PIPEFB_THREADS", "0")),
                   help="torch intra-op threads (0: torch's default)")
    p.add_argument("--local-stash-bytes", type=int,
                   default=int(os.environ.get("PIPEFB_LOCAL_STASH_BYTES", "-1")),
                   help="stash bytes a combined rank keeps in host memory for its own "
                        "backwards before it uses the offload store (0: always the store; "
                        "-1: 1 GiB on CUDA, 0 on the CPU)")
    p.add_argument("--local-tier-dir", default=os.environ.get("PIPEFB_LOCAL_TIER_DIR", ""),
                   help="directory of the node-local shared-memory tier (a tmpfs the "
                        "workers of this host share, e.g. /dev/shm/pipefb; empty: off)")
    p.add_argument("--local-tier-bytes", type=int,
                   default=int(os.environ.get("PIPEFB_LOCAL_TIER_BYTES", "-1")),
                   help="stash bytes the node-local tier holds at most, all jobs; past it "
                        "stashes go to the offload store (-1: half the tmpfs)")
    p.add_argument("--stash-in-flight-bytes", type=int,
                   default=int(os.environ.get("PIPEFB_STASH_IN_FLIGHT_BYTES",
                                              str(STASH_IN_FLIGHT_BYTES))),
                   help="stash bytes handed to the store's I/O thread and not yet written, "
                        "at most; the compute thread waits past it (0: it writes itself)")
    p.add_argument("--cpus", default=os.environ.get("PIPEFB_CPUS", ""),
                   help="the cores this worker runs on, as taskset -c writes them (0-3,8); "
                        "default: any ([Note: pinned workers] in pipefb/cpus.py)")
    p.add_argument("--local-hops", action=argparse.BooleanOptionalAction,
                   default=os.environ.get("PIPEFB_LOCAL_HOPS", "1") != "0",
                   help="take transfers from peers on this host over a unix socket beside "
                        "gRPC ([Note: local hops] in dataplane/localhop.py; default on)")
    monitoring.add_metrics_flags(p)
    add_root_flag(p)
    add_data_root_flag(p)  # PIPEFB_DATA_ROOT: where datasets may read
    return p.parse_args(argv)


class Registration:
    """Registers with the coordinator and heartbeats to the workers' own port it names
    ([Note: workers' path] in coordinator/workerpath.py); re-registers if forgotten."""

    def __init__(self, coordinator: str, address: str, name: str) -> None:
        self.coordinator = coordinator
        self.stub = coordinator_pb2_grpc.CoordinatorStub(server.channel(coordinator))
        self.beats, self.beats_address = self.stub, coordinator  # where heartbeats go
        self.request = coordinator_pb2.RegisterWorkerRequest(address=address, name=name)
        self.worker_id = -1
        self.interval = 1.0
        self.stopped = threading.Event()

    def register(self, timeout: float = 60.0) -> None:
        """Registers on the coordinator's main port, retrying while it is not up yet;
        heartbeats then go to the port its reply names (this one if none)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self.stub.RegisterWorker(self.request, timeout=5)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.worker_id, self.interval = reply.worker_id, reply.heartbeat_seconds or 1.0
        target = (f"{self.coordinator.rsplit(':', 1)[0]}:{reply.heartbeat_port}"
                  if reply.heartbeat_port else self.coordinator)
        if target != self.beats_address:
            self.beats_address = target
            self.beats = coordinator_pb2_grpc.CoordinatorStub(server.channel(target))

    def heartbeat_forever(self) -> None:
        """Sends a heartbeat every interval until stopped; registers again when the
        coordinator forgot this worker or its heartbeat port went away (a coordinator
        restarted on another one)."""
        while not self.stopped.wait(self.interval):
            try:
                reply = self.beats.Heartbeat(coordinator_pb2.HeartbeatRequest(
                    worker_id=self.worker_id, address=self.request.address), timeout=5)
                if not reply.known:
                    self.register()
            except grpc.RpcError as error:
                log.warning("heartbeat to %s failed: %s", self.beats_address,
                            error.code().name)
                if (error.code() == grpc.StatusCode.UNAVAILABLE
                        and self.beats_address != self.coordinator):
                    self._register_again()

    def _register_again(self) -> None:
        """One registration attempt on the main port (a failure is logged; the next
        heartbeat tries again)."""
        try:
            self.register(timeout=5.0)
        except grpc.RpcError as error:
            log.warning("registering again failed: %s", error.code().name)


def _serve_hops(port: int, servicer: StageWorkerServicer) -> HopListener | None:
    """The hop socket of this worker ([Note: local hops]); None, with a warning, where the
    hop folder cannot be written (peers on this host then send over gRPC)."""
    try:
        return HopListener.serve(port, servicer.deliver_hop, servicer.receive_limit)
    except OSError as error:
        log.warning("no hop socket (%s): peers on this host send over gRPC", error)
        return None


def main(argv: list[str] | None = None) -> None:
    """Runs the worker until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.cpus:  # first: the threads started from here on inherit the cores
        cores = parse_cpu_list(args.cpus)
        pin(cores)
        # torch sized its default thread count by the cores at import, before the pin
        args.threads = args.threads or len(cores)
    configure_from_args(args)  # the only files a job's dataset may read
    check_tier(args.local_tier_dir, args.local_tier_bytes)  # before anything listens
    security.require(security.from_env(), "python -m worker")  # [Note: access]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # gRPC's threads hand received tensors to the compute thread; with Python's default
    # 5 ms GIL switch interval each hand-off can wait that long behind Python-level work.
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    keep_freed_memory()  # a step reuses the last step's freed memory (pipefb.allocator)
    interceptors, url = monitoring.start_from_args(args)
    servicer = StageWorkerServicer(WorkerMetrics(args.name) if url else None,
                                   checkpoint_root=args.checkpoint_root,
                                   local_stash_bytes=args.local_stash_bytes,
                                   stash_in_flight_bytes=args.stash_in_flight_bytes,
                                   local_tier=(args.local_tier_dir, args.local_tier_bytes),
                                   store_address=args.store)
    srv, port, health = server.create_server(
        lambda s: worker_pb2_grpc.add_StageWorkerServicer_to_server(servicer, s), args.listen,
        interceptors=interceptors)
    hops = _serve_hops(port, servicer) if args.local_hops else None
    host = args.advertise or args.listen.rsplit(":", 1)[0]
    address = f"{host}:{port}"
    if args.coordinator:
        reg = Registration(args.coordinator, address, args.name)
        reg.register()
        threading.Thread(target=reg.heartbeat_forever, daemon=True).start()
        log.info("registered as worker %d", reg.worker_id)
    server.ready(health)
    print(f"ready {address}", flush=True)
    monitoring.announce(url)
    try:
        server.serve_until_signal(srv, health, on_stop=servicer.stop,
                                  exit_within=EXIT_WITHIN_SECONDS)
    finally:
        if hops is not None:
            hops.close()


if __name__ == "__main__":
    server.run_service(main, "python -m worker")
