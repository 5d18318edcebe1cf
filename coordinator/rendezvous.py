"""The rendezvous of a job's all-reduce groups: a torch.distributed TCPStore the coordinator
hosts while a job of several pipeline groups runs (see pipefb.runtime.allreduce)."""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

TIMEOUT_SECONDS = 60.0


class Rendezvous:
    """A TCPStore server on `host` (port 0: any free one) that only listens there."""

    def __init__(self, host: str, advertise: str, port: int = 0) -> None:
        # TCPStore binds every interface when it opens its own socket; hand it one bound
        # to the coordinator's listen address instead.
        self._socket = socket.create_server((host, port), backlog=256)
        self.port = self._socket.getsockname()[1]
        self.address = f"{advertise}:{self.port}"
        own = "127.0.0.1" if host in ("", "0.0.0.0") else host  # the server's own client
        self._store = dist.TCPStore(
            own, self.port, is_master=True, wait_for_workers=False,
            master_listen_fd=self._socket.fileno(),
            timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS))
