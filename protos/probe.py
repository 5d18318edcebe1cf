"""`python -m protos.probe [HOST:PORT]`: the health check Kubernetes runs in a pod.

Asks the gRPC health service of a pipefb process over the same channel the services use
(TLS and mTLS from the environment, [Note: transport security]); kubelet's own gRPC probe
speaks only plaintext. Exits 0 when SERVING, 1 otherwise, with one line saying why.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipefb.errors import ConfigError
from protos import server

TIMEOUT_S = 3.0


def check(address: str) -> str:
    """The health status name of the server at `address` (raises grpc.RpcError)."""
    with server.channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                     timeout=TIMEOUT_S)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: list[str] | None = None) -> int:
    """Probes the address given (default 127.0.0.1:50051); the exit status says SERVING."""
    args = sys.argv[1:] if argv is None else argv
    address = args[0] if args else "127.0.0.1:50051"
    try:
        status = check(address)
    except (grpc.RpcError, ConfigError) as error:
        why = f"{error.code().name}" if isinstance(error, grpc.RpcError) else str(error)
        print(f"probe {address}: {why}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"probe {address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
