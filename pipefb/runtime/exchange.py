"""The communication actions of a rank's list: activations, losses and gradients to and from
its peers, saved tensors to and from the offload store, and weight versions pushed from
backward to forward ranks. Each handler takes (action, training step, iteration)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pipefb.runtime.flight import InFlight
from pipefb.runtime.place import RankPlace
from pipefb.runtime.result import Iteration
from pipefb.runtime.state import RankState
from pipefb.runtime.transport import Transport
from pipefb.schedule import Action, Kind


class Exchange:
    """Moves one rank's tensors through its `Transport`, from and into its `InFlight`."""

    def __init__(self, transport: Transport, place: RankPlace, flight: InFlight,
                 state: RankState, device: torch.device, steps: int,
                 stash_layers: Sequence[int], fetch_names: Mapping[int, list[str]]) -> None:
        self.transport, self.place, self.flight, self.state = transport, place, flight, state
        self.device, self.steps = device, steps
        self.stash_layers = stash_layers  # layers whose saved tensors STASH puts in the store
        self.fetch_names = fetch_names  # layer -> names of the saved tensors FETCH takes
        self.back_to_back: set[tuple[int, int]] = set()  # [Note: back-to-back stash]

    def send_activation(self, action: Action, step: int, it: Iteration) -> None:
        m, stage = microbatch(action), action.stage
        dst = self.place.topology.forward_workers[stage + 1]
        out = self.flight.outputs.pop((step, stage, m))
        self.transport.send(Kind.RECV_F, dst, step, stage + 1, m, self.state.version,
                            {"x": out})

    def recv_activation(self, action: Action, step: int, it: Iteration) -> None:
        m = microbatch(action)
        got = self.transport.recv(Kind.RECV_F, step, action.stage, m)
        self.flight.inputs[(step, action.stage, m)] = got["x"].to(self.device)

    def send_loss(self, action: Action, step: int, it: Iteration) -> None:
        m = microbatch(action)
        workers = self.place.topology.backward_workers
        loss = self.flight.outputs.pop((step, action.stage, m))
        self.transport.send(Kind.RECV_L, workers[-1], step, len(workers) - 1, m,
                            self.state.version, {"loss": loss})

    def recv_loss(self, action: Action, step: int, it: Iteration) -> None:
        self.transport.recv(Kind.RECV_L, step, action.stage, microbatch(action))

    def send_grad(self, action: Action, step: int, it: Iteration) -> None:
        m, stage = microbatch(action), action.stage
        dst = self.place.topology.backward_workers[stage - 1]
        grad = self.flight.input_grads.pop((step, stage, m), None)
        if grad is None:
            return  # its B sent it already ([Note: input grads first] in docs/architecture.md)
        self.transport.send(Kind.RECV_B, dst, step, stage - 1, m, self.state.version,
                            {"g": grad})

    def recv_grad(self, action: Action, step: int, it: Iteration) -> None:
        m = microbatch(action)
        got = self.transport.recv(Kind.RECV_B, step, action.stage, m)
        self.flight.grads[(step, action.stage, m)] = got["g"].to(self.device)

    def _version(self, step: int, stage: int, m: int) -> int:
        return self.place.forward_version(self.flight.forward_version, step, stage, m)

    def skip_if_back_to_back(self, todo: list[tuple[int, Action]], index: int) -> None:
        """Marks the STASH at `index` to be skipped with its FETCH when that FETCH comes
        right after it.

        [Note: back-to-back stash] On a combined rank's last stage the lowering puts the
        FETCH of a micro-batch's stash right after its STASH (1F1B's and PipeDream's F
        then B). Nothing runs between them, so the round trip through the store would free
        no memory at any moment: the saved tensors stay where they are, counted as
        `stashed` as they always were up to the STASH.
        """
        step, action = todo[index]
        if index + 1 < len(todo):
            nxt_step, nxt = todo[index + 1]
            if (nxt.kind is Kind.FETCH and nxt_step == step and nxt.stage == action.stage
                    and nxt.microbatch == action.microbatch):
                self.back_to_back.add((step, microbatch(action)))

    def stash(self, action: Action, step: int, it: Iteration) -> None:
        m = microbatch(action)
        if (step, m) in self.back_to_back:
            return  # [Note: back-to-back stash]
        tensors = {i: self.flight.saved.pop((step, m, i)) for i in self.stash_layers}
        version = self._version(step, action.stage, m)
        it.stashed += self.transport.stash(step, self.place.mb_offset + m, version, tensors)
        self.flight.stashed_here.add((step, m))

    def fetch(self, action: Action, step: int, it: Iteration) -> None:
        m = microbatch(action)
        if (step, m) in self.back_to_back:
            self.back_to_back.discard((step, m))
            return  # the saved tensors never left ([Note: back-to-back stash])
        version = self._version(step, action.stage, m)
        got = self.transport.fetch(step, self.place.mb_offset + m, version, self.fetch_names)
        for i, stash in got.items():
            self.flight.saved[(step, m, i)] = {k: t.to(self.device) for k, t in stash.items()}
        self.flight.stashed_here.discard((step, m))

    def prefetch_next(self, todo: list[tuple[int, Action]], index: int) -> None:
        """Starts fetching the next FETCH's tensors while this backward runs: at once when
        this rank stashed them itself (a combined rank), else once the receive before that
        FETCH arrived (a backward rank: the forward rank's stash is in the store by then,
        [Note: transport ordering])."""
        at = next((j for j in range(index + 1, len(todo)) if todo[j][1].kind is Kind.FETCH),
                  None)
        if at is None:
            return
        step, action = todo[at]
        m = microbatch(action)
        after = None
        if (step, m) not in self.flight.stashed_here:
            if at == 0:
                return  # a backward rank's first FETCH waits for its receive
            before = todo[at - 1][1]
            if self.place.role != "backward" or before.kind not in (Kind.RECV_L, Kind.RECV_B):
                return
            after = (before.kind, todo[at - 1][0], before.stage, microbatch(before))
        version = self._version(step, action.stage, m)
        self.transport.prefetch(step, self.place.mb_offset + m, version, self.fetch_names,
                                after=after)

    def push_weights(self, action: Action, step: int, it: Iteration) -> None:
        if self.place.first_step_using(self.state.version) >= self.steps:
            return  # no forward step uses this version
        topology = self.place.topology
        for fwd_stage in topology.forward_stages_overlapping(action.stage):
            layers = set(topology.layers_of_forward(fwd_stage)) & set(self.place.bwd_layers)
            tensors = self.state.named_params(sorted(layers))
            if not tensors:
                continue  # those layers hold no parameters: their forward never waits for one
            self.transport.push_weights(topology.forward_workers[fwd_stage],
                                        self.state.version, tensors)
        if step + 1 < self.steps:  # derive the next step's backward versions (the live one;
            # async: kept ones too) now, while the forward ranks compute its stash
            last = self.place.microbatches - 1
            self.state.prepare({self.place.split_version(step + 1, m) for m in (0, last)})

    def recv_weights(self, action: Action, step: int, it: Iteration) -> None:
        """Installs the version step `step`'s first forward uses: step - staleness (at
        least 0)."""
        self.install_version(self.place.split_version(step))

    def install_version(self, version: int) -> bool:
        """Waits for weight `version` and installs it, unless it is installed already
        (later micro-batches of a step may run one version newer: [Note: micro-batch
        staleness] in pipefb.runtime.place); returns whether it installed one."""
        if version <= self.state.version:
            return False  # version 0: initial weights, identical everywhere by construction
        if version in self.state.versions.versions():  # a resumed rank's checkpoint copy
            self.state.install_kept(version)  # ([Note: resumed stale forwards])
            return True
        names = self.state.param_names(self.place.fwd_layers)
        self.state.install(version, self.transport.wait_weights(version, names))
        return True

    def pending_weights(self, step: int) -> dict[str, torch.Tensor]:
        """A forward rank's weights of the version step `step` uses, `layers.i.p`: the
        pushed version waiting in its inbox, or the installed one if it is that version
        (a migration keeps a forward layer that stays on this rank from here)."""
        version = self.place.split_version(step)
        if version <= self.state.version:
            return self.state.weights_of(self.place.fwd_layers)
        got = self.transport.wait_weights(version,
                                          self.state.param_names(self.place.fwd_layers))
        return {f"layers.{k}": v for k, v in got.items()}


def microbatch(action: Action) -> int:
    """The micro-batch of a compute or communication action."""
    assert action.microbatch is not None  # the validator guarantees it
    return action.microbatch
