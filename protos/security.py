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
- `PIPEFB_TOKEN_FILE`: a file holding a user's bearer token, which clients send as
  `authorization: Bearer <token>`. On the coordinator it is the admin token.
- `PIPEFB_SERVICE_TOKEN_FILE`: the service credential the workers hold and send (not
  the user token) on every call they make; the coordinator holds it to check them.
- `PIPEFB_USERS_FILE`: on the coordinator, more users, one `NAME TOKEN` per line.
- `PIPEFB_COORDINATOR_TOKEN_FILE`: the coordinator's own credential, which it sends (not
  the service credential) on every call to a worker; no worker holds it.
- `PIPEFB_COORDINATOR_VERIFIER_FILE`: on a worker, the hex SHA-256 of that credential
  (`verifier`): enough to recognise the coordinator, not to pose as it.

Who may call what is [Note: access] below; the health service needs no token (Kubernetes
probes call it).

Rules, checked when a server binds (`check_listen`) so a misconfiguration stops the
process at start with one line naming the fix:
- beyond loopback (any host but 127.0.0.0/8, ::1, localhost) a server needs TLS and a
  token: an open control port runs whatever arrives;
- a token is never sent over plaintext beyond loopback;
- on loopback both are optional (the local cluster, the tests).
Comparisons of tokens are constant-time (`hmac.compare_digest`).

[Note: access] A server configured with any token refuses a call without a known one
(UNAUTHENTICATED), then checks the caller's identity against the method (`POLICY`, first
match wins; PERMISSION_DENIED otherwise):
- a worker's control RPCs (Assign, Step, Drain, Checkpoint, Profile, ExportWeights) take
  only the coordinator's credential, which a worker checks against its SHA-256 and never
  holds: neither a user nor another worker can assign, drain or step a rank;
- a worker's tensor streams from its peers (Activations, Gradients, Weights, Migrate) and
  the coordinator's RegisterWorker and Heartbeat take only the service credential: a user
  token cannot feed a rank, nor pose as a worker to be handed a job;
- the coordinator's other RPCs take only user tokens (the admin's, and the users file's);
  the servicer scopes jobs to the identity that submitted them (`caller`);
- anything else (in-process servers of calibration and benchmarks) takes any known token.
`python -m worker` and `python -m coordinator` refuse to start without their credentials
(`require`), so on loopback too authentication is always on; a local cluster makes fresh
ones per cluster (`pipefb.app.local`) and leaves the user token where the CLI finds it
(`token_path`: a file only its user may read).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import grpc

from pipefb.errors import ConfigError
from pipefb.secretfiles import read_private, token_path, verifier

ENV = ("PIPEFB_TLS_CERT", "PIPEFB_TLS_KEY", "PIPEFB_TLS_CA", "PIPEFB_MTLS",
       "PIPEFB_TLS_SERVER_NAME", "PIPEFB_TOKEN_FILE", "PIPEFB_SERVICE_TOKEN_FILE",
       "PIPEFB_USERS_FILE", "PIPEFB_COORDINATOR_TOKEN_FILE",
       "PIPEFB_COORDINATOR_VERIFIER_FILE")
#: RPCs that need no token: Kubernetes' gRPC probes cannot send one
OPEN_METHODS = ("/grpc.health.v1.Health/",)
ADMIN = "admin"  # the identity of PIPEFB_TOKEN_FILE's token on the coordinator
SERVICE = "service"  # the identity of the service credential
COORDINATOR = "coordinator"  # the identity of the coordinator's credential, on workers
USERS = "users"  # in POLICY: the admin and every user of the users file
ANY = "any"  # in POLICY: every known identity
# a user's name: no dot, so users' job id namespaces never meet ([Note: job ids] in
# coordinator/service.py)
_USER_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")
#: method prefix -> who may call it ([Note: access]); first match wins
POLICY: tuple[tuple[str, str], ...] = (
    *((f"/pipefb.v1.StageWorker/{name}", SERVICE)
      for name in ("Activations", "Gradients", "Weights", "Migrate")),
    ("/pipefb.v1.StageWorker/", COORDINATOR),
    ("/pipefb.v1.Coordinator/RegisterWorker", SERVICE),
    ("/pipefb.v1.Coordinator/Heartbeat", SERVICE),
    ("/pipefb.v1.Coordinator/", USERS),
    ("", ANY),
)


@dataclass(frozen=True)
class Security:
    """The transport settings of this process (see [Note: transport security])."""

    cert: bytes | None = None  # PEM certificate chain
    key: bytes | None = None  # PEM private key
    ca: bytes | None = None  # PEM root certificates of the peers
    mtls: bool = False  # servers require client certificates signed by `ca`
    server_name: str = ""  # the name clients check in servers' certificates
    token: str = ""  # the user's bearer token; on the coordinator, the admin's; "" for none
    service_token: str = ""  # the workers' credential (the coordinator checks it); "" for none
    users: tuple[tuple[str, str], ...] = ()  # (name, token) the coordinator also accepts
    coordinator_token: str = ""  # the coordinator's credential for worker RPCs; "" for none
    coordinator_verifier: str = ""  # on workers: hex SHA-256 of it (`verifier`); "" for none

    @property
    def client_token(self) -> str:
        """The token this process sends: the coordinator's credential in the coordinator
        (it calls only workers), the service credential in a worker, else the user's."""
        return self.coordinator_token or self.service_token or self.token

    @property
    def identities(self) -> tuple[tuple[str, str], ...]:
        """(identity, token) of every token a server of this process knows."""
        known = ((ADMIN, self.token), (SERVICE, self.service_token), *self.users)
        return tuple((name, token) for name, token in known if token)

    @property
    def authenticates(self) -> bool:
        """Whether a server of this process checks tokens: it knows any."""
        return bool(self.identities or self.coordinator_verifier)

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
            the reverse), mTLS without TLS, an empty token file or a bad users file.
    """
    env = os.environ if env is None else env
    return _load(tuple(env.get(name, "") for name in ENV))


def client_settings(address: str, env: Mapping[str, str] | None = None) -> Security:
    """The settings of a client of `address`: the environment's, and without a token
    there, the user token a local cluster left for that address (`token_path`).

    Raises:
        ConfigError: as `from_env`, or a token file others may read.
    """
    settings = from_env(env)
    if settings.client_token:
        return settings
    path = token_path(address, env)
    if not path.is_file():
        return settings
    return replace(settings, token=read_private(path))


def require(settings: Security, service: str, *, admin: bool = False) -> None:
    """Refuses to run a service without its credentials ([Note: access]): the
    coordinator (`admin`) needs the service credential, its own and the admin token; a
    worker the service credential and the coordinator's verifier.

    Raises:
        ConfigError: naming each missing variable.
    """
    needs = (("PIPEFB_SERVICE_TOKEN_FILE", settings.service_token),
             ("PIPEFB_TOKEN_FILE", settings.token or not admin),
             ("PIPEFB_COORDINATOR_TOKEN_FILE", settings.coordinator_token or not admin),
             ("PIPEFB_COORDINATOR_VERIFIER_FILE", settings.coordinator_verifier or admin))
    missing = [name for name, have in needs if not have]
    if missing:
        raise ConfigError(f"{service} needs " + " and ".join(missing)
                          + " (authentication is always on; `pipefb local` makes them)")


@lru_cache(maxsize=8)
def _load(values: tuple[str, ...]) -> Security:
    (cert, key, ca, mtls, server_name, token_file, service_file, users_file,
     coordinator_file, verifier_file) = values
    if bool(cert) != bool(key):
        raise ConfigError("PIPEFB_TLS_CERT and PIPEFB_TLS_KEY go together: set both or neither")
    if mtls not in ("", "0", "1"):
        raise ConfigError(f"PIPEFB_MTLS={mtls!r}: use 1 or 0")
    if mtls == "1" and not (cert and ca):
        raise ConfigError("PIPEFB_MTLS=1 needs PIPEFB_TLS_CERT, PIPEFB_TLS_KEY and "
                          "PIPEFB_TLS_CA (the CA that signs client certificates)")
    return Security(cert=_read(cert, "PIPEFB_TLS_CERT") if cert else None,
                    key=_read(key, "PIPEFB_TLS_KEY") if key else None,
                    ca=_read(ca, "PIPEFB_TLS_CA") if ca else None,
                    mtls=mtls == "1", server_name=server_name,
                    token=_token(token_file, "PIPEFB_TOKEN_FILE"),
                    service_token=_token(service_file, "PIPEFB_SERVICE_TOKEN_FILE"),
                    users=_users(users_file) if users_file else (),
                    coordinator_token=_token(coordinator_file,
                                             "PIPEFB_COORDINATOR_TOKEN_FILE"),
                    coordinator_verifier=_verifier(verifier_file))


def _verifier(path: str) -> str:
    """The coordinator's verifier in `path`: 64 hex digits (`verifier`)."""
    text = _token(path, "PIPEFB_COORDINATOR_VERIFIER_FILE").lower()
    if text and not (len(text) == 64 and all(c in "0123456789abcdef" for c in text)):
        raise ConfigError(f"PIPEFB_COORDINATOR_VERIFIER_FILE={path!r} must hold the 64 hex "
                          "digits of the coordinator token's SHA-256")
    return text


def _token(path: str, name: str) -> str:
    token = _read(path, name).decode().strip() if path else ""
    if path and not token:
        raise ConfigError(f"{name}={path!r} is empty")
    return token


def _users(path: str) -> tuple[tuple[str, str], ...]:
    """The users file: `NAME TOKEN` per line; blank lines and `#` comments skipped."""
    users: list[tuple[str, str]] = []
    for number, line in enumerate(_read(path, "PIPEFB_USERS_FILE").decode().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if (len(fields) != 2 or fields[0] in (ADMIN, SERVICE, COORDINATOR, USERS, ANY)
                or not _USER_NAME.fullmatch(fields[0])):
            raise ConfigError(f"PIPEFB_USERS_FILE={path!r} line {number}: write NAME TOKEN "
                              f"(a NAME of 1 to 32 letters, digits, _ or -, other than "
                              f"{ADMIN}, {SERVICE}, {COORDINATOR}, {USERS}, {ANY})")
        users.append((fields[0], fields[1]))
    return tuple(users)


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
                                     ("a token (PIPEFB_TOKEN_FILE or PIPEFB_SERVICE_TOKEN_FILE)",
                                      security.authenticates))
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
    token = security.client_token
    if not security.tls:
        if token and not is_loopback(address.rsplit(":", 1)[0]):
            raise ConfigError(f"refusing to send the token in plaintext to {address}: "
                              "set PIPEFB_TLS_CA (and the certificate) for TLS")
        ch = grpc.insecure_channel(address, options=options)
        return grpc.intercept_channel(ch, _TokenClient(token)) if token else ch
    creds = security.channel_credentials()
    if token:
        creds = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(token))
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


class AccessInterceptor(grpc.ServerInterceptor):
    """Refuses every RPC but the health service's without a known token, and every RPC
    whose caller `POLICY` does not allow ([Note: access])."""

    def __init__(self, settings: Security) -> None:
        self.settings = settings

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        if details.method.startswith(OPEN_METHODS):
            return continuation(details)
        who = identify(self.settings, details.invocation_metadata)
        if who is None:
            return _refusal(continuation(details), grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong bearer token")
        if not allowed(details.method, who):
            return _refusal(continuation(details), grpc.StatusCode.PERMISSION_DENIED,
                            f"{details.method} is not open to this caller")
        return continuation(details)


def allowed(method: str, who: str) -> bool:
    """Whether identity `who` may call `method` (`POLICY`)."""
    need = next(need for prefix, need in POLICY if method.startswith(prefix))
    if need == ANY:
        return True
    if need == USERS:
        return who not in (SERVICE, COORDINATOR)
    return who == need


def identify(settings: Security, metadata: Any) -> str | None:
    """The identity whose token the call's metadata carries; None for none known. The
    coordinator's credential is known by its SHA-256 (`verifier`) only."""
    sent = str(dict(metadata or ()).get("authorization", "")).encode()
    found = None
    for name, token in settings.identities:  # every one compared: constant time
        if hmac.compare_digest(sent, f"Bearer {token}".encode()):
            found = name
    if settings.coordinator_verifier:
        offered = sent.removeprefix(b"Bearer ")
        if hmac.compare_digest(verifier(offered.decode(errors="replace")).encode(),
                               settings.coordinator_verifier.encode()):
            found = COORDINATOR
    return found


def caller(context: grpc.ServicerContext) -> str:
    """The identity of the call being served ([Note: access]); ADMIN on a server that
    knows no tokens (in-process servers on loopback, which check none)."""
    settings = from_env()
    if not settings.authenticates:
        return ADMIN
    who = identify(settings, context.invocation_metadata())
    if who is None:  # the interceptor refused it already; never reached
        raise PermissionError("unknown caller")
    return who


def _refusal(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler of the same shape as `handler` that aborts with `code`."""
    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    if handler is None:
        return None
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.stream_stream_rpc_method_handler(deny)
