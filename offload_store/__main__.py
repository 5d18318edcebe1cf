"""Runs a local offload-store Redis server in the foreground until SIGTERM or SIGINT; or,
with ``--write-acl FILE``, writes the store's ACL file and exits (the Redis pod's init
container on Kubernetes, so the password reaches Redis in a file, never as an argument)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from offload_store.acl import acl_file
from offload_store.server import RedisServer
from offload_store.store import PASSWORD_ENV
from pipefb.processes import StopSignal

POLL_S = 1.0  # how often to check that the server is still alive


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses ``--port`` (0 picks a free one), ``--maxmemory``, ``--acl`` and ``--write-acl``."""
    parser = argparse.ArgumentParser(prog="python -m offload_store", description=__doc__)
    parser.add_argument("--port", type=int, default=6379, help="port on 127.0.0.1; 0 = any free")
    parser.add_argument("--maxmemory", default="1gb", help="memory limit, e.g. 1gb or 512mb")
    parser.add_argument("--unix-socket", type=Path, default=None,
                        help="also listen on this unix socket (mode 0700), for clients on "
                             "this host (their PIPEFB_STORE_SOCKET)")
    parser.add_argument("--acl", action="store_true",
                        help=f"default user off; only the service user, password from "
                             f"${PASSWORD_ENV} (see offload_store.acl)")
    parser.add_argument("--write-acl", metavar="FILE", type=Path,
                        help=f"write the ACL file (users of offload_store.acl, password from "
                             f"${PASSWORD_ENV}) to FILE, mode 0600, and exit")
    args = parser.parse_args(argv)
    wants_password = args.acl or args.write_acl is not None
    args.password = os.environ.get(PASSWORD_ENV) if wants_password else None
    if wants_password and not args.password:
        parser.error(f"--acl and --write-acl need the service user's password in "
                     f"${PASSWORD_ENV}")
    return args


def write_acl(path: Path, password: str) -> None:
    """Writes the store's users to `path`, readable by its owner only (created so: the
    password is never readable by others, not even for a moment).

    Raises:
        SystemExit: the password is not usable in an ACL rule (empty or with whitespace).
    """
    try:
        text = acl_file(password)
    except ValueError as error:
        raise SystemExit(f"--write-acl: {error}") from None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def main(argv: list[str] | None = None) -> int:
    """Starts the server, prints `ready ADDRESS` on one line, and serves until told to stop.

    Returns:
        0 after SIGTERM / SIGINT, 1 if the server process died on its own.
    """
    args = parse_args(argv)
    if args.write_acl is not None:
        write_acl(args.write_acl, args.password)
        print(f"wrote {args.write_acl}", flush=True)
        return 0
    stop = StopSignal()
    with RedisServer(maxmemory=args.maxmemory, port=args.port or None,
                     password=args.password, unix_socket=args.unix_socket) as server:
        address = server.address
        print(f"ready {address}", flush=True)
        while not stop.wait(POLL_S):
            if not server.running():
                print(f"redis-server at {address} exited", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
