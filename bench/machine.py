"""What the benches ran on: CPU model, cores, library versions, date (UTC)."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

import grpc
import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe() -> dict[str, Any]:
    """A JSON-able description of this machine and the run's date."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads_default": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": now(),
    }


def now() -> str:
    """The date and time a bench ran, in UTC, as the pages print it."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
