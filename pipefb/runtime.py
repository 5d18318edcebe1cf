"""The stage runtime: interprets one rank's action list for a step; knows nothing of gRPC.

Every schedule kind runs through the same interpreter: one handler per action kind, no
hand-written loop per schedule. The runtime holds the layers of its forward stage and/or
backward stage, their explicit forward/backward splits, the gradient buffers, the
optimizer (backward and combined ranks) and the current weight version.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipefb.config import JobConfig, build_layers
from pipefb.data import build_dataset
from pipefb.errors import CodecError, ConfigError
from pipefb.execs import AutogradExec, LayerExec, SplitExec
from pipefb.memory import MemoryAccount, tensor_bytes
from pipefb.optim import build_optimizer, optimizer_state_bytes
from pipefb.plan import Plan, schedule_for
from pipefb.schedule import Action, Kind
from pipefb.seeding import derive_seed, seed_random_ops
from pipefb.shapes import TensorSpec, infer_input_specs, output_spec, spec_of
from pipefb.transport import Transport

COMPUTE = frozenset({Kind.F, Kind.B, Kind.OPT})
WAITS = frozenset({Kind.RECV_F, Kind.RECV_B, Kind.RECV_L, Kind.FETCH, Kind.RECV_W})


@dataclass
class StepResult:
    """What a rank did in one step."""

    step: int
    losses: list[float]  # per micro-batch, on the rank that computes the loss
    compute_seconds: float
    idle_seconds: float
    memory_bytes: dict[str, int]  # by kind at the step's peak
    peak_memory_bytes: int
    bytes_sent: int
    bytes_stashed: int
    weight_version: int
    action_seconds: dict[str, float]  # by action kind: F, B, OPT, RECV_F, FETCH, ...
    spans: list[tuple[str, float, float]]  # (action, wall-clock start, end) in order


@dataclass
class _StepState:
    """Tensors in flight during one step, keyed by (stage, microbatch) or (microbatch, layer)."""

    step: int
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    saved: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    compute: float = 0.0
    idle: float = 0.0
    by_kind: dict[str, float] = field(default_factory=dict)
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    stashed: int = 0

    def live_tensors(self) -> list[torch.Tensor]:
        found = [*self.inputs.values(), *self.outputs.values(), *self.grads.values(),
                 *self.input_grads.values()]
        for stash in self.saved.values():
            found.extend(stash.values())
        return found


class StageRuntime:
    """One rank of a job: its layers, splits, optimizer and action interpreter."""

    def __init__(self, job: JobConfig, plan: Plan, rank: int, transport: Transport) -> None:
        self.job, self.plan, self.rank, self.transport = job, plan, rank, transport
        self.topology = plan.topology()
        if rank not in self.topology.workers():
            raise ConfigError(f"rank {rank} has no stage in the plan "
                              f"(ranks {sorted(self.topology.workers())})")
        self.actions: list[Action] = schedule_for(plan)[rank]
        self.fwd_stage = _stage_of(self.topology.forward_workers, rank)
        self.bwd_stage = _stage_of(self.topology.backward_workers, rank)
        self.fwd_layers = (self.topology.layers_of_forward(self.fwd_stage)
                           if self.fwd_stage is not None else range(0))
        self.bwd_layers = (self.topology.layers_of_backward(self.bwd_stage)
                           if self.bwd_stage is not None else range(0))
        all_layers = build_layers(job)
        self.n_layers = len(all_layers)
        self.dataset = build_dataset(job.dataset, job.dataset_config, job.seed)
        specs = self._layer_specs(all_layers)
        held = sorted(set(self.fwd_layers) | set(self.bwd_layers))
        self.layers = {i: all_layers[i] for i in held}
        self.execs = {i: self._executor(i, all_layers[i], specs[i]) for i in held}
        self.receives = self._receive_specs(specs, output_spec(all_layers[-1], specs[-1]))
        self.max_receive_bytes = max((s.nbytes for named in self.receives.values()
                                      for s in named.values()), default=0)
        self._owned = self._owned_params()
        self.optimizer = (
            build_optimizer(job.optimizer, self._owned, job.lr, job.optimizer_config)
            if self.bwd_layers else None
        )
        self.version = 0
        self.memory = MemoryAccount()
        params = [p for layer in self.layers.values() for p in layer.parameters()]
        self.param_bytes = tensor_bytes(params)
        self._param_storage = {p.untyped_storage().data_ptr() for p in params}
        self._grad_bytes = self._optimizer_bytes = 0  # updated where they change
        self._handlers: dict[Kind, Callable[[Action, _StepState], None]] = {
            Kind.F: self._forward, Kind.B: self._backward, Kind.OPT: self._optimizer_step,
            Kind.SEND_F: self._send_activation, Kind.RECV_F: self._recv_activation,
            Kind.SEND_L: self._send_loss, Kind.RECV_L: self._recv_loss,
            Kind.SEND_B: self._send_grad, Kind.RECV_B: self._recv_grad,
            Kind.STASH: self._stash, Kind.FETCH: self._fetch,
            Kind.PUSH_W: self._push_weights, Kind.RECV_W: self._recv_weights,
        }
        self._account(None)

    @property
    def role(self) -> str:
        """forward, backward or combined."""
        if self.fwd_stage is not None and self.bwd_stage is not None:
            return "combined"
        return "forward" if self.fwd_stage is not None else "backward"

    def _layer_specs(self, layers: list[torch.nn.Module]) -> list[list[TensorSpec]]:
        x, y = self.dataset.microbatch(0, 0, self.plan.microbatch_size)
        return infer_input_specs(layers, spec_of(x), spec_of(y))

    def _executor(self, i: int, layer: torch.nn.Module, specs: list[TensorSpec]) -> LayerExec:
        """Autograd where saved tensors stay here, the split where they travel (see
        [Note: two executors] in pipefb.execs)."""
        needs = _needs_grad(i, specs)
        if self.role == "combined" and self.plan.policy[i] == "keep":
            return AutogradExec(layer, needs)
        return SplitExec(layer, specs, needs)

    def _receive_specs(self, specs: list[list[TensorSpec]], loss: TensorSpec
                       ) -> dict[tuple[str, int], dict[str, TensorSpec]]:
        """What this rank may receive: (receive kind, stage) -> tensor name -> spec.

        [Note: receive window] in worker/service.py checks every transfer against it.
        """
        out: dict[tuple[str, int], dict[str, TensorSpec]] = {}
        last_bwd = len(self.topology.backward_workers) - 1
        if self.fwd_stage is not None and self.fwd_stage > 0:
            out[(Kind.RECV_F, self.fwd_stage)] = {"x": specs[self.fwd_layers[0]][0]}
        if self.bwd_stage is not None and self.bwd_stage < last_bwd:
            out[(Kind.RECV_B, self.bwd_stage)] = {"g": specs[self.bwd_layers[-1] + 1][0]}
        if self.role == "backward" and self.bwd_stage == last_bwd:
            out[(Kind.RECV_L, self.bwd_stage)] = {"loss": loss}
        if self.role == "forward":
            out[(Kind.RECV_W, 0)] = {f"{i}.{n}": spec_of(p) for i in self.fwd_layers
                                     for n, p in self.layers[i].named_parameters()}
        return out

    def check_received(self, kind: str, stage: int, tensors: dict[str, torch.Tensor]) -> None:
        """Refuses a transfer this rank does not expect, naming what is wrong.

        Weights may arrive in parts (one per overlapping backward stage); anything else
        must carry exactly the expected tensors.

        Raises:
            CodecError: an unexpected kind or stage, name, shape or dtype.
        """
        expected = self.receives.get((kind, stage))
        if expected is None:
            raise CodecError(f"rank {self.rank} receives no {kind} at stage {stage}")
        names = set(tensors)
        if names - set(expected) or (kind != Kind.RECV_W and names != set(expected)):
            raise CodecError(f"{kind} carries {sorted(names)}, expected {sorted(expected)}")
        for name, tensor in tensors.items():
            if not expected[name].matches(tensor):
                raise CodecError(f"{kind} tensor {name!r} is {list(tensor.shape)} "
                                 f"{tensor.dtype}, expected {expected[name]}")

    def _owned_params(self) -> list[torch.nn.Parameter]:
        return [p for i in self.bwd_layers for p in self.layers[i].parameters()]

    # -- the interpreter -------------------------------------------------------------------

    def run_step(self, step: int) -> StepResult:
        """Executes this rank's action list for `step` and reports what it did."""
        state = _StepState(step)
        self.memory.reset_peak()
        for action in self.actions:
            wall, started = time.time(), time.perf_counter()
            self._handlers[action.kind](action, state)
            elapsed = time.perf_counter() - started
            state.spans.append((str(action), wall, wall + elapsed))
            state.by_kind[action.kind] = state.by_kind.get(action.kind, 0.0) + elapsed
            if action.kind in COMPUTE:
                state.compute += elapsed
            elif action.kind in WAITS:
                state.idle += elapsed
            self._account(state)
        sent = self.transport.flush()
        return StepResult(
            step=step,
            losses=[state.losses[m] for m in sorted(state.losses)],
            compute_seconds=state.compute,
            idle_seconds=state.idle,
            memory_bytes=dict(self.memory.peak),
            peak_memory_bytes=self.memory.peak_total,
            bytes_sent=sent,
            bytes_stashed=state.stashed,
            weight_version=self.version,
            action_seconds={str(k): v for k, v in state.by_kind.items()},
            spans=state.spans,
        )

    def _account(self, state: _StepState | None) -> None:
        self.memory.set({
            "parameters": self.param_bytes,
            "gradients": self._grad_bytes,
            "optimizer_state": self._optimizer_bytes,
            "activations": (tensor_bytes(state.live_tensors(), exclude=self._param_storage)
                            if state else 0),
        })

    # -- compute ---------------------------------------------------------------------------

    def _forward(self, action: Action, state: _StepState) -> None:
        m = _mb(action)
        x, targets = self._stage_input(action.stage, m, state)
        for i in self.fwd_layers:
            if self.execs[i].has_random_ops:
                seed_random_ops(derive_seed(self.job.seed, state.step, m, i))
            if i == self.n_layers - 1:
                assert targets is not None  # the loss layer's rank always loads the data
                inputs = [x, targets]
            else:
                inputs = [x]
            x, stash = self.execs[i].forward(inputs)
            state.saved[(m, i)] = stash
        if self.fwd_layers and self.fwd_layers[-1] == self.n_layers - 1:
            state.losses[m] = float(x)
        state.outputs[(action.stage, m)] = x

    def _stage_input(self, stage: int, m: int, state: _StepState
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        needs_data = stage == 0 or self.fwd_layers[-1] == self.n_layers - 1
        inputs, targets = (self.dataset.microbatch(state.step, m, self.plan.microbatch_size)
                           if needs_data else (None, None))
        x = inputs if stage == 0 else state.inputs.pop((stage, m))
        assert x is not None  # stage 0 always has data
        return x, targets

    def _backward(self, action: Action, state: _StepState) -> None:
        m = _mb(action)
        last = len(self.topology.backward_workers) - 1
        grad: torch.Tensor | None
        if action.stage == last:
            grad = torch.full((), 1.0 / self.plan.microbatches)  # d(mean over micro-batches)
        else:
            grad = state.grads.pop((action.stage, m))
        for i in reversed(self.bwd_layers):
            assert grad is not None  # only the model's first layer (data input) gets no grad
            grad = self.execs[i].backward(state.saved.pop((m, i)), grad)[0]
        self._grad_bytes = tensor_bytes(p.grad for p in self._owned if p.grad is not None)
        if grad is not None and action.stage > 0:
            state.input_grads[(action.stage, m)] = grad

    def _optimizer_step(self, action: Action, state: _StepState) -> None:
        assert self.optimizer is not None  # OPT only on ranks owning weights
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for i in self.bwd_layers:
            self.execs[i].weights_changed()
        self._grad_bytes = 0
        self._optimizer_bytes = optimizer_state_bytes(self.optimizer)
        self.version += 1

    # -- communication ---------------------------------------------------------------------

    def _send_activation(self, action: Action, state: _StepState) -> None:
        m = _mb(action)
        dst = self.topology.forward_workers[action.stage + 1]
        out = state.outputs.pop((action.stage, m))
        self.transport.send(Kind.RECV_F, dst, state.step, action.stage + 1, m, self.version,
                            {"x": out})

    def _recv_activation(self, action: Action, state: _StepState) -> None:
        m = _mb(action)
        got = self.transport.recv(Kind.RECV_F, state.step, action.stage, m)
        state.inputs[(action.stage, m)] = got["x"]

    def _send_loss(self, action: Action, state: _StepState) -> None:
        m = _mb(action)
        last = len(self.topology.backward_workers) - 1
        loss = state.outputs.pop((action.stage, m))
        self.transport.send(Kind.RECV_L, self.topology.backward_workers[last], state.step, last,
                            m, self.version, {"loss": loss})

    def _recv_loss(self, action: Action, state: _StepState) -> None:
        self.transport.recv(Kind.RECV_L, state.step, action.stage, _mb(action))

    def _send_grad(self, action: Action, state: _StepState) -> None:
        m = _mb(action)
        dst = self.topology.backward_workers[action.stage - 1]
        grad = state.input_grads.pop((action.stage, m))
        self.transport.send(Kind.RECV_B, dst, state.step, action.stage - 1, m, self.version,
                            {"g": grad})

    def _recv_grad(self, action: Action, state: _StepState) -> None:
        m = _mb(action)
        got = self.transport.recv(Kind.RECV_B, state.step, action.stage, m)
        state.grads[(action.stage, m)] = got["g"]

    def _stash(self, action: Action, state: _StepState) -> None:
        m = _mb(action)
        tensors = {i: state.saved.pop((m, i)) for i in self.fwd_layers}
        state.stashed += self.transport.stash(state.step, m, self.version, tensors)

    def _fetch(self, action: Action, state: _StepState) -> None:
        m = _mb(action)
        names = {i: self.execs[i].stash_names for i in self.bwd_layers}
        got = self.transport.fetch(state.step, m, self.version, names)
        for i, stash in got.items():
            state.saved[(m, i)] = stash

    def _push_weights(self, action: Action, state: _StepState) -> None:
        for fwd_stage in self.topology.forward_stages_overlapping(action.stage):
            layers = set(self.topology.layers_of_forward(fwd_stage)) & set(self.bwd_layers)
            tensors = {f"{i}.{name}": p.detach() for i in sorted(layers)
                       for name, p in self.layers[i].named_parameters()}
            self.transport.push_weights(self.topology.forward_workers[fwd_stage], self.version,
                                        tensors)

    def _recv_weights(self, action: Action, state: _StepState) -> None:
        if state.step <= self.version:
            return  # step 0: initial weights, identical everywhere by construction
        names = [f"{i}.{n}" for i in self.fwd_layers for n, _ in self.layers[i].named_parameters()]
        got = self.transport.wait_weights(state.step, names)
        with torch.no_grad():
            for i in self.fwd_layers:
                for name, p in self.layers[i].named_parameters():
                    p.copy_(got[f"{i}.{name}"])
                self.execs[i].weights_changed()
        self.version = state.step

    # -- weights ---------------------------------------------------------------------------

    def owned_weights(self) -> dict[str, torch.Tensor]:
        """The weights this rank owns (its backward layers), named `layers.{i}.{param}`."""
        return {f"layers.{i}.{name}": p.detach()
                for i in self.bwd_layers for name, p in self.layers[i].named_parameters()}


def _stage_of(workers: tuple[int, ...], rank: int) -> int | None:
    return workers.index(rank) if rank in workers else None


def _needs_grad(layer: int, specs: list[TensorSpec]) -> list[bool]:
    """Layer 0's input is data and a loss's targets are labels: neither needs a gradient."""
    return [layer > 0 and j == 0 and s.dtype.is_floating_point for j, s in enumerate(specs)]


def _mb(action: Action) -> int:
    assert action.microbatch is not None  # the validator guarantees it
    return action.microbatch
