"""The schedule IR: action kinds, actions with a round-tripping string form, topologies."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from itertools import pairwise

from pipefb.errors import ScheduleError


class Kind(StrEnum):
    """What one action does; its value is the infix of the action's string form."""

    F = "F"  # forward of one stage for one micro-batch
    B = "B"  # backward of one stage (input grad + weight grad) for one micro-batch
    OPT = "OPT"  # optimizer step of one backward stage
    SEND_F = "SEND_F"  # send the stage's output activation to the next forward stage
    RECV_F = "RECV_F"  # receive the stage's input activation from the previous stage
    SEND_B = "SEND_B"  # send the stage's input gradient to the previous backward stage
    RECV_B = "RECV_B"  # receive the stage's output gradient from the next backward stage
    SEND_L = "SEND_L"  # last forward stage hands the loss to the last backward stage
    RECV_L = "RECV_L"  # last backward stage receives the loss: "forward done, start backward"
    STASH = "STASH"  # put the saved tensors of a forward into the offload store
    FETCH = "FETCH"  # take the saved tensors a backward needs from the offload store
    PUSH_W = "PUSH_W"  # backward stage sends its new weight version to forward workers
    RECV_W = "RECV_W"  # forward stage waits for the weights of the step's version


#: Kinds that act on one stage as a whole, never on one micro-batch.
STAGE_KINDS = frozenset({Kind.OPT, Kind.PUSH_W, Kind.RECV_W})
#: Kinds that run on the worker of a forward stage (the others run on a backward stage's).
FORWARD_KINDS = frozenset({Kind.F, Kind.SEND_F, Kind.RECV_F, Kind.SEND_L, Kind.STASH, Kind.RECV_W})
#: Kinds that make something another action waits for (non-blocking, buffered).
PRODUCER_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B, Kind.SEND_L, Kind.STASH, Kind.PUSH_W})
#: Kinds that only split topologies use (STASH and FETCH also serve `offload` on combined).
SPLIT_KINDS = frozenset({Kind.SEND_L, Kind.RECV_L, Kind.PUSH_W, Kind.RECV_W})
#: Kinds that may run one step early (`lead` 1): PipeDream's warm-up forwards.
LEAD_KINDS = frozenset({Kind.F, Kind.SEND_F, Kind.RECV_F, Kind.STASH})

# Longest names first so that "SEND_F" is never read as "S" + ... and "F" stays last.
_KIND_ALTERNATION = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"(\d+)({_KIND_ALTERNATION})(\d*)(?:\+(\d+))?")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one worker's list: `str(Action(1, Kind.F, 0)) == "1F0"`.

    [Note: lead] A worker's list is what it runs in iteration k of the step loop; an
    action with `lead` 1 belongs to training step k + 1 (PipeDream's warm-up forwards of
    the next step run before this step's optimizer): `str(Action(0, Kind.F, 1, lead=1))
    == "0F1+1"`. Iteration 0 first runs the lead actions for step 0 (the prologue), and
    the last iteration skips them (see `iteration`).

    Attributes:
        stage: forward stage for forward kinds, backward stage for backward kinds.
        kind: what the action does.
        microbatch: the micro-batch; None exactly for OPT, PUSH_W and RECV_W.
        lead: 0, or 1 for an action of the next training step (LEAD_KINDS only).
    """

    stage: int
    kind: Kind
    microbatch: int | None = None
    lead: int = 0

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ScheduleError(f"action stage must be >= 0, got {self.stage}")
        per_stage = self.kind in STAGE_KINDS
        if per_stage != (self.microbatch is None):
            need = "no micro-batch" if per_stage else "a micro-batch"
            raise ScheduleError(f"{self.kind} takes {need}, got microbatch={self.microbatch}")
        if self.microbatch is not None and self.microbatch < 0:
            raise ScheduleError(f"micro-batch must be >= 0, got {self.microbatch}")
        if self.lead not in (0, 1) or (self.lead and self.kind not in LEAD_KINDS):
            raise ScheduleError(f"{self.kind} cannot have lead {self.lead} "
                                f"(only {sorted(LEAD_KINDS)} may lead by 1)")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        lead = f"+{self.lead}" if self.lead else ""
        return f"{self.stage}{self.kind.value}{mb}{lead}"

    @property
    def base(self) -> Action:
        """The same action with lead 0: its identity within a training step."""
        return Action(self.stage, self.kind, self.microbatch) if self.lead else self

    @staticmethod
    def parse(text: str) -> Action:
        """Reads the string form back: `Action.parse("0SEND_F1") == Action(0, Kind.SEND_F, 1)`.

        Raises:
            ScheduleError: `text` is not exactly the string form of an action.
        """
        match = _ACTION_RE.fullmatch(text)
        if match is None:
            raise ScheduleError(f"not an action: {text!r}")
        stage, kind, mb, lead = match.groups()
        try:
            action = Action(int(stage), Kind(kind), int(mb) if mb else None,
                            int(lead) if lead else 0)
        except ScheduleError as err:
            raise ScheduleError(f"not an action: {text!r} ({err})") from None
        if str(action) != text:
            raise ScheduleError(f"not an action: {text!r} (canonical form is {action})")
        return action


#: Worker id -> that worker's actions for ONE iteration of the step loop, in order.
Schedule = dict[int, list[Action]]


def iteration(actions: list[Action], k: int, steps: int, start: int = 0
              ) -> list[tuple[int, Action]]:
    """What a worker runs in iteration `k` of a `steps`-step job that starts at step
    `start` (a resumed job's checkpoint step), as (training step, base action) pairs (see
    [Note: lead]): the prologue (step `start`'s lead actions) first in iteration `start`,
    and no action of a step >= `steps`."""
    prologue = [(k, a.base) for a in actions if a.lead] if k == start else []
    return prologue + [(k + a.lead, a.base) for a in actions if k + a.lead < steps]


def _check_partition(name: str, partition: tuple[int, ...]) -> None:
    if len(partition) < 2 or partition[0] != 0:
        raise ScheduleError(f"{name} must start at 0 and have >= 1 stage, got {partition}")
    for lo, hi in pairwise(partition):
        if hi <= lo:
            raise ScheduleError(f"{name} must be strictly increasing, got {partition}")


def _check_workers(name: str, workers: tuple[int, ...], n_stages: int) -> None:
    if len(workers) != n_stages:
        raise ScheduleError(f"{name} needs {n_stages} worker ids, got {workers}")
    if len(set(workers)) != len(workers) or min(workers) < 0:
        raise ScheduleError(f"{name} must be distinct ids >= 0, got {workers}")


@dataclass(frozen=True)
class Topology:
    """Where the layers of each stage live and which worker runs each stage.

    A topology is *combined* (classic pipeline: each worker runs forward and backward of
    one stage) when the workers and partitions of both passes are equal, and *split*
    (PipeFB) when no worker appears in both passes.

    Attributes:
        forward_partition: forward stage boundaries over layer indices, from 0 to n_layers.
        backward_partition: backward stage boundaries, same first and last value.
        forward_workers: worker id of each forward stage.
        backward_workers: worker id of each backward stage.
    """

    forward_partition: tuple[int, ...]
    backward_partition: tuple[int, ...]
    forward_workers: tuple[int, ...]
    backward_workers: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_partition("forward_partition", self.forward_partition)
        _check_partition("backward_partition", self.backward_partition)
        if self.forward_partition[-1] != self.backward_partition[-1]:
            raise ScheduleError(
                f"partitions cover different layers: {self.forward_partition} "
                f"vs {self.backward_partition}"
            )
        _check_workers("forward_workers", self.forward_workers, len(self.forward_partition) - 1)
        _check_workers("backward_workers", self.backward_workers, len(self.backward_partition) - 1)
        if not (self.is_combined or self.is_split):
            shared = sorted(set(self.forward_workers) & set(self.backward_workers))
            raise ScheduleError(
                f"topology is neither combined nor split: workers {shared} run both passes "
                "but workers or partitions differ"
            )

    @staticmethod
    def combined(partition: tuple[int, ...], workers: tuple[int, ...] | None = None) -> Topology:
        """A classic pipeline; workers default to 0..n_stages-1."""
        ids = tuple(range(len(partition) - 1)) if workers is None else workers
        return Topology(partition, partition, ids, ids)

    @cached_property
    def is_combined(self) -> bool:
        """Every worker runs the forward and backward of the same stage."""
        return (
            self.forward_workers == self.backward_workers
            and self.forward_partition == self.backward_partition
        )

    @cached_property
    def is_split(self) -> bool:
        """No worker runs both passes (PipeFB)."""
        return not set(self.forward_workers) & set(self.backward_workers)

    @property
    def n_layers(self) -> int:
        """Number of layers in the layer sequence, the loss layer included."""
        return self.forward_partition[-1]

    @property
    def n_forward_stages(self) -> int:
        """Number of forward stages."""
        return len(self.forward_partition) - 1

    @property
    def n_backward_stages(self) -> int:
        """Number of backward stages."""
        return len(self.backward_partition) - 1

    def layers_of_forward(self, stage: int) -> range:
        """Layer indices of forward stage `stage`."""
        return range(self.forward_partition[stage], self.forward_partition[stage + 1])

    def layers_of_backward(self, stage: int) -> range:
        """Layer indices of backward stage `stage`."""
        return range(self.backward_partition[stage], self.backward_partition[stage + 1])

    def forward_stages_overlapping(self, backward_stage: int) -> tuple[int, ...]:
        """Forward stages sharing at least one layer with `backward_stage`."""
        mine = self.layers_of_backward(backward_stage)
        return tuple(
            s for s in range(self.n_forward_stages) if _overlap(self.layers_of_forward(s), mine)
        )

    def backward_stages_overlapping(self, forward_stage: int) -> tuple[int, ...]:
        """Backward stages sharing at least one layer with `forward_stage`."""
        mine = self.layers_of_forward(forward_stage)
        return tuple(
            s for s in range(self.n_backward_stages) if _overlap(self.layers_of_backward(s), mine)
        )

    def workers(self) -> tuple[int, ...]:
        """All worker ids, sorted."""
        return tuple(sorted(set(self.forward_workers) | set(self.backward_workers)))

    def worker_of(self, action: Action) -> int:
        """The worker that must run `action` (forward kinds on forward workers).

        Raises:
            ScheduleError: the action's stage does not exist.
        """
        forward = action.kind in FORWARD_KINDS
        workers = self.forward_workers if forward else self.backward_workers
        if action.stage >= len(workers):
            side = "forward" if forward else "backward"
            raise ScheduleError(f"{action}: no {side} stage {action.stage}")
        return workers[action.stage]


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop
