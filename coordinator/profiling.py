"""Asks workers to profile a job's layers (the Profile RPC, one worker after another) and
combines their replies into one profile and relative speeds; the messages' conversions
live in `protos.convert`."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pipefb.config import JobConfig
from pipefb.costs import Profile
from pipefb.errors import ConfigError
from pipefb.profiler import REPEATS, WARMUP, median_profile, relative_speeds
from protos import worker_pb2_grpc
from protos.convert import ProfileQuery, profile_from_proto

log = logging.getLogger(__name__)

PROFILE_TIMEOUT_SECONDS = 600.0  # one worker's whole profile (tracing included)


def profile_workers(stubs: Sequence[worker_pb2_grpc.StageWorkerStub], job: JobConfig,
                    microbatch_size: int, *, layers: range | None = None,
                    warmup: int = WARMUP, repeats: int = REPEATS,
                    timeout: float = PROFILE_TIMEOUT_SECONDS) -> tuple[Profile, list[float]]:
    """Profiles `job` on every worker, one after another (local workers share cores).

    Args:
        stubs: the workers to ask.
        job: the job whose layers to time.
        microbatch_size: samples per micro-batch.
        layers: which layers to time; None: all.
        warmup: untimed rounds before the timed ones.
        repeats: timed rounds (each time is their mean).
        timeout: seconds one worker may take.

    Returns:
        The per-layer median profile, and each worker's relative speed (the median
        total layer time over its own: 2.0 is twice as fast as the median worker).

    Raises:
        ConfigError: no worker, or workers whose profiles disagree on bytes.
        grpc.RpcError: a worker refused (INVALID_ARGUMENT for a bad argument) or failed.
    """
    if not stubs:
        raise ConfigError("profile_workers needs at least one worker")
    request = ProfileQuery(job, microbatch_size, layers, warmup, repeats).to_proto()
    profiles: list[Profile] = []
    for k, stub in enumerate(stubs):  # in turn: concurrent profiles would time each other
        reply = stub.Profile(request, timeout=timeout)
        log.info("worker %d profiled %d layers with %d torch threads", k, len(reply.layers),
                 reply.torch_threads)
        profiles.append(profile_from_proto(reply))
    return median_profile(profiles), relative_speeds(profiles)
