"""`python -m coordinator`: serve the Coordinator until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from coordinator.driver import Driver
from coordinator.journal import Journal
from coordinator.limits import Admission, add_limit_flags, from_args
from coordinator.metrics import CoordinatorMetrics
from coordinator.registry import Registry
from coordinator.service import CoordinatorServicer
from coordinator.workerpath import serve_worker_path
from pipefb.job.dataroots import add_data_root_flag, configure_from_args
from pipefb.runtime.checkpoint import add_root_flag
from pipefb.sim.cluster import Cluster
from protos import coordinator_pb2_grpc, monitoring, security, server
from protos.aioserver import create_aio_server

DRAIN_SECONDS = 20.0  # on SIGTERM: for running steps to end and a checkpoint to be written


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags, each with an environment fallback for containers."""
    p = argparse.ArgumentParser(prog="python -m coordinator", description=__doc__)
    p.add_argument("--listen", default=os.environ.get("PIPEFB_LISTEN", "127.0.0.1:0"),
                   help="host:port to serve on (port 0: any free port)")
    p.add_argument("--worker-listen", default=os.environ.get("PIPEFB_WORKER_LISTEN", ""),
                   help="host:port of the workers' own server (heartbeats, registrations; "
                        "default: the listen host, any free port)")
    p.add_argument("--store", default=os.environ.get("PIPEFB_STORE", ""), required=False,
                   help="host:port of the offload store (Redis)")
    p.add_argument("--cluster", type=Path, default=None,
                   help="cluster YAML that plan 'auto' assumes (links, store, caps); "
                        "default: uniform workers")
    p.add_argument("--advertise", default=os.environ.get("PIPEFB_ADVERTISE", ""),
                   help="host workers use to reach this coordinator's all-reduce rendezvous "
                        "(default: the listen host)")
    p.add_argument("--rendezvous-port", type=int,
                   default=int(os.environ.get("PIPEFB_RENDEZVOUS_PORT", "0")),
                   help="port of the all-reduce rendezvous of multi-group jobs (0: any free)")
    add_root_flag(p)
    add_data_root_flag(p)  # PIPEFB_DATA_ROOT: where datasets may read
    p.add_argument("--journal", type=Path,
                   default=Path(os.environ["PIPEFB_JOURNAL"]) if os.environ.get(
                       "PIPEFB_JOURNAL") else None,
                   help="folder where unfinished jobs are journaled; a coordinator started "
                        "on it resumes them (default: none, jobs die with the coordinator)")
    p.add_argument("--heartbeat-timeout", type=float,
                   default=float(os.environ.get("PIPEFB_HEARTBEAT_TIMEOUT", "5")),
                   help="seconds without a heartbeat before a worker counts as dead "
                        "(the coordinator's own stalls not counted)")
    add_limit_flags(p)
    monitoring.add_metrics_flags(p)
    args = p.parse_args(argv)
    if not args.store:
        p.error("--store (or PIPEFB_STORE) is required")
    return args


def main(argv: list[str] | None = None) -> None:
    """Runs the coordinator."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s coordinator %(levelname)s %(message)s")
    args = parse_args(argv)
    configure_from_args(args)  # the only files a job's dataset may read (submit checks)
    security.require(security.from_env(), "python -m coordinator", admin=True)
    limits = from_args(args)
    registry = Registry(timeout_seconds=args.heartbeat_timeout,
                        expire_seconds=limits.worker_expiry_seconds,
                        max_workers=limits.max_workers)
    cluster = Cluster.load(args.cluster) if args.cluster else None
    interceptors, url = monitoring.start_from_args(args)
    observer = CoordinatorMetrics(registry, args.store) if url else None
    host = args.listen.rsplit(":", 1)[0]
    journal = Journal(args.journal)
    driver = Driver(registry, args.store, cluster=cluster, metrics=observer,
                    checkpoint_root=args.checkpoint_root,
                    rendezvous_host=host, rendezvous_advertise=args.advertise,
                    rendezvous_port=args.rendezvous_port, journal=journal)
    servicer = CoordinatorServicer(registry, driver, limits.size)
    # the journaled jobs are known before anything is served: a client's first call after a
    # restart finds them; their threads wait for the workers to register
    servicer.resume(journal.pending())
    admission = Admission(limits, servicer.unfinished)  # [Note: reserved threads]
    # first, so that every RegisterWorkerReply names its port
    workers, _ = serve_worker_path(  # [Note: workers' path]: heartbeats on a port of their own
        servicer, args.worker_listen or f"{host}:0", admission)
    srv, port, health = create_aio_server(  # [Note: asyncio server]: followers hold no thread
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s), args.listen,
        interceptors=(*interceptors, admission), max_workers=limits.threads,
        max_concurrent_rpcs=limits.max_rpcs)
    server.ready(health)
    print(f"ready {args.listen.rsplit(':', 1)[0]}:{port}", flush=True)
    monitoring.announce(url)
    server.serve_until_signal(srv, health, on_stop=lambda: driver.drain_all(DRAIN_SECONDS))
    workers.stop(1.0).wait()


if __name__ == "__main__":
    server.run_service(main, "python -m coordinator")
