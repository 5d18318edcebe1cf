"""Transport security of every pipefb RPC: TLS (mTLS optional) and a bearer token.

[Note: transport security] One process-wide setting, read from the environment so that
every service, the CLI and the local launcher's children agree without plumbing:

- `PIPEFB_TLS_CERT`, `PIPEFB_TLS_KEY`: PEM files of this process's certificate and key.
  A server presents them; a client presents them too when the server asks (mTLS).
- `PIPEFB_TLS_CA`: PEM file of the CA that signed the peers' certificates; clients check
  servers against it, and with `PIPEFB_MTLS=1` servers require and check client
  certificates against it.
- `PIPEFB_TLS_SERVER_NAME`: the name clients expect in servers' certificates, when it is
  not the host they dial (one certificate for every pod, say).
- `PIPEFB_TOKEN_FILE`: a file holding the bearer token. Servers refuse any RPC without
  `authorization: Bearer <token>` (UNAUTHENTICATED), except the health service, which
  Kubernetes probes call; clients send it on every call.

Rules, checked when a server binds (`check_listen`) so a misconfiguration stops the
process at start with one line naming the fix:
- beyond loopback (any host but 127.0.0.0/8, ::1, localhost) a server needs TLS and a
  token: an open control port runs whatever arrives;
- a token is never sent over plaintext beyond loopback;
- on loopback both are optional (the local cluster, the tests).
Comparisons of tokens are constant-time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import grpc

from pipefb.errors import ConfigError

ENV = ("PIPEFB_TLS_CERT", "PIPEFB_TLS_KEY", "PIPEFB_TLS_CA", "PIPEFB_MTLS",
       "PIPEFB_TLS_SERVER_NAME", "PIPEFB_TOKEN_FILE")
#: RPCs that need no token: Kubernetes' gRPC probes cannot send one
OPEN_METHODS = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class Security:
    """The transport settings of this process (see [Note: transport security])."""

    cert: bytes | None = None  # PEM certificate chain
    key: bytes | None = None  # PEM private key
    ca: bytes | None = None  # PEM root certificates of the peers
    mtls: bool = False  # servers require client certificates signed by `ca`
    server_name: str = ""  # the name clients check in servers' certificates
    token: str = ""  # bearer token; "" for none

    @property
    def tls(self) -> bool:
        """Whether this process serves and dials over TLS."""
        return self.cert is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS credentials of a server (client certificates required under mTLS)."""
        assert self.cert is not None and self.key is not None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.mtls)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials of a client, with its certificate for mTLS servers."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def from_env(env: Mapping[str, str] | None = None) -> Security:
    """The settings named by the environment (`os.environ` by default).

    Raises:
        ConfigError: a named file that cannot be read, a certificate without its key (or
            the reverse), mTLS without TLS, or an empty token file.
    """
    env = os.environ if env is None else env
    return _load(tuple(env.get(name, "") for name in ENV))


@lru_cache(maxsize=8)
def _load(values: tuple[str, ...]) -> Security:
    cert, key, ca, mtls, server_name, token_file = values
    if bool(cert) != bool(key):
        raise ConfigError("PIPEFB_TLS_CERT and PIPEFB_TLS_KEY go together: set both or neither")
    if mtls not in ("", "0", "1"):
        raise ConfigError(f"PIPEFB_MTLS={mtls!r}: use 1 or 0")
    if mtls == "1" and not (cert and ca):
        raise ConfigError("PIPEFB_MTLS=1 needs PIPEFB_TLS_CERT, PIPEFB_TLS_KEY and "
                          "PIPEFB_TLS_CA (the CA that signs client certificates)")
    token = _read(token_file, "PIPEFB_TOKEN_FILE").decode().strip() if token_file else ""
    if token_file and not token:
        raise ConfigError(f"PIPEFB_TOKEN_FILE={token_file!r} is empty")
    return Security(cert=_read(cert, "PIPEFB_TLS_CERT") if cert else None,
                    key=_read(key, "PIPEFB_TLS_KEY") if key else None,
                    ca=_read(ca, "PIPEFB_TLS_CA") if ca else None,
                    mtls=mtls == "1", server_name=server_name, token=token)


def _read(path: str, name: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{name}={path!r}: {error.strerror}") from None


def is_loopback(host: str) -> bool:
    """Whether `host` (a listen or dial host, brackets allowed) stays on this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen(host: str, security: Security) -> None:
    """Refuses a server binding `host` without the protection it needs.

    Raises:
        ConfigError: beyond loopback without TLS or without a token.
    """
    if is_loopback(host):
        return
    missing = [what for what, ok in (("TLS (PIPEFB_TLS_CERT, PIPEFB_TLS_KEY)", security.tls),
                                     ("a token (PIPEFB_TOKEN_FILE)", bool(security.token)))
               if not ok]
    if missing:
        raise ConfigError(f"listening on {host!r}, beyond loopback, needs "
                          + " and ".join(missing) + "; or listen on 127.0.0.1")


def channel_options(security: Security) -> list[tuple[str, Any]]:
    """Extra channel options: the server name to check, if set."""
    if security.tls and security.server_name:
        return [("grpc.ssl_target_name_override", security.server_name)]
    return []


def secure_channel(address: str, options: list[tuple[str, Any]], security: Security
                   ) -> grpc.Channel:
    """A channel to `address` over TLS when configured, sending the token on every call.

    Raises:
        ConfigError: a token to be sent in plaintext beyond loopback.
    """
    options = [*options, *channel_options(security)]
    if not security.tls:
        if security.token and not is_loopback(address.rsplit(":", 1)[0]):
            raise ConfigError(f"refusing to send the token in plaintext to {address}: "
                              "set PIPEFB_TLS_CA (and the certificate) for TLS")
        ch = grpc.insecure_channel(address, options=options)
        return grpc.intercept_channel(ch, _TokenClient(security.token)) if security.token else ch
    creds = security.channel_credentials()
    if security.token:
        creds = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(security.token))
    return grpc.secure_channel(address, creds, options=options)


class _TokenClient(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call of a plaintext loopback channel (gRPC refuses
    call credentials on insecure channels)."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        # grpc hands interceptors its own namedtuple of call details
        return details._replace(metadata=[*(details.metadata or ()), self.header])

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any,
                              request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any,
                               request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any,
                               requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any,
                                requests: Any) -> Any:
        return continuation(self._details(details), requests)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every RPC but the health service's without the bearer token."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        if details.method.startswith(OPEN_METHODS) or self._authorized(details):
            return continuation(details)
        return _refusal(continuation(details))

    def _authorized(self, details: Any) -> bool:
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        return hmac.compare_digest(str(sent).encode(), self.expected)


def _refusal(handler: Any) -> Any:
    """A handler of the same shape as `handler` that aborts UNAUTHENTICATED."""
    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    if handler is None:
        return None
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.stream_stream_rpc_method_handler(deny)
