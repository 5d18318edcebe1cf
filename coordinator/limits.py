"""Admission limits of the Coordinator: what any caller, and all callers together, may
hold of its threads, jobs and worker table; refusals are RESOURCE_EXHAUSTED with a retry
hint (`pipefb.errors.Overloaded`).

[Note: reserved threads] The coordinator runs on the asyncio gRPC server ([Note: asyncio
server] in protos/aioserver.py): a following `Train` stream, which lasts as long as its
job, awaits the job's step events on the event loop and holds no thread, so `max_streams`
(and `max_streams_per_caller`) bound followers, not the thread pool. Every other call
runs on the pool for its duration, sized `max_calls + max_submits + RESERVED_THREADS`:
the `Admission` interceptor lets SubmitJob calls take at most `max_submits` threads and
other user calls (ExportWeights, whose chunks are encoded on the pool, among them)
`max_calls`; the workers' path (RegisterWorker, Heartbeat) and the health service (on
the event loop) are never counted, so at least `RESERVED_THREADS` threads are always free
for a worker's first registration, whatever users do. A refused call returns at once.
Heartbeats have a server of their own besides ([Note: workers' path] in
coordinator/workerpath.py): gRPC's cap on the calls the main port serves at once
(`max_rpcs`) counts every kind before any limit here sees them.

[Note: callers] A caller is who the call's token proves it is (`caller_of`): a user (the
admin or a users-file name) is one caller wherever it calls from, so two users on one
machine (or behind one NAT or proxy) do not share a budget and one user calling from many
hosts does not get one per host. The workers' service credential is one secret shared by
all of them, so a worker is that identity on its host ("service@ipv4:10.0.0.7"): each
worker host registers at its own rate. A server that knows no tokens (in-process servers
of tests and benchmarks) tells callers apart by host only.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from pipefb.errors import ConfigError, Overloaded
from pipefb.job.size import SizeLimits
from protos import security
from protos.server import abort, abort_async, wrap_handler

SERVICE = "/pipefb.v1.Coordinator/"
WORKER_PATH = ("RegisterWorker", "Heartbeat")  # on this port from the reserved threads; also on
# the workers' own port ([Note: workers' path] in coordinator/workerpath.py)
STREAMS = ("Train",)  # follower streams: on the event loop, no thread ([Note: reserved threads])
RESERVED_THREADS = 8  # pool threads no user call may take ([Note: reserved threads])
MAX_ADDRESS = 255  # characters of a worker's host:port (a DNS name is at most 253)
MAX_NAME = 128  # characters of a worker's name
STREAM_RETRY_SECONDS = 5.0  # retry hint of a refused stream: followers end with jobs
CALL_RETRY_SECONDS = 1.0  # retry hint of a refused unary call: they end in moments
JOB_RETRY_SECONDS = 10.0  # retry hint of a refused submit: a job must end first
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")  # a DNS name or IPv4


@dataclass(frozen=True)
class Limits:
    """Operator caps of the coordinator (flags, each with an environment fallback)."""

    max_streams: int = 256  # Train streams at once, all callers (they hold no thread)
    max_streams_per_caller: int = 64  # the same, one caller
    max_rpcs: int = 4096  # calls of any kind the main server serves at once (gRPC's own
    # cap, a bound on memory; heartbeats have a server of their own: coordinator/workerpath.py)
    max_calls: int = 8  # other user calls at once, all callers
    max_submits: int = 2  # SubmitJob calls at once (each builds the model to check it)
    max_jobs: int = 64  # unfinished jobs, all callers
    max_jobs_per_caller: int = 16  # unfinished jobs one caller submitted
    registrations_per_second: float = 20.0  # RegisterWorker calls of one caller (a burst
    # of `registration_burst` first)
    registration_burst: int = 64
    max_workers: int = 1024  # workers the registry holds
    worker_expiry_seconds: float = 60.0  # an idle worker silent this long is forgotten
    size: SizeLimits = field(default_factory=SizeLimits)  # what one job may ask for

    @property
    def threads(self) -> int:
        """The server's thread pool ([Note: reserved threads])."""
        return self.max_calls + self.max_submits + RESERVED_THREADS


# flag name -> (Limits field, environment variable, type, help)
_FLAGS: tuple[tuple[str, str, str, type, str], ...] = (
    ("--max-streams", "max_streams", "PIPEFB_MAX_STREAMS", int,
     "Train streams (followers) served at once"),
    ("--max-streams-per-caller", "max_streams_per_caller", "PIPEFB_MAX_STREAMS_PER_CALLER",
     int, "the same, for one caller (a user, wherever it calls from)"),
    ("--max-rpcs", "max_rpcs", "PIPEFB_MAX_RPCS", int,
     "calls of any kind served at once on the main port (gRPC refuses the rest)"),
    ("--max-calls", "max_calls", "PIPEFB_MAX_CALLS", int,
     "other user calls served at once"),
    ("--max-submits", "max_submits", "PIPEFB_MAX_SUBMITS", int, "SubmitJob calls at once"),
    ("--max-jobs", "max_jobs", "PIPEFB_MAX_JOBS", int, "unfinished jobs"),
    ("--max-jobs-per-caller", "max_jobs_per_caller", "PIPEFB_MAX_JOBS_PER_CALLER", int,
     "unfinished jobs of one caller (a user)"),
    ("--registrations-per-second", "registrations_per_second",
     "PIPEFB_REGISTRATIONS_PER_SECOND", float,
     "RegisterWorker calls per second of one worker host"),
    ("--max-workers", "max_workers", "PIPEFB_MAX_WORKERS", int, "workers registered"),
    ("--worker-expiry", "worker_expiry_seconds", "PIPEFB_WORKER_EXPIRY", float,
     "seconds of silence after which an idle worker is forgotten"),
)
_SIZE_FLAGS: tuple[tuple[str, str, str, type, str], ...] = (
    ("--max-layers", "max_layers", "PIPEFB_MAX_LAYERS", int,
     "layers a job's model may have (loss included)"),
    ("--max-parameters", "max_parameters", "PIPEFB_MAX_PARAMETERS", int,
     "parameters a job's model may have"),
    ("--max-activation-bytes", "max_activation_bytes", "PIPEFB_MAX_ACTIVATION_BYTES", int,
     "bytes of activations a job's step may make (every layer's input, every micro-batch)"),
)


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per limit, each defaulting to its environment variable, else to the
    `Limits` (and `SizeLimits`) default."""
    defaults = {**vars(Limits()), **vars(SizeLimits())}
    for flag, name, env, kind, text in (*_FLAGS, *_SIZE_FLAGS):
        parser.add_argument(flag, dest=name, type=kind, metavar="N",
                            default=kind(os.environ.get(env, defaults[name])),
                            help=f"{text} (env {env}; default {defaults[name]})")


def from_args(args: argparse.Namespace) -> Limits:
    """The limits the flags of `add_limit_flags` give.

    Raises:
        ConfigError: a limit that is not positive, naming its flag.
    """
    for flag, name, _, _, _ in (*_FLAGS, *_SIZE_FLAGS):
        if getattr(args, name) <= 0:
            raise ConfigError(f"{flag} must be positive, got {getattr(args, name)}")
    size = SizeLimits(**{name: getattr(args, name) for _, name, _, _, _ in _SIZE_FLAGS})
    return Limits(**{name: getattr(args, name) for _, name, _, _, _ in _FLAGS}, size=size)


def check_worker(address: str, name: str) -> None:
    """Refuses a worker address that is not `host:port` (a DNS name, IPv4 or bracketed
    IPv6 host; port 1..65535; at most MAX_ADDRESS characters) or a name over MAX_NAME.

    Raises:
        ConfigError: naming the bad value (cut to 80 characters).
    """
    shown = repr(address[:80]) + ("..." if len(address) > 80 else "")
    if len(name) > MAX_NAME:
        raise ConfigError(f"worker name has {len(name)} characters; at most {MAX_NAME}")
    if len(address) > MAX_ADDRESS:
        raise ConfigError(f"worker address {shown} has {len(address)} characters; at most "
                          f"{MAX_ADDRESS}")
    host, _, port = address.rpartition(":")
    if not (port.isdigit() and port.isascii() and 1 <= int(port) <= 65535):
        raise ConfigError(f"worker address {shown} must be host:port with a port in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
            return
        except ValueError:
            pass
    elif _HOST.fullmatch(host) and host.isascii():
        return
    raise ConfigError(f"worker address {shown} must be host:port with a DNS name, an IPv4 "
                      "address or a bracketed IPv6 address")


def caller_of(context: grpc.ServicerContext) -> str:
    """The caller of a call ([Note: callers]): a user's name ("alice", "admin") wherever it
    calls from; the service credential at its host as gRPC names the peer
    ("ipv4:10.0.0.7:5000" -> "service@ipv4:10.0.0.7"); the host alone for a call with no
    known token (a server that checks none)."""
    peer: str = context.peer() or ""
    host = peer.rpartition(":")[0] or peer
    who = security.identify(security.from_env(), context.invocation_metadata())
    if who is None:
        return host
    return f"{who}@{host}" if who in (security.SERVICE, security.COORDINATOR) else who


class _Bucket:
    """A token bucket: `rate` tokens a second, at most `burst` saved."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self) -> float:
        """Takes a token; returns 0, or the seconds (> 0) until one is there (none taken)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class Admission(grpc.ServerInterceptor):
    """Counts and caps the Coordinator's calls by kind and caller (see the module
    docstring); `unfinished` gives the ids of the jobs not yet ended."""

    def __init__(self, limits: Limits, unfinished: Callable[[], set[str]]) -> None:
        self.limits, self.unfinished = limits, unfinished
        self._lock = threading.Lock()
        self._streams: dict[str, int] = {}  # caller -> open streams
        self._calls = 0  # unary user calls running
        self._submits: dict[str, int] = {}  # caller -> SubmitJob calls running
        self._owners: dict[str, str] = {}  # job id -> the caller that submitted it
        self._buckets: dict[str, _Bucket] = {}  # caller -> its registrations

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        method: str = details.method
        if not method.startswith(SERVICE):
            return continuation(details)  # the health service: never limited
        name = method[len(SERVICE):]
        if name == "Heartbeat":
            return continuation(details)
        if name == "RegisterWorker":
            return wrap_handler(continuation(details), self._registration, self._registration)
        if name in STREAMS:
            return wrap_handler(continuation(details), self._call, self._call_stream,
                                self._stream)
        if name == "SubmitJob":
            return wrap_handler(continuation(details), self._submit, self._call_stream)
        return wrap_handler(continuation(details), self._call, self._call_stream)

    def _registration(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def handler(request: Any, context: grpc.ServicerContext) -> Any:
            caller = caller_of(context)
            with self._lock:
                if len(self._buckets) > 4 * self.limits.max_workers:  # bounded: keep busy ones
                    self._buckets = {c: b for c, b in self._buckets.items()
                                     if b.tokens < b.burst - 1}
                bucket = self._buckets.setdefault(caller, _Bucket(
                    self.limits.registrations_per_second, self.limits.registration_burst))
                wait = bucket.take()
            if wait:
                abort(context, Overloaded(
                    f"{caller} registers workers faster than "
                    f"{self.limits.registrations_per_second:g} a second",
                    math.ceil(wait * 1000) / 1000))
            return fn(request, context)

        return handler

    def _take_call(self) -> Overloaded | None:
        """Counts a user call in; its refusal if `max_calls` run already."""
        with self._lock:
            if self._calls >= self.limits.max_calls:
                return Overloaded(f"the coordinator serves {self.limits.max_calls} calls at "
                                  "once", CALL_RETRY_SECONDS)
            self._calls += 1
            return None

    def _give_call(self) -> None:
        with self._lock:
            self._calls -= 1

    def _call(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def handler(request: Any, context: grpc.ServicerContext) -> Any:
            refusal = self._take_call()
            if refusal is not None:
                abort(context, refusal)
            try:
                return fn(request, context)
            finally:
                self._give_call()

        return handler

    def _call_stream(self, fn: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        """A short server stream (ExportWeights) counts as a call while it lasts."""
        def handler(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            refusal = self._take_call()
            if refusal is not None:
                abort(context, refusal)
            try:
                yield from fn(request, context)
            finally:
                self._give_call()

        return handler

    def _stream(self, fn: Callable[..., AsyncIterator[Any]]
                ) -> Callable[..., AsyncIterator[Any]]:
        """A follower (an async generator on the event loop): counted against its
        caller's and the global stream limits while it lasts."""
        async def handler(request: Any, context: Any) -> AsyncIterator[Any]:
            caller = caller_of(context)
            with self._lock:
                mine, total = self._streams.get(caller, 0), sum(self._streams.values())
                refusal = (f"{caller} follows {mine} streams, its limit"
                           if mine >= self.limits.max_streams_per_caller else
                           f"the coordinator serves {total} streams, its limit"
                           if total >= self.limits.max_streams else "")
                if not refusal:
                    self._streams[caller] = mine + 1
            if refusal:
                await abort_async(context, Overloaded(refusal, STREAM_RETRY_SECONDS))
            try:
                async for reply in fn(request, context):
                    yield reply
            finally:
                with self._lock:
                    self._streams[caller] -= 1
                    if not self._streams[caller]:
                        del self._streams[caller]

        return handler

    def _submit(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def handler(request: Any, context: grpc.ServicerContext) -> Any:
            caller = caller_of(context)
            with self._lock:
                refusal = self._submit_refusal(caller)
                if not refusal:
                    self._submits[caller] = self._submits.get(caller, 0) + 1
            if refusal:
                abort(context, Overloaded(*refusal))
            try:
                reply = fn(request, context)
                with self._lock:
                    self._owners[reply.job_id] = caller
                return reply
            finally:
                with self._lock:
                    self._submits[caller] -= 1
                    if not self._submits[caller]:
                        del self._submits[caller]

        return handler

    def _submit_refusal(self, caller: str) -> tuple[str, float] | None:
        """Why a submit of `caller` is refused now, with its retry hint (the caller
        holds the lock; submits running count as jobs)."""
        running = sum(self._submits.values())
        if running >= self.limits.max_submits:
            return (f"the coordinator checks {running} submitted jobs at once, its limit",
                    CALL_RETRY_SECONDS)
        unfinished = self.unfinished()
        self._owners = {j: c for j, c in self._owners.items() if j in unfinished}
        if len(unfinished) + running >= self.limits.max_jobs:
            return (f"the coordinator has {len(unfinished)} unfinished jobs, its limit",
                    JOB_RETRY_SECONDS)
        mine = sum(c == caller for c in self._owners.values()) + self._submits.get(caller, 0)
        if mine >= self.limits.max_jobs_per_caller:
            return f"{caller} has {mine} unfinished jobs, its limit", JOB_RETRY_SECONDS
        return None
