"""The asyncio gRPC server: a handler that waits (a `Train` follower) holds no thread.

[Note: asyncio server] The coordinator is served by `grpc.aio` on an event loop of its own
thread. A handler written as an async generator (the coordinator's `Train`) runs on that
loop and awaits its job's step events, so any number of followers cost no threads; what
bounds them is the admission limits (`coordinator/limits.py`). Every other handler stays a
plain function and runs on the server's bounded thread pool, behind the same
interceptors as the thread server of `protos.server` (adapted by `_Adapted`), with a
context that has the `grpc.ServicerContext` calls they use (`_SyncContext`). The health
service is gRPC's asyncio one, so a health `Watch` holds no thread either.
`LoopServer` and `LoopHealth` give the server and its health the blocking calls of a
`grpc.Server` and a `HealthServicer` (`stop(...).wait()`, `set`), so the rest of the
process drives it like the thread server.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import _async as aio_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import security
from protos.server import MAX_MESSAGE_BYTES, ErrorInterceptor, wrap_handler

T = TypeVar("T")


class LoopServer:
    """A `grpc.aio.Server` on its event loop's thread, with blocking `stop` and
    `wait_for_termination` as a `grpc.Server` has them."""

    def __init__(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop) -> None:
        self._server, self._loop = server, loop

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs `coroutine` on the server's loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def stop(self, grace: float | None) -> threading.Event:
        """Refuses new RPCs and ends those in flight after `grace` seconds; the returned
        event is set once the server stopped."""
        done = threading.Event()
        stopping = asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop)
        stopping.add_done_callback(lambda _: done.set())
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until the server stopped; whether it did within `timeout` seconds."""
        waiting = asyncio.run_coroutine_threadsafe(self._server.wait_for_termination(),
                                                   self._loop)
        try:
            waiting.result(timeout)
        except futures.TimeoutError:
            return False
        return True


class LoopHealth:
    """gRPC's asyncio health servicer with the blocking calls of the thread one."""

    def __init__(self, servicer: aio_health.HealthServicer, server: LoopServer) -> None:
        self.servicer, self._server = servicer, server

    def set(self, service: str, status: Any) -> None:
        """Sets `service`'s status (and tells its watchers)."""
        self._server.run(self.servicer.set(service, status))

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on."""
        self._server.run(self.servicer.enter_graceful_shutdown())


class _SyncContext:
    """The context a plain handler of the asyncio server gets: gRPC's thread-side context
    plus `code()` and `is_active()`, which the interceptors of `protos.server` read."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._code: grpc.StatusCode | None = None
        self._ended = threading.Event()
        inner.add_callback(self._ended.set)

    def code(self) -> grpc.StatusCode | None:
        """The status code set or aborted with so far; None before."""
        return self._code

    def is_active(self) -> bool:
        """Whether the call is still going (not ended, cancelled or past its deadline)."""
        return not self._ended.is_set()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code
        self._inner.set_code(code)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        self._inner.abort(code, details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _with_sync_context(fn: Callable[..., Any]) -> Callable[..., Any]:
    def handler(request: Any, context: Any) -> Any:
        return fn(request, _SyncContext(context))

    return handler


def _as_is(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


class _ContextInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Outermost: hands every plain handler a `_SyncContext`; async ones keep theirs."""

    async def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        return wrap_handler(await continuation(details), _with_sync_context,
                            _with_sync_context, _as_is)


class _Adapted(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A thread-server interceptor (`grpc.ServerInterceptor`) run by the asyncio server:
    it wraps the handler the inner interceptors made."""

    def __init__(self, interceptor: grpc.ServerInterceptor) -> None:
        self.interceptor = interceptor

    async def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = await continuation(details)
        return self.interceptor.intercept_service(lambda _: handler, details)


def create_aio_server(
    add_servicers: Callable[[grpc.aio.Server], None],
    address: str = "127.0.0.1:0",
    *,
    max_workers: int = 32,
    interceptors: tuple[grpc.ServerInterceptor, ...] = (),
    max_concurrent_rpcs: int = 4096,
) -> tuple[LoopServer, int, LoopHealth]:
    """Creates and starts an asyncio server ([Note: asyncio server]) as
    `protos.server.create_server` does a thread server: the health service
    (NOT_SERVING until `ready`), TLS and the token check when the environment configures
    them, errors mapped to status codes; plain handlers run on `max_workers` threads, and
at most `max_concurrent_rpcs` calls of any kind are served at once (a bound on memory,
not threads: the admission limits bound each kind well below it).

    Returns:
        The server, the port it bound and its health servicer.

    Raises:
        ConfigError: a listen host beyond loopback without TLS and a token.
    """
    settings = security.from_env()
    security.check_listen(address.rsplit(":", 1)[0], settings)
    guard = (security.AccessInterceptor(settings),) if settings.authenticates else ()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="grpc-aio", daemon=True).start()

    async def start() -> tuple[grpc.aio.Server, int, aio_health.HealthServicer]:
        server = grpc.aio.server(
            migration_thread_pool=futures.ThreadPoolExecutor(max_workers=max_workers),
            interceptors=(_ContextInterceptor(), *(_Adapted(i) for i in (
                *guard, *interceptors, ErrorInterceptor()))),
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
            maximum_concurrent_rpcs=max_concurrent_rpcs)
        add_servicers(server)
        health = aio_health.HealthServicer()
        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = (server.add_secure_port(address, settings.server_credentials())
                if settings.tls else server.add_insecure_port(address))
        if port == 0:
            raise OSError(f"cannot bind {address}")
        await server.start()
        return server, port, health

    server, port, health = asyncio.run_coroutine_threadsafe(start(), loop).result()
    loop_server = LoopServer(server, loop)
    return loop_server, port, LoopHealth(health, loop_server)
