"""The memory model: one rank's accounted bytes by kind, action by action."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipefb.memory import KINDS
from pipefb.schedule import Action, Kind
from pipefb.sim.costmodel import Costs, stage_of

if TYPE_CHECKING:
    from pipefb.sim.program import Op

# [Note: simulated memory]
# After every action the simulator sums, per worker, the same kinds the runtime accounts
# (`pipefb.memory.KINDS`) from the profile's bytes: parameters of the layers held;
# gradients of the owned layers from a step's first backward to its OPT; optimizer state
# (ratio x owned bytes); kept weight versions (PipeDream stashing, async PipeFB); in-flight
# activations (received inputs until F, outputs until sent, gradients likewise); stashed
# saved tensors (keep until B; offload until STASH and from FETCH to B; recompute: the
# input of each run); stashes handed to the copy lane until their write ends
# (`stash_in_flight`, [Note: copy lane] in pipefb.sim.copylane; none on a rank that copies
# on its compute lane, [Note: tier copies] in pipefb.sim.costmodel). Such a rank's slots in
# the node-local tier that no taken tensor views are `node_tier`, counted after each
# STASH and FETCH and, like the runtime's, left out of the rank's total
# (`pipefb.memory.OUTSIDE_TOTAL`; [Note: tier cap] in pipefb.sim.tierslots: a stash past
# the cap is in neither).


class RankMemory:
    """One rank's accounted bytes by kind, updated per action (see [Note: simulated memory])."""

    def __init__(self, costs: Costs, rank: int, staleness: int) -> None:
        t = costs.topology
        self.costs, self.staleness = costs, staleness
        self.fwd = stage_of(t.forward_workers, rank)
        self.bwd = stage_of(t.backward_workers, rank)
        held = set(t.layers_of_forward(self.fwd) if self.fwd is not None else ())
        owned = t.layers_of_backward(self.bwd) if self.bwd is not None else range(0)
        self.owned_bytes = costs.profile.param_bytes(owned)
        self.combined = self.fwd is not None and self.bwd is not None
        self.on_compute = rank in costs.on_compute  # [Note: tier copies] in pipefb.sim.costmodel
        self.now = dict.fromkeys(KINDS, 0)
        self.now["parameters"] = costs.profile.param_bytes(sorted(held | set(owned)))
        self.now["optimizer_state"] = round(costs.profile.optimizer_state_ratio
                                            * self.owned_bytes)
        self.total = sum(self.now.values())  # every kind but `node_tier` (0 here), kept by
        # `_set` and `apply`
        self.peak, self.at_peak = 0, dict(self.now)
        self.version = 0
        self.forward_versions: dict[tuple[int, int], int] = {}
        self.kept: set[int] = set()
        self.writing: list[tuple[float, int]] = []  # (end, bytes) of writes in flight
        self.tier_peak = 0  # the most `node_tier` bytes so far
        self._note()

    def deltas(self, a: Action) -> tuple[tuple[str, int], ...]:
        """What running `a` adds to each kind (gradients and versions aside)."""
        c, t = self.costs, self.costs.topology
        out: list[tuple[str, int]] = []
        if a.kind is Kind.RECV_F:
            out.append(("activations", c.boundary_bytes(t.forward_partition[a.stage])))
        elif a.kind is Kind.F:
            layers = t.layers_of_forward(a.stage)
            if a.stage > 0:
                out.append(("activations", -c.boundary_bytes(layers[0])))
            if a.stage < t.n_forward_stages - 1:
                out.append(("activations", c.boundary_bytes(layers[-1] + 1)))
            out.append(("stashed", sum(c.kept_bytes(i) for i in layers)))
        elif a.kind is Kind.SEND_F:
            out.append(("activations", -c.send_bytes(a)))
        elif a.kind is Kind.FETCH:
            out.append(("stashed", c.stash_bytes(a)))
        elif a.kind is Kind.STASH:
            out.append(("stashed", -c.stash_bytes(a)))
            if c.cluster.stash_in_flight_bytes and not self.on_compute:  # until its
                # write ends (`written`); none where the compute lane copies it
                out.append(("stash_in_flight", c.stash_bytes(a)))
        elif a.kind is Kind.RECV_B:
            out.append(("activations", c.boundary_bytes(t.backward_partition[a.stage + 1])))
        elif a.kind is Kind.B:
            layers = t.layers_of_backward(a.stage)
            out.append(("stashed", -sum(c.kept_bytes(i) for i in layers)))
            if a.stage < t.n_backward_stages - 1:
                out.append(("activations", -c.boundary_bytes(layers[-1] + 1)))
            if a.stage > 0:
                out.append(("activations", c.boundary_bytes(layers[0])))
        elif a.kind is Kind.SEND_B:
            out.append(("activations", -c.send_bytes(a)))
        return tuple(out)

    def _set(self, kind: str, nbytes: int) -> None:
        self.total += nbytes - self.now[kind]
        self.now[kind] = nbytes

    def _note(self) -> None:
        self._set("weight_versions", len(self.kept) * self.owned_bytes)
        self._peak()

    def _peak(self) -> None:
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.now)

    def in_tier(self, nbytes: int) -> None:
        """Sets the rank's `node_tier` bytes, outside its total ([Note: simulated
        memory])."""
        self.now["node_tier"] = nbytes
        self.tier_peak = max(self.tier_peak, nbytes)

    def written(self, end: float, nbytes: int) -> None:
        """Counts `nbytes` of a stash in flight until its write ends at `end` ([Note: copy
        lane] in pipefb.sim.copylane)."""
        self.writing.append((end, nbytes))

    def apply(self, step: int, op: Op, now: float = 0.0) -> None:
        """Runs the memory effect of one action of training step `step` ending at `now`,
        after the writes that ended by then left the in-flight bytes."""
        if self.writing:
            done = sum(n for end, n in self.writing if end <= now)
            if done:
                self.writing = [(end, n) for end, n in self.writing if end > now]
                self.now["stash_in_flight"] -= done
                self.total -= done
        for kind, delta in op.deltas:
            self.now[kind] += delta
            self.total += delta
        a = op.action
        if a.kind is Kind.B:
            self._set("gradients", self.owned_bytes)
            if self.combined:
                self.forward_versions.pop((step, op.microbatch), None)
                self.kept &= set(self.forward_versions.values())
            self._note()
        elif a.kind is Kind.OPT:
            self._optimizer(step)
            self._note()
        else:
            if a.kind is Kind.F and self.combined:
                self.forward_versions[(step, op.microbatch)] = self.version
            self._peak()  # the kept versions change only at a B or an OPT

    def _optimizer(self, step: int) -> None:
        if self.combined:
            needed = set(self.forward_versions.values())
        else:
            lag = self.staleness
            needed = {max(0, s - lag) for s in range(step + 1, step + lag + 1)}
        if self.version in needed:
            self.kept.add(self.version)
        self.version += 1
        self.kept &= needed
        self._set("gradients", 0)



__all__ = ["RankMemory"]
