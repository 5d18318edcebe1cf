"""The schedule kinds registry: one record per kind holds everything decided by a kind.

Code elsewhere asks a kind's record (`schedule_kind`) instead of comparing names, so a new
kind is its generator module (`pipefb.schedule.generators`), one record in `_RECORDS`
below, and its golden file or test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pipefb.errors import ConfigError, ScheduleError
from pipefb.schedule.generators.common import combined_stages
from pipefb.schedule.generators.gpipe import gpipe
from pipefb.schedule.generators.one_f_one_b import one_f_one_b
from pipefb.schedule.generators.pipedream import pipedream
from pipefb.schedule.generators.pipefb import pipefb, split_stages
from pipefb.schedule.ir import Schedule, Topology

#: A compute-only schedule of one training step for a topology and micro-batch count.
Generator = Callable[[Topology, int], Schedule]


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule kind: how it generates actions and what it allows."""

    name: str  # what a job's `schedule` and a plan's `schedule` say
    generator: Generator | None  # None: the one-process reference, not a pipeline
    modes: tuple[str, ...]  # the modes it runs in (sync, async); the first is its default
    #: (forward stages, backward stages) it makes of W workers
    stage_counts: Callable[[int], tuple[int, int]] = combined_stages
    split: bool = False  # forward and backward stages on different workers (their roles
    # are forward and backward); False: each worker runs both passes of one stage
    default_policy: str = "keep"  # a layer's activation policy when the job names none
    stale: bool = False  # async mode runs the forward of step k on weight version
    # k - staleness (the job's staleness); False: a plan's staleness is 0

    @property
    def pipeline(self) -> bool:
        """Whether it runs on workers; the reference runs in the submitting process."""
        return self.generator is not None

    @property
    def separate_partitions(self) -> bool:
        """Whether the backward partition may differ from the forward one: only when
        different workers run the two passes (a combined worker runs both of its stage)."""
        return self.split

    @property
    def keep_allowed(self) -> bool:
        """Whether a layer may `keep` its saved tensors on the worker: only when that
        worker also runs the layer's backward."""
        return not self.split

    def plan_staleness(self, mode: str, staleness: int) -> int:
        """The staleness a plan of this kind runs with in `mode` for the job's `staleness`."""
        return staleness if self.stale and mode == "async" else 0


_RECORDS = (
    ScheduleKind("single", None, ("sync",)),  # the reference: one process, every layer
    ScheduleKind("gpipe", gpipe, ("sync",)),
    ScheduleKind("1f1b", one_f_one_b, ("sync",)),
    ScheduleKind("pipedream", pipedream, ("async",)),
    ScheduleKind("pipefb", pipefb, ("sync", "async"), split_stages, split=True,
                 default_policy="offload", stale=True),
)

#: Every kind by name, in the order the docs list them.
REGISTRY: Mapping[str, ScheduleKind] = MappingProxyType({k.name: k for k in _RECORDS})
#: What a job's `schedule` may name (besides `auto`): the reference first, then KINDS.
SCHEDULES = tuple(REGISTRY)
#: The pipeline kinds: what a plan may run and `generate` knows.
KINDS = tuple(name for name, kind in REGISTRY.items() if kind.pipeline)


def schedule_kind(name: str) -> ScheduleKind:
    """The record of kind `name`.

    Raises:
        ConfigError: no kind of that name.
    """
    kind = REGISTRY.get(name)
    if kind is None:
        raise ConfigError(f"unknown schedule kind {name!r}; known: {', '.join(SCHEDULES)}")
    return kind


def runs_in_process(name: str) -> bool:
    """Whether schedule `name` is the one-process reference (False for any other name)."""
    kind = REGISTRY.get(name)
    return kind is not None and not kind.pipeline


def generate(kind: str, topology: Topology, microbatches: int) -> Schedule:
    """Compute-only schedule of kind `kind` (one of `KINDS`).

    Raises:
        ScheduleError: unknown kind, or a topology the kind cannot run on.
    """
    record = REGISTRY.get(kind)
    if record is None or record.generator is None:
        raise ScheduleError(f"unknown schedule kind {kind!r}; known: {', '.join(KINDS)}")
    return record.generator(topology, microbatches)
