"""Processor sharing: the jobs that a shared host's cores run at once, and their pace."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipefb.sim.cluster import MIN_OVERSUBSCRIBED

# [Note: shared hosts]
# A host with fewer cores than workers, or a loopback host (`Cluster.loopback_hosts`: one
# machine whose workers talk over loopback gRPC and a local store), is simulated with
# processor sharing, as an OS schedules threads: every busy action of its workers is a
# job, and n jobs each progress at min(1, cores / n). On a loopback host a transfer
# between two of its workers is a job too, the link's whole time (latency plus bytes over
# bandwidth): copying and (de)serialising the bytes, and waking the threads that hand them
# on, all need a core, so a hop on a busy host takes longer (the calibration's latency is
# of a link idle before the hop, [Note: idle links] in calibration.links). Both ends
# work at once, so a transfer keeps `Link.cpu` cores busy for its time, not one: a second
# job of (cpu - 1) times the work runs beside it, and a STASH or FETCH on a loopback host
# gets one for the local Redis's share (`store.cpu`); the calibration measures both as
# the CPU of both processes over the wall time. Events then run in time order
# (`Engine.run` in pipefb.sim.engine); otherwise every rank runs ahead as far as its
# inputs allow (same times, faster).
#
# [Note: oversubscribed cores]
# With more busy threads than cores, the OS switches between them and each switch refills
# the caches, so the cores do less work in all: a host's `oversubscribed` speed (measured
# by the calibration) is what is left with twice as many threads as cores, and the rate
# of n > cores jobs falls linearly in between and beyond,
# (1 - (1 - oversubscribed) (n - cores) / cores), no lower than `MIN_OVERSUBSCRIBED`.

_EPSILON = 1e-12  # seconds of work left that count as none


@dataclass(slots=True)
class Job:
    """Work left on a shared host (seconds at full speed) and what to do when it ends."""

    work: float
    on_finish: Callable[[float], None]


class Host:
    """Processor sharing on a host's cores: each of its n running jobs (one thread each)
    progresses at min(1, cores / n) seconds of work per second, times the speed left to
    oversubscribed cores ([Note: oversubscribed cores])."""

    def __init__(self, cores: int, oversubscribed: float = 1.0) -> None:
        self.cores, self.oversubscribed = cores, oversubscribed
        self.jobs: list[Job] = []
        self.clock = 0.0
        self.version = 0  # bumped when the running set changes: older finish events are void

    def rate(self) -> float:
        """Seconds of work each running job does per second now."""
        n = len(self.jobs)
        if n <= self.cores:
            return 1.0
        lost = (1.0 - self.oversubscribed) * (n - self.cores) / self.cores
        return self.cores / n * max(MIN_OVERSUBSCRIBED, 1.0 - lost)

    def advance(self, t: float) -> None:
        """Runs the jobs until `t`."""
        if t > self.clock and self.jobs:
            done = (t - self.clock) * self.rate()
            for job in self.jobs:
                job.work -= done
        self.clock = max(self.clock, t)

    def next_finish(self) -> float:
        """When the first running job ends if the running set stays as it is."""
        return self.clock + min(job.work for job in self.jobs) / self.rate()

    def finished(self) -> list[Callable[[float], None]]:
        """Removes and returns the callbacks of the jobs with no work left."""
        done = [job for job in self.jobs if job.work <= _EPSILON]
        self.jobs = [job for job in self.jobs if job.work > _EPSILON]
        return [job.on_finish for job in done]



__all__ = ["Host", "Job"]
