"""The workers' own server on the coordinator: Heartbeat and RegisterWorker on a port of
their own, so no user call, and no flood of any caller on the main port, delays a
heartbeat.

[Note: workers' path] The main server ([Note: asyncio server] in protos/aioserver.py)
serves users and workers alike, and gRPC caps the calls it serves at once (every kind
counted, unauthenticated health `Watch` streams among them) before any admission limit
sees them: a flood past that cap would refuse heartbeats too, and a running job would be
failed for its workers' silence. So the coordinator also serves the workers' two RPCs on
a second port (`--worker-listen`, `PIPEFB_WORKER_LISTEN`; the listen host and any free
port by default) and tells each worker that port in `RegisterWorkerReply.heartbeat_port`;
the worker sends its heartbeats, and registers again when told to, there. That server
has nothing else: no health service (whose `Watch` streams anyone may open), no user RPC
(unknown methods: UNIMPLEMENTED), the same TLS and token check (only the service
credential may call, [Note: access] in protos/security.py; a user token is
PERMISSION_DENIED, none UNAUTHENTICATED, each at once) and the same registration rate
limit (`Admission`). The main port keeps both RPCs, for a worker's first registration.
"""

from __future__ import annotations

from typing import Any

import grpc

from coordinator.limits import Admission
from coordinator.service import CoordinatorServicer
from protos import coordinator_pb2
from protos.server import create_server

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
THREADS = 4  # a heartbeat is a dictionary update: 4 threads serve thousands a second


def _handlers(servicer: CoordinatorServicer) -> grpc.GenericRpcHandler:
    """The Coordinator service with RegisterWorker and Heartbeat only."""
    def unary(fn: Any, request: Any, reply: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=request.FromString,
            response_serializer=reply.SerializeToString)

    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "RegisterWorker": unary(servicer.RegisterWorker,
                                coordinator_pb2.RegisterWorkerRequest,
                                coordinator_pb2.RegisterWorkerReply),
        "Heartbeat": unary(servicer.Heartbeat, coordinator_pb2.HeartbeatRequest,
                           coordinator_pb2.HeartbeatReply),
    })


def serve_worker_path(servicer: CoordinatorServicer, address: str, admission: Admission
                      ) -> tuple[grpc.Server, int]:
    """Starts the workers' server on `address` ([Note: workers' path]) and tells
    `servicer` its port, which RegisterWorker replies carry from then on.

    Returns:
        The server and the port it bound.

    Raises:
        ConfigError: a listen host beyond loopback without TLS and a token.
    """
    server, port, _ = create_server(
        lambda s: s.add_generic_rpc_handlers((_handlers(servicer),)), address,
        max_workers=THREADS, interceptors=(admission,), health_service=False)
    servicer.heartbeat_port = port
    return server, port
