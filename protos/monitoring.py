"""Prometheus plumbing shared by the services: the gRPC server metrics interceptor, the
`--metrics-port/--metrics-host` flags and the /metrics HTTP server.

Every process serves prometheus_client's default registry in single-process mode; the
interceptor and the services' own metrics take a registry argument so tests can use their
own. Metric names and labels are listed in docs/metrics.md.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server

from protos.server import wrap_handler

# Seconds an RPC took: health checks and Step calls take milliseconds, the long-lived
# tensor streams and Train follow a whole job.
RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
               30.0, 60.0, 300.0, 1800.0)


def split_method(full_method: str) -> tuple[str, str]:
    """`/pipefb.StageWorker/Step` -> (`pipefb.StageWorker`, `Step`)."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service or "unknown", method or "unknown"


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every handled RPC by method and status code and times it.

    It must run outside `protos.server.ErrorInterceptor` (earlier in the interceptor
    tuple), so that a domain error already carries the status code it maps to.
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.handled = Counter(
            "pipefb_grpc_server_handled_total", "RPCs completed on the server, by status code",
            ["grpc_service", "grpc_method", "grpc_code"], registry=registry)
        self.seconds = Histogram(
            "pipefb_grpc_server_handling_seconds",
            "Seconds from the start of an RPC until its handler finished (streams included)",
            ["grpc_service", "grpc_method"], buckets=RPC_BUCKETS, registry=registry)

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        names = split_method(details.method)
        return wrap_handler(continuation(details), lambda fn: self._unary(fn, names),
                            lambda fn: self._stream(fn, names),
                            lambda fn: self._async_stream(fn, names))

    def _record(self, names: tuple[str, str], started: float, context: grpc.ServicerContext,
                failed: bool) -> None:
        """Counts the RPC with the code its client sees: CANCELLED once the client went
        away (its stream ended under the handler), else the code the handler set."""
        # an async handler's context (the asyncio server's) tells `cancelled()` instead
        gone = not context.is_active() if hasattr(context, "is_active") else context.cancelled()
        if gone:
            code = grpc.StatusCode.CANCELLED
        else:
            code = context.code() or (grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK)
        self.seconds.labels(*names).observe(time.perf_counter() - started)
        self.handled.labels(*names, code.name).inc()

    def _unary(self, fn: Callable[..., Any], names: tuple[str, str]) -> Callable[..., Any]:
        def handler(request: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            try:
                reply = fn(request, context)
            except BaseException:
                self._record(names, started, context, failed=True)
                raise
            self._record(names, started, context, failed=False)
            return reply

        return handler

    def _stream(self, fn: Callable[..., Iterator[Any]], names: tuple[str, str]
                ) -> Callable[..., Iterator[Any]]:
        def handler(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            started = time.perf_counter()
            try:
                yield from fn(request, context)
            except BaseException:  # GeneratorExit too: the stream was closed early
                self._record(names, started, context, failed=True)
                raise
            self._record(names, started, context, failed=False)

        return handler

    def _async_stream(self, fn: Callable[..., AsyncIterator[Any]], names: tuple[str, str]
                      ) -> Callable[..., AsyncIterator[Any]]:
        async def handler(request: Any, context: Any) -> AsyncIterator[Any]:
            started = time.perf_counter()
            try:
                async for reply in fn(request, context):
                    yield reply
            except BaseException:  # CancelledError too: the client went away
                self._record(names, started, context, failed=True)
                raise
            self._record(names, started, context, failed=False)

        return handler


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    """`--metrics-port` and `--metrics-host`, with their environment fallbacks."""
    parser.add_argument("--metrics-port", type=port_or_none,
                        default=os.environ.get("PIPEFB_METRICS_PORT", ""),
                        help="serve Prometheus /metrics on this port (0: any free port; "
                             "empty: no metrics server)")
    parser.add_argument("--metrics-host",
                        default=os.environ.get("PIPEFB_METRICS_HOST", "") or "127.0.0.1",
                        help="address the /metrics server binds")


def port_or_none(value: str) -> int | None:
    """A `--metrics-port` value: None when empty, else a port number 0..65535."""
    if not value.strip():
        return None
    if not value.strip().isdigit() or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number (0..65535)")
    return int(value)


def start_from_args(args: argparse.Namespace) -> tuple[tuple[grpc.ServerInterceptor, ...], str]:
    """Starts the /metrics server when `args.metrics_port` (parsed by `metrics_port`) asks.

    Returns:
        The interceptors to give `protos.server.create_server`, and the URL ("" when off).
    """
    if args.metrics_port is None:
        return (), ""
    return (MetricsInterceptor(),), serve_metrics(args.metrics_host, args.metrics_port)


def announce(url: str) -> None:
    """Prints the `metrics URL` line (after the `ready` line) when metrics are served."""
    if url:
        print(f"metrics {url}", flush=True)


def serve_metrics(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> str:
    """Starts the /metrics HTTP server in a daemon thread; returns its URL (bound port)."""
    httpd, _ = start_http_server(port, addr=host, registry=registry)
    bound = httpd.server_port
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{bound}/metrics"
