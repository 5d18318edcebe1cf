"""Builds the cluster `pipefb local` runs on: this machine measured once by every probe
(or read from the cache), described as loopback workers on one host.

`measure` starts the probe Redis and the echo peer and runs each probe with the parts a
local run uses: the worker-to-worker link (the hop socket) and busy
senders (`calibration.links`), the offload-store link and the node-local tier's, a
private rank's and two ranks' sharing it (`calibration.store`), the runtime's and the
Step call's overheads (`calibration.overheads`) and the cores' speed when oversubscribed
(`calibration.crowding`). `local_cluster` reads the result from the cache
(`calibration.cache`) where it is current and measures again where not.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from calibration import cache, crowding, links, overheads, store
from calibration.cpu import child_pids
from calibration.settings import DEFAULTS, HOST, PROBE_TIMEOUT_S, Measured, Settings
from dataplane.grpc_transport import SWITCH_INTERVAL_SECONDS
from dataplane.inbox import Inbox
from pipefb.errors import ConfigError
from pipefb.processes import Process, project_env
from pipefb.sim.cluster import Cluster, WorkerSpec


@contextlib.contextmanager
def _switch_interval(seconds: float) -> Iterator[None]:
    """Runs the body with the workers' GIL switch interval, then restores it."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


@contextlib.contextmanager
def _helpers(inbox: Inbox) -> Iterator[tuple[Process, Process]]:
    """Starts the probe Redis and the echo peer (in parallel) and this side's Receiver;
    stops all three on exit.

    The children are forked before this process serves gRPC (gRPC warns about a fork
    while its threads run), so the Receiver's port is picked first and bound after.
    """
    env = project_env()
    address = f"127.0.0.1:{links.free_port()}"
    with tempfile.TemporaryDirectory(prefix="pipefb-calibrate-") as logs, \
            contextlib.ExitStack() as stack:
        children = [Process("redis", ["-m", "offload_store", "--port", "0", "--maxmemory",
                                      store.STORE_MAXMEMORY], Path(logs), env),
                    Process("peer", ["-m", "calibration", "--echo-to", address],
                            Path(logs), env)]
        stack.callback(_stop_all, children)
        srv = links.serve(inbox, address)[0]
        stack.callback(srv.stop, 0)
        stack.callback(links.serve_hops(inbox, address).close)
        for child in children:
            child.wait_ready()
        yield children[0], children[1]


def _stop_all(children: list[Process]) -> None:
    """Signals every child first, then waits for each (they exit in parallel)."""
    for child in children:
        if child.popen.poll() is None:
            child.popen.terminate()
    for child in children:
        child.stop()


def measure(settings: Settings = DEFAULTS) -> Measured:
    """Measures the links and overheads of this machine (a few seconds).

    Raises:
        CalibrationError: a probe failed or gave impossible numbers.
        RuntimeError: the Redis or the peer process did not start.
    """
    inbox = Inbox(timeout_seconds=PROBE_TIMEOUT_S)
    with _switch_interval(SWITCH_INTERVAL_SECONDS), _helpers(inbox) as (redis_proc, peer):
        network, busy_send = links.network(peer, inbox, settings)
        rpc = overheads.rpc_round_trip(peer.address, settings.rpc_repeats)
        step_cpu = overheads.step_cpu(peer.address, settings.step_calls,
                                      [os.getpid(), peer.pid])
        store_link = store.store_link(redis_proc.address, settings,
                                      child_pids(redis_proc.pid))
        tier = store.tier_link(redis_proc.address, settings)
        shared_tier = store.shared_tier_link(redis_proc.address, settings,
                                             child_pids(redis_proc.pid))
        action, step = overheads.runtime_overheads(settings.steps)
    oversubscribed = crowding.oversubscribed(os.cpu_count() or 1, settings.crowd_seconds)
    return Measured(network, store_link, action, rpc + step, step_cpu, oversubscribed,
                    busy_send, tier, shared_tier)


def build_cluster(workers: int, measured: Measured, tier_cap: int | None = None) -> Cluster:
    """`workers` workers w0..w{n-1} on one loopback host with this machine's cores and
    links: transfers and store traffic are CPU work there, as on this machine; they share
    a node-local tier (`pipefb local` and the tests' clusters give them one) with the cap
    their environment gives them (`tier_cap`; None: `calibration.store.tier_cap` now; not
    measured, so read afresh for each cluster, never from the cache).

    Raises:
        ConfigError: `workers` < 1, or a bad `PIPEFB_LOCAL_TIER_BYTES`.
    """
    if workers < 1:
        raise ConfigError(f"a cluster needs at least one worker, got {workers}")
    if measured.local_tier is None:
        cap: float = math.inf
    else:
        cap = store.tier_cap() if tier_cap is None else tier_cap
    return Cluster(tuple(WorkerSpec(f"w{i}", host=HOST) for i in range(workers)),
                   network=measured.network, store=measured.store,
                   host_cores={HOST: os.cpu_count() or 1}, loopback_hosts=frozenset({HOST}),
                   action_overhead=measured.action_overhead,
                   step_overhead=measured.step_overhead, step_cpu=measured.step_cpu,
                   host_oversubscribed={HOST: measured.oversubscribed},
                   busy_send=measured.busy_send, local_tier=measured.local_tier,
                   local_tier_bytes=cap, shared_tier=measured.shared_tier)


def calibrated(workers: int, *, cache_dir: Path | None = None, refresh: bool = False,
               settings: Settings = DEFAULTS) -> tuple[Cluster, str]:
    """`local_cluster` with the header of its measurement (for printing)."""
    if workers < 1:
        raise ConfigError(f"a cluster needs at least one worker, got {workers}")
    path = cache.cache_path(cache_dir)
    cap = store.tier_cap()  # the environment's, not the cache's: a bad value is no bad cache
    if not refresh and path.exists():
        try:
            measured, head = cache.read_cache(path)
            if cache.current(head):
                return build_cluster(workers, measured, cap), head
            print(f"cached cluster {path} was measured by older probes; measuring again",
                  file=sys.stderr)
        except ConfigError as error:
            print(f"warning: cached cluster {path} is unusable ({error}); measuring again",
                  file=sys.stderr)
    print(f"measuring loopback gRPC and Redis once; cached in {path}", file=sys.stderr)
    cluster, head = build_cluster(workers, measure(settings), cap), cache.header()
    # the cap is the environment's at each read, so the cache keeps none
    cache.write_cache(path, cache.render(replace(cluster, local_tier_bytes=math.inf), head))
    return cluster, head


def local_cluster(workers: int, *, cache_dir: Path | None = None, refresh: bool = False,
                  settings: Settings = DEFAULTS) -> Cluster:
    """The cluster `pipefb local` runs on: measured once per host, then read from the cache.

    Args:
        workers: worker count; workers w0..w{n-1} share host "local" (`os.cpu_count()`
            cores), speed 1.0, no memory cap.
        cache_dir: where the cache file lives (default `$PIPEFB_CACHE_DIR`, else
            `~/.cache/pipefb/`).
        refresh: measure again even if the cache is good.
        settings: probe sizes and repeat counts of a measurement.

    Returns:
        The cluster with the measured network, store and overheads.

    Raises:
        CalibrationError: a measurement failed (a corrupt cache is re-measured instead).
        ConfigError: `workers` < 1.
    """
    return calibrated(workers, cache_dir=cache_dir, refresh=refresh, settings=settings)[0]
