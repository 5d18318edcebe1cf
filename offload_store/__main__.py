"""Runs a local offload-store Redis server in the foreground until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from types import FrameType

from offload_store.server import RedisServer
from offload_store.store import PASSWORD_ENV

POLL_S = 1.0  # how often to check that the server is still alive


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses ``--port`` (0 picks a free one), ``--maxmemory`` and ``--acl``."""
    parser = argparse.ArgumentParser(prog="python -m offload_store", description=__doc__)
    parser.add_argument("--port", type=int, default=6379, help="port on 127.0.0.1; 0 = any free")
    parser.add_argument("--maxmemory", default="1gb", help="memory limit, e.g. 1gb or 512mb")
    parser.add_argument("--acl", action="store_true",
                        help=f"default user off; only the service user, password from "
                             f"${PASSWORD_ENV} (see offload_store.acl)")
    args = parser.parse_args(argv)
    args.password = os.environ.get(PASSWORD_ENV) if args.acl else None
    if args.acl and not args.password:
        parser.error(f"--acl needs the service user's password in ${PASSWORD_ENV}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Starts the server, prints `ready ADDRESS` on one line, and serves until told to stop.

    Returns:
        0 after SIGTERM / SIGINT, 1 if the server process died on its own.
    """
    args = parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with RedisServer(maxmemory=args.maxmemory, port=args.port or None,
                     password=args.password) as server:
        address = server.address
        print(f"ready {address}", flush=True)
        while not stop.wait(POLL_S):
            if not server.running():
                print(f"redis-server at {address} exited", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
