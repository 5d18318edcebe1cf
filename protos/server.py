"""gRPC server plumbing shared by the services: creation, health, errors -> status codes."""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pipefb.errors import (
    Aborted,
    CodecError,
    ConfigError,
    DiskFullError,
    FileWriteError,
    Overloaded,
    ScheduleError,
    StoreFullError,
    WorkerFailed,
)
from pipefb.processes import StopSignal
from protos import security

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 20  # tensor chunks are <= 1 MiB; control messages are small
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # trailing metadata of an Overloaded refusal


class FailedPrecondition(RuntimeError):
    """The request is well formed but the service is not in a state to run it."""


# The one table from domain errors to status codes. Order matters: first match wins.
STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (CodecError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (ScheduleError, grpc.StatusCode.INVALID_ARGUMENT),
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (StoreFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DiskFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),  # a checkpoint's disk is full
    (FileWriteError, grpc.StatusCode.FAILED_PRECONDITION),  # a checkpoint's disk refused
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Aborted, grpc.StatusCode.ABORTED),
    (WorkerFailed, grpc.StatusCode.UNAVAILABLE),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_of(error: BaseException) -> grpc.StatusCode:
    """Maps a domain error to its gRPC status code (INTERNAL for anything unexpected)."""
    for kind, code in STATUS_OF:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _message(error: BaseException) -> str:
    return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)


def _abort(context: grpc.ServicerContext, error: BaseException) -> None:
    if context.code() is not None:
        raise error  # the handler already aborted with its own status
    if isinstance(error, grpc.RpcError) and not context.is_active():
        # the client went away (cancelled its long-lived stream at the job's end): reading
        # its next message raises, and there is nobody left to tell
        log.debug("client of %s left: %r", type(error).__name__, error)
        raise error
    code = status_of(error)
    if isinstance(error, Overloaded):  # the gRPC retry pushback (gRFC A6): when to retry
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY,
                                        str(round(error.retry_after_seconds * 1000))),))
    if code is grpc.StatusCode.INTERNAL:
        log.exception("unexpected error in handler", exc_info=error)
    context.abort(code, f"{type(error).__name__}: {_message(error)}")


def abort(context: grpc.ServicerContext, error: BaseException) -> None:
    """Ends the RPC with `error`'s status (`STATUS_OF`) and message; always raises. For
    interceptors that refuse a call before its handler runs."""
    _abort(context, error)


def _wrap_unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(request, context)
        except Exception as error:
            _abort(context, error)
            raise  # unreachable: abort raises

    return handler


def _wrap_stream(fn: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    def handler(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(request, context)
        except Exception as error:
            _abort(context, error)

    return handler


async def abort_async(context: Any, error: BaseException) -> None:
    """`abort` for an async handler of the asyncio server ([Note: asyncio server] in
    protos/aioserver.py); always raises."""
    if context.code() is not None:
        raise error  # the handler already aborted with its own status
    if isinstance(error, grpc.RpcError) and context.cancelled():
        raise error  # the client went away: nobody is left to tell
    code = status_of(error)
    if isinstance(error, Overloaded):
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY,
                                        str(round(error.retry_after_seconds * 1000))),))
    if code is grpc.StatusCode.INTERNAL:
        log.exception("unexpected error in handler", exc_info=error)
    await context.abort(code, f"{type(error).__name__}: {_message(error)}")


def _wrap_async_stream(fn: Callable[..., AsyncIterator[Any]]
                       ) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            async for reply in fn(request, context):
                yield reply
        except Exception as error:
            await abort_async(context, error)

    return handler


Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def wrap_handler(handler: Any, unary: Wrap, stream: Wrap, async_stream: Wrap | None = None
                 ) -> Any:
    """An RPC method handler whose behaviour is wrapped: by `unary` where it returns one
    reply (unary and client-streaming RPCs), by `stream` where it yields replies, by
    `async_stream` where an async generator yields them (the asyncio server's waiting
    streams, [Note: asyncio server] in protos/aioserver.py). Other async handlers (the
    asyncio health service's), and async generators without `async_stream`, are left as
    they are."""
    if handler is None:
        return None
    functions = (handler.unary_unary, handler.stream_unary, handler.unary_stream,
                 handler.stream_stream)
    if any(inspect.iscoroutinefunction(f) for f in functions if f):
        return handler
    if handler.unary_unary:
        return handler._replace(unary_unary=unary(handler.unary_unary))
    if handler.stream_unary:
        return handler._replace(stream_unary=unary(handler.stream_unary))
    if handler.unary_stream and inspect.isasyncgenfunction(handler.unary_stream):
        if async_stream is None:
            return handler
        return handler._replace(unary_stream=async_stream(handler.unary_stream))
    if handler.unary_stream:
        return handler._replace(unary_stream=stream(handler.unary_stream))
    if handler.stream_stream:
        return handler._replace(stream_stream=stream(handler.stream_stream))
    return handler


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns exceptions raised by servicer methods into status codes via `STATUS_OF`."""

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        return wrap_handler(continuation(details), _wrap_unary, _wrap_stream,
                            _wrap_async_stream)


def create_server(
    add_servicers: Callable[[grpc.Server], None],
    address: str = "127.0.0.1:0",
    *,
    max_workers: int = 32,
    interceptors: tuple[grpc.ServerInterceptor, ...] = (),
    health_service: bool = True,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Creates and starts a server with the health service (NOT_SERVING until `ready`;
    not served with `health_service` False), over TLS and behind the token check when the
    environment configures them ([Note: transport security] in `protos.security`).

    Returns:
        The server, the port it bound (useful with port 0) and its health servicer.

    Raises:
        ConfigError: a listen host beyond loopback without TLS and a token.
    """
    settings = security.from_env()
    security.check_listen(address.rsplit(":", 1)[0], settings)
    guard = (security.AccessInterceptor(settings),) if settings.authenticates else ()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=(*guard, *interceptors, ErrorInterceptor()),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
        maximum_concurrent_rpcs=max_workers * 4,
    )
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    if health_service:
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = (server.add_secure_port(address, settings.server_credentials()) if settings.tls
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"cannot bind {address}")
    server.start()
    return server, port, health_servicer


class Health(Protocol):
    """What `ready` and `serve_until_signal` call of a health servicer (the thread one,
    or `protos.aioserver.LoopHealth`)."""

    def set(self, service: str, status: Any) -> None: ...

    def enter_graceful_shutdown(self) -> None: ...


class Stoppable(Protocol):
    """What `serve_until_signal` calls of a server (a `grpc.Server`, or
    `protos.aioserver.LoopServer`)."""

    def stop(self, grace: float | None) -> threading.Event: ...


def ready(health_servicer: Health) -> None:
    """Marks the server SERVING."""
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)


def serve_until_signal(server: Stoppable, health_servicer: Health,
                       grace_seconds: float = 5.0,
                       on_stop: Callable[[], None] | None = None,
                       exit_within: float | None = None) -> None:
    """Blocks until SIGTERM or SIGINT, then stops gracefully: health turns NOT_SERVING (so
    load balancers and probes stop sending work), `on_stop` runs (the coordinator drains
    its jobs there) while the server still answers, then new RPCs are refused and those
    in flight get `grace_seconds` to finish. With `exit_within`, the process ends that many
    seconds after the signal even if the clean-up is still stuck (a thread blocked on a
    peer that died, a channel that does not close): a stopping worker must not linger."""
    StopSignal().wait()
    if exit_within is not None:
        watchdog = threading.Timer(exit_within, _exit_now, args=(exit_within,))
        watchdog.daemon = True
        watchdog.start()
    log.info("stopping: health NOT_SERVING, %.0f s for RPCs in flight", grace_seconds)
    health_servicer.enter_graceful_shutdown()
    if on_stop is not None:
        on_stop()
    server.stop(grace_seconds).wait()


def _exit_now(seconds: float) -> None:
    """Ends the process at once: its clean-up outlived the deadline."""
    log.warning("the clean-up still runs %.0f s after the stop signal: exiting now", seconds)
    logging.shutdown()
    os._exit(1)


def channel(address: str, settings: security.Security | None = None) -> grpc.Channel:
    """A channel to `address` with pipefb's message size limits, over TLS and with the
    token when `settings` (default: the environment's, `security.client_settings`)
    configure them ([Note: transport security])."""
    return security.secure_channel(address, [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ], settings or security.client_settings(address))


def run_service(main: Callable[[], None], name: str) -> None:
    """Runs a service's `main`; a ConfigError (a bad flag, file or security setting) ends
    the process with one line naming it and status 2, not a traceback."""
    try:
        main()
    except ConfigError as error:
        print(f"{name}: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
