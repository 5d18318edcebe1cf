"""What every probe shares: its settings, its job id and time limit, the error it raises,
and what a calibration found."""

from __future__ import annotations

from dataclasses import dataclass

from pipefb.sim.cluster import Link

JOB = "calibrate"  # job id of every probe transfer and stash key
HOST = "local"  # the one host of the local cluster
PROBE_TIMEOUT_S = 60.0  # a probe that does not come back within this has failed
MiB = 1 << 20


class CalibrationError(RuntimeError):
    """A probe that failed, or numbers no link can have (named in the message)."""


@dataclass(frozen=True)
class Settings:
    """Probe sizes and repeat counts (tests pass small ones)."""

    small_bytes: int = 1024  # tensor size of the latency probes
    large_bytes: int = 16 * MiB  # tensor size of the bandwidth probes
    small_repeats: int = 300  # latency probes per link (their mean counts)
    large_repeats: int = 20  # bandwidth probes per link
    warmup: int = 5  # probes of each size run first and not counted
    rpc_repeats: int = 100  # unary round trips for the step overhead
    step_calls: int = 300  # Step calls whose CPU (both ends) gives the step's CPU
    crowd_seconds: float = 3.0  # each run of the oversubscription probe
    busy_bytes: int = 64 * 1024  # tensor size of the busy-sender probes
    busy_repeats: int = 200  # busy-sender probes, and as many with an idle sender
    busy_seconds: float = 2e-3  # how long a busy sender computes after each send
    # how long a link sits idle before each probe: past the knee where an idle link's
    # transfers slow down ([Note: idle links] in calibration.links)
    idle_gap: float = 5e-3
    steps: int = 20  # runtime steps for the action and step overheads


@dataclass(frozen=True)
class Measured:
    """What one calibration found; a cluster of any size is built from it."""

    network: Link  # worker to worker, one way
    store: Link  # one stash or fetch of one worker
    action_overhead: float  # seconds per action outside its handler
    step_overhead: float  # seconds per step and worker outside its actions
    step_cpu: float = 0.0  # CPU seconds of one Step call, the coordinator's and worker's end
    oversubscribed: float = 1.0  # the cores' speed with twice as many busy threads
    busy_send: float = 0.0  # how much later a send followed by compute starts
    local_tier: Link | None = None  # one put or take of a private rank's node-local tier
    shared_tier: Link | None = None  # one put or take of a stash two ranks share in the tier


DEFAULTS = Settings()  # the settings of a real calibration
