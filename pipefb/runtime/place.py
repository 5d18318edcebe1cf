"""A rank's place in a plan: its group, its forward and/or backward stage and their
layers, its action list, and the weight version each of its forwards uses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipefb.errors import ConfigError
from pipefb.plan.plan import Plan, schedule_for
from pipefb.runtime.flight import Key
from pipefb.schedule import Action, Kind, Topology


@dataclass(frozen=True)
class RankPlace:
    """Where one rank stands in a plan (see `place`)."""

    rank: int
    group: int
    #: [Note: groups] group g runs micro-batches g*M .. (g+1)*M - 1 of the step (M per
    #: group): data, random seeds and stash keys use that global index.
    mb_offset: int
    topology: Topology
    actions: list[Action]
    fwd_stage: int | None
    bwd_stage: int | None
    fwd_layers: range
    bwd_layers: range
    staleness: int
    #: [Note: micro-batch staleness] the step's first micro-batches that run on version
    #: step - staleness; the rest run on step - staleness + 1 (all of them: PipeDream-2BW)
    stale_microbatches: int
    microbatches: int  # per step, of this rank's group
    #: forward stages whose outputs an action of this rank sends (SEND_F, SEND_L); a
    #: combined last stage's output (the loss) goes nowhere, so it is not kept
    sent_outputs: frozenset[int]
    #: [Note: input grads first] in docs/architecture.md: micro-batches whose weight grads
    #: may wait, and the micro-batch of the step's last B, which runs them all
    defer: int
    last_b: int | None

    @property
    def role(self) -> str:
        """forward, backward or combined."""
        if self.fwd_stage is not None and self.bwd_stage is not None:
            return "combined"
        return "forward" if self.fwd_stage is not None else "backward"

    @property
    def held(self) -> list[int]:
        """The layers this rank holds: those of its forward and its backward stage."""
        return sorted(set(self.fwd_layers) | set(self.bwd_layers))

    def split_version(self, step: int, m: int = 0) -> int:
        """The weight version a split rank's forward of micro-batch `m` of `step` uses:
        step - staleness, or step - staleness + 1 past the first `stale_microbatches`, at
        least 0.

        [Note: micro-batch staleness] PipeDream-2BW runs every micro-batch of step k on
        version k - 1, and that delay is what async training pays in loss. Letting only
        the step's first K micro-batches run on the older version, and the rest wait for
        the newest (which the backward ranks make once step k - 1's backwards end), keeps
        the overlap where it is: those first forwards run while the previous step drains,
        as PipeDream's own warm-up forwards do. K = all micro-batches is PipeDream-2BW's
        rule; the default is K = 1 on one pipeline group (`JobConfig.stale_microbatches`).
        The one-process reference (`SingleProcess`) runs the same versions, and the
        simulator the same waits (`pipefb.schedule.deps`).
        """
        fresh = self.staleness > 0 and m >= self.stale_microbatches
        return max(0, step - self.staleness + fresh)

    def versions_from(self, step: int, steps: int) -> set[int]:
        """The weight versions up to `step` that split ranks' forwards of steps `step` ..
        `steps` - 1 run on: after step `step` - 1's OPT made version `step`, the old ones
        among them are what the owners keep for those forwards' backwards, and what a
        checkpoint of step boundary `step` holds ([Note: resumed stale forwards] in
        pipefb.runtime.state)."""
        last = self.microbatches - 1
        return {v for t in range(step, min(steps, step + self.staleness + 1)) for m in (0, last)
                if (v := self.split_version(t, m)) <= step}

    def first_step_using(self, version: int) -> int:
        """The first step one of whose forwards uses weight `version` (split ranks)."""
        return version + self.staleness - (self.stale_microbatches < self.microbatches)

    def forward_version(self, recorded: Mapping[Key, int], step: int, stage: int, m: int
                        ) -> int:
        """The weight version the forward of (step, m) used: what its stash is keyed by and
        what its backward computes with. A combined rank recorded it in `recorded` (by
        (step, stage, m)); on split ranks it is `split_version`, the version RECV_W
        installed."""
        if self.role == "combined":
            return recorded[(step, stage, m)]
        return self.split_version(step, m)


def place(plan: Plan, rank: int, stale_microbatches: int = 0) -> RankPlace:
    """Rank `rank`'s place in `plan`; `stale_microbatches` as the job's
    (`JobConfig.stale_microbatches`), 0: all of them.

    Raises:
        ConfigError: the plan gives the rank no stage.
    """
    group = plan.group_of(rank)
    topology = plan.topology(group)
    if rank not in topology.workers():
        raise ConfigError(f"rank {rank} has no stage in the plan "
                          f"(ranks {sorted(topology.workers())})")
    actions = schedule_for(plan)[rank]
    fwd_stage = _stage_of(topology.forward_workers, rank)
    bwd_stage = _stage_of(topology.backward_workers, rank)
    return RankPlace(
        rank=rank, group=group, mb_offset=group * plan.microbatches, topology=topology,
        actions=actions, fwd_stage=fwd_stage, bwd_stage=bwd_stage,
        fwd_layers=(topology.layers_of_forward(fwd_stage) if fwd_stage is not None
                    else range(0)),
        bwd_layers=(topology.layers_of_backward(bwd_stage) if bwd_stage is not None
                    else range(0)),
        staleness=plan.staleness,
        stale_microbatches=stale_microbatches or plan.microbatches,
        microbatches=plan.microbatches,
        sent_outputs=frozenset(a.stage for a in actions if a.kind in (Kind.SEND_F, Kind.SEND_L)),
        defer=bwd_stage if bwd_stage and (plan.mode == "sync" or fwd_stage is None) else 0,
        last_b=next((a.microbatch for a in reversed(actions) if a.kind is Kind.B), None),
    )


def _stage_of(workers: tuple[int, ...], rank: int) -> int | None:
    return workers.index(rank) if rank in workers else None
