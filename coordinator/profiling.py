"""Asks workers to profile a job's layers (the Profile RPC, one worker after another),
reusing a worker's earlier reply to the same question, and combines the replies into one
profile and relative speeds; the messages' conversions live in `protos.convert`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig
from pipefb.profile.measure import REPEATS, WARMUP
from pipefb.profile.summary import median_profile, relative_speeds
from pipefb.sim.costs import Profile
from protos import worker_pb2, worker_pb2_grpc
from protos.convert import ProfileQuery, profile_from_proto

log = logging.getLogger(__name__)

PROFILE_TIMEOUT_SECONDS = 600.0  # one worker's whole profile (tracing included)

# [Note: profile reuse]
# A worker's reply to a Profile request depends on the worker and on what the request
# asks: the model, data, loss, optimizer, device, precision, seed, batch and micro-batch
# sizes, the layers, warm-up and repeats, and any injected slowdown. It does not depend on how the
# job would be planned or run (PLAN_ONLY), so `plan: auto` jobs that differ only in
# those (a sweep over schedules, steps or caps) reuse the first one's replies, so such
# a sweep pays for profiling, which takes far longer than planning, only once. The
# cache lives as long as the coordinator, keyed by worker address and question; a
# worker that registers (a new process) or is found dead loses its replies (`forget`).

#: JobSpec fields that shape the plan or the run, never a layer's measured cost
PLAN_ONLY = ("job_id", "schedule", "workers", "microbatches", "steps", "mode", "staleness",
             "policy", "eval_every", "plan", "memory_cap", "groups", "checkpoint_every",
             "checkpoint_dir", "resume", "max_restarts", "replan", "check_groups_every",
             "staleness_microbatches")


class ProfileCache:
    """Workers' Profile replies by worker and request ([Note: profile reuse]);
    thread-safe."""

    def __init__(self) -> None:
        self._replies: dict[tuple[str, bytes], Profile] = {}
        self._lock = threading.Lock()

    @staticmethod
    def question(request: worker_pb2.ProfileRequest) -> bytes:
        """The request with its job's plan-only fields cleared, as deterministic bytes."""
        blank = worker_pb2.ProfileRequest()
        blank.CopyFrom(request)
        for name in PLAN_ONLY:
            blank.job.ClearField(name)
        question: bytes = blank.SerializeToString(deterministic=True)
        return question

    def get(self, worker: str, question: bytes) -> Profile | None:
        """`worker`'s reply to `question` (see `question`), or None."""
        with self._lock:
            return self._replies.get((worker, question))

    def put(self, worker: str, question: bytes, profile: Profile) -> None:
        """Keeps `worker`'s reply to `question`."""
        with self._lock:
            self._replies[(worker, question)] = profile

    def forget(self, worker: str) -> None:
        """Drops every reply of `worker` (it went away)."""
        with self._lock:
            for key in [k for k in self._replies if k[0] == worker]:
                del self._replies[key]


def profile_workers(stubs: Sequence[worker_pb2_grpc.StageWorkerStub], job: JobConfig,
                    microbatch_size: int, *, layers: range | None = None,
                    warmup: int = WARMUP, repeats: int = REPEATS,
                    timeout: float = PROFILE_TIMEOUT_SECONDS,
                    cache: tuple[ProfileCache, Sequence[str]] | None = None
                    ) -> tuple[Profile, list[float], int]:
    """Profiles `job` on every worker, one after another (local workers share cores).

    Args:
        stubs: the workers to ask.
        job: the job whose layers to time.
        microbatch_size: samples per micro-batch.
        layers: which layers to time; None: all.
        warmup: untimed rounds before the timed ones.
        repeats: timed rounds (each time is their mean).
        timeout: seconds one worker may take.
        cache: a cache and each stub's worker address: a worker that answered the same
            question before is not asked again ([Note: profile reuse]).

    Returns:
        The per-layer median profile, each worker's relative speed (the median total
        layer time over its own: 2.0 is twice as fast as the median worker), and how
        many workers' profiles came from the cache.

    Raises:
        ConfigError: no worker, or workers whose profiles disagree on bytes.
        grpc.RpcError: a worker refused (INVALID_ARGUMENT for a bad argument) or failed.
    """
    if not stubs:
        raise ConfigError("profile_workers needs at least one worker")
    request = ProfileQuery(job, microbatch_size, layers, warmup, repeats).to_proto()
    store, names = cache or (None, [])
    question = ProfileCache.question(request) if store else b""
    profiles: list[Profile] = []
    reused = 0
    for k, stub in enumerate(stubs):  # in turn: concurrent profiles would time each other
        known = store.get(names[k], question) if store else None
        if known is not None:
            profiles.append(known)
            reused += 1
            continue
        reply = stub.Profile(request, timeout=timeout)
        log.info("worker %d profiled %d layers with %d torch threads", k, len(reply.layers),
                 reply.torch_threads)
        profiles.append(profile_from_proto(reply))
        if store:
            store.put(names[k], question, profiles[-1])
    return median_profile(profiles), relative_speeds(profiles), reused
