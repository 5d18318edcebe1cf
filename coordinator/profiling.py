"""Asks workers to profile a job's layers, and converts profiles to and from messages.

The one place where `pipefb.costs.Profile` meets `worker_pb2` (request, reply, and their
fields); the worker's servicer uses the same functions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pipefb.config import JobConfig
from pipefb.costs import LayerProfile, Profile
from pipefb.errors import ConfigError
from pipefb.profiler import REPEATS, WARMUP, median_profile, relative_speeds
from protos import worker_pb2, worker_pb2_grpc
from protos.convert import job_from_proto, job_to_proto

log = logging.getLogger(__name__)

PROFILE_TIMEOUT_SECONDS = 600.0  # one worker's whole profile (tracing included)


@dataclass(frozen=True)
class ProfileQuery:
    """What a Profile request asks: the arguments of `pipefb.profiler.measure_profile`."""

    job: JobConfig
    microbatch_size: int
    layers: range | None = None  # None: time every layer
    warmup: int = WARMUP
    repeats: int = REPEATS

    def to_proto(self) -> worker_pb2.ProfileRequest:
        """The ProfileRequest message."""
        request = worker_pb2.ProfileRequest(job=job_to_proto(self.job),
                                            microbatch_size=self.microbatch_size,
                                            warmup=self.warmup, repeats=self.repeats)
        if self.layers is not None:
            if self.layers.step != 1:
                raise ConfigError(f"layers {self.layers!r} must be a range of step 1")
            request.layers.start, request.layers.stop = self.layers.start, self.layers.stop
        return request

    @classmethod
    def from_proto(cls, request: worker_pb2.ProfileRequest) -> ProfileQuery:
        """Decodes a ProfileRequest (ConfigError naming a bad job field); the values are
        checked by `measure_profile`."""
        layers = (range(request.layers.start, request.layers.stop)
                  if request.HasField("layers") else None)
        return cls(job=job_from_proto(request.job), microbatch_size=request.microbatch_size,
                   layers=layers,
                   warmup=request.warmup if request.HasField("warmup") else WARMUP,
                   repeats=request.repeats if request.HasField("repeats") else REPEATS)


def profile_to_proto(profile: Profile, torch_threads: int) -> worker_pb2.ProfileReply:
    """A profile as the ProfileReply message, with the thread count it was timed with."""
    return worker_pb2.ProfileReply(
        microbatch_size=profile.microbatch_size,
        layers=[_layer_to_proto(x) for x in profile.layers],
        optimizer_seconds_per_byte=profile.optimizer_seconds_per_byte,
        optimizer_state_ratio=profile.optimizer_state_ratio, source=profile.source,
        torch_threads=torch_threads)


def profile_from_proto(reply: worker_pb2.ProfileReply) -> Profile:
    """A ProfileReply as a Profile (ConfigError on a negative or missing value)."""
    return Profile(
        microbatch_size=reply.microbatch_size,
        layers=tuple(_layer_from_proto(x) for x in reply.layers),
        optimizer_seconds_per_byte=reply.optimizer_seconds_per_byte,
        optimizer_state_ratio=reply.optimizer_state_ratio, source=reply.source)


def _layer_to_proto(x: LayerProfile) -> worker_pb2.LayerProfile:
    return worker_pb2.LayerProfile(
        name=x.name, forward_seconds=x.forward_seconds, backward_seconds=x.backward_seconds,
        input_bytes=x.input_bytes, output_bytes=x.output_bytes, saved_bytes=x.saved_bytes,
        param_bytes=x.param_bytes, forward_fixed_seconds=x.forward_fixed_seconds,
        backward_fixed_seconds=x.backward_fixed_seconds)


def _layer_from_proto(x: worker_pb2.LayerProfile) -> LayerProfile:
    return LayerProfile(
        name=x.name, forward_seconds=x.forward_seconds, backward_seconds=x.backward_seconds,
        input_bytes=x.input_bytes, output_bytes=x.output_bytes, saved_bytes=x.saved_bytes,
        param_bytes=x.param_bytes, forward_fixed_seconds=x.forward_fixed_seconds,
        backward_fixed_seconds=x.backward_fixed_seconds)


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
        warmup: untimed runs before the timed ones.
        repeats: timed runs per time (their median).
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
