"""The stage runtime: interprets one rank's action list for a step; knows nothing of gRPC.

Every schedule kind runs through the same interpreter: one handler per action kind, no
hand-written loop per schedule. The runtime holds the layers of its forward stage and/or
backward stage, their explicit forward/backward splits, the gradient buffers, the
optimizer (backward and combined ranks) and the current weight version.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import cast

import torch

from pipefb.codec import raw_view
from pipefb.errors import CodecError, ConfigError
from pipefb.job.config import JobConfig, build_layers, job_device, slowdowns
from pipefb.job.data import build_dataset
from pipefb.job.optim import build_optimizer, optimizer_state_bytes
from pipefb.job.shapes import TensorSpec, infer_input_specs, output_spec, spec_of
from pipefb.memory import (
    DeviceMemory,
    MemoryAccount,
    Storage,
    storage_bytes,
    storages,
    tensor_bytes,
)
from pipefb.plan.plan import Plan, recompute_runs, schedule_for
from pipefb.runtime.allreduce import Reducer
from pipefb.runtime.checkpoint import (
    Part,
    due,
    layer_of,
    load_optimizer,
    load_rank,
    optimizer_share,
    optimizer_tensors,
    save_rank,
)
from pipefb.runtime.execs import AutogradExec, LayerExec, Saved, SplitExec
from pipefb.runtime.layersplit import DeferredGrads
from pipefb.runtime.transport import Transport
from pipefb.runtime.versions import WeightVersions
from pipefb.schedule import Action, Kind, iteration
from pipefb.seeding import derive_seed, seed_random_ops

COMPUTE = frozenset({Kind.F, Kind.B, Kind.OPT})
WAITS = frozenset({Kind.RECV_F, Kind.RECV_B, Kind.RECV_L, Kind.FETCH, Kind.RECV_W})


@dataclass
class StepResult:
    """What a rank did in one iteration of the step loop (see [Note: lead])."""

    step: int
    losses: list[float]  # per micro-batch of `step`, on the rank that computes the loss
    compute_seconds: float
    idle_seconds: float
    memory_bytes: dict[str, int]  # by kind at the step's peak
    peak_memory_bytes: int
    bytes_sent: int
    bytes_stashed: int
    weight_version: int
    action_seconds: dict[str, float]  # by action kind: F, B, OPT, RECV_F, FETCH, ...
    spans: list[tuple[str, float, float]]  # (action, wall-clock start, end) in order
    versions: list[tuple[str, int, int]]  # (F or B action, training step, weight version)
    kept_versions: list[int]  # old weight versions held after the step
    kind_peak_bytes: dict[str, int]  # each kind's own peak during the step
    activation_peak_bytes: int  # peak of activations + stashed during the step
    device_memory_bytes: dict[str, int]  # CUDA allocator statistics (DeviceMemory); {} on cpu
    samples: int  # samples this rank's F (B on a backward rank) actions processed
    phase_seconds: list[tuple[str, float]]  # (forward|backward|recompute, seconds) per action
    weights_digest: str = ""  # several groups: digest of the owned weights after the step
    layer_seconds: dict[int, float] = field(default_factory=dict)  # per layer (`replan`)


# Keys of in-flight tensors: (training step, stage, micro-batch) or (step, micro-batch, layer).
Key = tuple[int, int, int]


class _Saved(dict[Key, dict[str, torch.Tensor]]):
    """Saved tensors kept for a later backward, by (step, micro-batch, layer), with the
    storages of each entry noted when it is stored (see `pipefb.memory.storages`).

    Entries are only stored (`[key] = ...`) and taken (`pop`); a stored dict is not changed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[Key, list[Storage]] = {}

    def __setitem__(self, key: Key, stash: dict[str, torch.Tensor]) -> None:
        super().__setitem__(key, stash)
        self.storages[key] = storages(stash.values())

    def pop(self, key: Key) -> dict[str, torch.Tensor]:  # type: ignore[override]
        del self.storages[key]
        return super().pop(key)


@dataclass
class _InFlight:
    """Tensors between actions; they outlive an iteration when an action leads (PipeDream)."""

    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    saved: _Saved = field(default_factory=_Saved)  # (step, mb, layer)
    grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    losses: dict[tuple[int, int], float] = field(default_factory=dict)
    forward_version: dict[Key, int] = field(default_factory=dict)  # combined ranks
    stashed_here: set[tuple[int, int]] = field(default_factory=set)  # (step, mb) in the store
    # (step, mb) -> layer -> the weight-grad half of its backward, oldest first ([Note:
    # input grads first]); changed through `defer` and `undefer` only
    deferred: dict[tuple[int, int], dict[int, DeferredGrads]] = field(default_factory=dict)
    _deferred_storages: dict[tuple[int, int], list[Storage]] = field(default_factory=dict)

    def live(self) -> list[torch.Tensor]:
        return [*self.inputs.values(), *self.outputs.values(), *self.grads.values(),
                *self.input_grads.values()]

    def defer(self, key: tuple[int, int], halves: dict[int, DeferredGrads]) -> None:
        """Keeps a micro-batch's waiting weight halves, noting their storages once (as
        `_Saved` does)."""
        self.deferred[key] = halves
        self._deferred_storages[key] = storages(t for d in halves.values() for t in d.args)

    def undefer(self) -> dict[int, DeferredGrads]:
        """Takes the oldest micro-batch's waiting weight halves."""
        key = next(iter(self.deferred))
        del self._deferred_storages[key]
        return self.deferred.pop(key)

    def held(self) -> list[Storage]:
        """Storages of the saved tensors, and of the waiting weight halves' arguments."""
        return [found for stashes in (self.saved.storages, self._deferred_storages)
                for stash in stashes.values() for found in stash]


@dataclass
class _Iteration:
    """Timings and tags of one iteration."""

    step: int
    compute: float = 0.0
    idle: float = 0.0
    by_kind: dict[str, float] = field(default_factory=dict)
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    versions: list[tuple[str, int, int]] = field(default_factory=list)
    stashed: int = 0
    samples: int = 0
    phases: list[tuple[str, float]] = field(default_factory=list)
    recompute: float = 0.0  # seconds re-running forwards inside B actions so far


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """CRC-32 of the tensors' names and bytes in name order: equal across groups when their
    copies of a stage are bit-identical.

    A consistency check, not a security one: it runs on the step's critical path, and
    CRC-32 takes 0.5 ms over the 3.4 MB of a 512-wide `mlp` here, BLAKE2b 2.4 ms (checked
    every step, BLAKE2b cost a fifth of that model's 2-group step)."""
    crc = 0
    for name, tensor in sorted(weights.items()):
        crc = zlib.crc32(raw_view(tensor)[2], zlib.crc32(name.encode(), crc))
    return f"{crc:08x}"


class StageRuntime:
    """One rank of a job: its layers, splits, optimizer and action interpreter."""

    def __init__(self, job: JobConfig, plan: Plan, rank: int, transport: Transport,
                 reducer: Reducer | None = None) -> None:
        self.job, self.plan, self.rank, self.transport = job, plan, rank, transport
        self._slowdown = slowdowns(job.slowdown).get(rank, (1.0, 0))  # fault injection
        self._layer_slowdown = slowdowns(job.slowdown, layers=True)
        self._time_layers = job.replan  # the re-planner reads per-layer seconds
        self._layer_seconds: dict[int, float] = {}  # this step's, while it runs
        self._in_layers = 0.0  # seconds the running action spent in `_timed_layer` bodies
        self.reducer = reducer  # sums gradients across groups; None with one group
        self.group = plan.group_of(rank)
        # [Note: groups] group g runs micro-batches g*M .. (g+1)*M - 1 of the step (M per
        # group): data, random seeds and stash keys use that global index.
        self.mb_offset = self.group * plan.microbatches
        self.topology = plan.topology(self.group)
        if rank not in self.topology.workers():
            raise ConfigError(f"rank {rank} has no stage in the plan "
                              f"(ranks {sorted(self.topology.workers())})")
        self.actions: list[Action] = schedule_for(plan)[rank]
        #: forward stages whose outputs an action of this rank sends (SEND_F, SEND_L); a
        #: combined last stage's output (the loss) goes nowhere, so it is not kept
        self._sent_outputs = {a.stage for a in self.actions
                              if a.kind in (Kind.SEND_F, Kind.SEND_L)}
        self.fwd_stage = _stage_of(self.topology.forward_workers, rank)
        self.bwd_stage = _stage_of(self.topology.backward_workers, rank)
        self.fwd_layers = (self.topology.layers_of_forward(self.fwd_stage)
                           if self.fwd_stage is not None else range(0))
        self.bwd_layers = (self.topology.layers_of_backward(self.bwd_stage)
                           if self.bwd_stage is not None else range(0))
        self.device = job_device(job)
        all_layers = build_layers(job)  # on the cpu until the held ones move
        self.n_layers = len(all_layers)
        self.dataset = build_dataset(job.dataset, job.dataset_config, job.seed)
        specs = self._layer_specs(all_layers)
        held = sorted(set(self.fwd_layers) | set(self.bwd_layers))
        self.layers = {i: all_layers[i].to(self.device) for i in held}
        self.n_inputs = {i: len(specs[i]) for i in held}
        # [Note: input grads first]: micro-batches whose weight grads may wait, the flush
        self._defer = self.bwd_stage if self.bwd_stage and plan.mode == "sync" else 0
        self._last_b = next((_mb(a) for a in reversed(self.actions) if a.kind is Kind.B), None)
        self.execs = {i: self._executor(i, self.layers[i], specs[i]) for i in held}
        self.run_start = recompute_runs(plan)
        self._stash_layers = self._stored_layers(self.fwd_layers)  # constant per rank
        self._fetch_names = {i: self.stash_names(i) for i in self._stored_layers(self.bwd_layers)}
        self.receives = self._receive_specs(specs, output_spec(all_layers[-1], specs[-1]))
        self.max_receive_bytes = max((s.nbytes for named in self.receives.values()
                                      for s in named.values()), default=0)
        self._owned = self._owned_params()
        # the largest tensor a migrating peer may send: a parameter or its optimizer state
        self.max_state_bytes = max((p.numel() * p.element_size() for layer in self.layers.values()
                                    for p in layer.parameters()), default=0) + 8
        self.optimizer = (
            build_optimizer(job.optimizer, self._owned, job.lr, job.optimizer_config)
            if self._owned else None  # a stage of parameter-free layers has nothing to update
        )
        self.version = 0
        self.versions = WeightVersions()
        self._eval_weights: dict[int, dict[str, torch.Tensor]] = {}  # version -> owned weights
        self._eval_bytes = 0  # of `_eval_weights`, updated where it changes
        self.flight = _InFlight()
        self.memory = MemoryAccount()
        self.device_memory = DeviceMemory(self.device)
        params = [p for layer in self.layers.values() for p in layer.parameters()]
        self.param_bytes = tensor_bytes(params)
        self._param_storage = {p.untyped_storage().data_ptr() for p in params}
        self._grad_bytes = self._optimizer_bytes = 0  # updated where they change
        # the action that counts a micro-batch's samples: each is counted once per rank
        self._sample_kind = Kind.F if self.fwd_stage is not None else Kind.B
        self._handlers: dict[Kind, Callable[[Action, int, _Iteration], None]] = {
            Kind.F: self._forward, Kind.B: self._backward, Kind.OPT: self._optimizer_step,
            Kind.SEND_F: self._send_activation, Kind.RECV_F: self._recv_activation,
            Kind.SEND_L: self._send_loss, Kind.RECV_L: self._recv_loss,
            Kind.SEND_B: self._send_grad, Kind.RECV_B: self._recv_grad,
            Kind.STASH: self._stash, Kind.FETCH: self._fetch,
            Kind.PUSH_W: self._push_weights, Kind.RECV_W: self._recv_weights,
        }
        self._account()

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
        """Autograd where saved tensors stay here, the weights never change under them and
        no weight grad waits; the split everywhere else (see [Note: two executors] in
        pipefb.runtime.execs)."""
        needs = _needs_grad(i, specs)
        if (self.role == "combined" and self.plan.policy[i] == "keep"
                and self.plan.mode == "sync" and not self._defer):
            return AutogradExec(layer, needs)
        return SplitExec(layer, specs, needs, self.device)

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

    def stash_names(self, layer: int) -> list[str]:
        """What layer `layer` saves per micro-batch for its backward (see `_forward`)."""
        if self.plan.policy[layer] != "recompute":
            return self.execs[layer].stash_names
        if self.run_start[layer] != layer:
            return []
        return [f"input_{j}" for j in range(self.n_inputs[layer])]

    # -- the interpreter -------------------------------------------------------------------

    def _factor(self, step: int, layer: int | None = None) -> float:
        """Fault injection (the job's `slowdown`): how many times as long compute takes at
        `step` on this rank, as on a slower or shared device, times, for `layer`, that
        layer's own factor, as when its input grew (1: not slowed)."""
        factor, start = self._slowdown
        rank = factor if step >= start else 1.0
        if layer is None:
            return rank
        factor, start = self._layer_slowdown.get(layer, (1.0, 0))
        return rank * (factor if step >= start else 1.0)

    @contextmanager
    def _timed_layer(self, step: int, layer: int) -> Iterator[None]:
        """Runs the body (a layer's forward or backward), stretches it by `_factor` and,
        for the re-planner, adds its seconds to the layer's."""
        factor = self._factor(step, layer)
        if not self._time_layers and factor == 1.0:
            yield
            return
        started = time.perf_counter()
        yield
        self.device_memory.synchronize()
        if factor > 1.0:
            time.sleep((factor - 1.0) * (time.perf_counter() - started))
        elapsed = time.perf_counter() - started
        self._in_layers += elapsed
        if self._time_layers:
            self._layer_seconds[layer] = self._layer_seconds.get(layer, 0.0) + elapsed

    def _slow_rest(self, step: int, seconds: float) -> None:
        """Stretches the part of a compute action outside its layers (the optimizer step)
        by the rank's `_factor`; the layers were stretched as they ran."""
        factor = self._factor(step)
        if factor > 1.0:
            time.sleep((factor - 1.0) * seconds)

    def run_step(self, step: int) -> StepResult:
        """Runs iteration `step` of this rank's action list and reports what it did."""
        it = _Iteration(step)
        self._layer_seconds = {}
        self.memory.reset_peak()
        self.device_memory.reset_peak()
        todo = iteration(self.actions, step, self.job.steps)
        for index, (at, action) in enumerate(todo):
            wall, started, recomputed = time.time(), time.perf_counter(), it.recompute
            self._in_layers = 0.0
            self._handlers[action.kind](action, at, it)
            if action.kind in COMPUTE:
                self.device_memory.synchronize()  # time the kernels, not their launch
                self._slow_rest(at, time.perf_counter() - started - self._in_layers)
            if action.kind is Kind.FETCH and self.role == "combined":
                self._prefetch_next(todo, index)
            elapsed = time.perf_counter() - started
            self._count_phase(action.kind, elapsed, it.recompute - recomputed, it)
            label = str(Action(action.stage, action.kind, action.microbatch, at - step))
            it.spans.append((label, wall, wall + elapsed))
            it.by_kind[action.kind] = it.by_kind.get(action.kind, 0.0) + elapsed
            if action.kind in COMPUTE:
                it.compute += elapsed
            elif action.kind in WAITS:
                it.idle += elapsed
            self._account()
        sent = self.transport.flush()
        losses = sorted((m, v) for (t, m), v in self.flight.losses.items() if t == step)
        for m, _ in losses:
            del self.flight.losses[(step, m)]
        return StepResult(
            step=step,
            losses=[v for _, v in losses],
            compute_seconds=it.compute,
            idle_seconds=it.idle,
            memory_bytes=dict(self.memory.peak),
            peak_memory_bytes=self.memory.peak_total,
            bytes_sent=sent,
            bytes_stashed=it.stashed,
            weight_version=self.version,
            action_seconds={str(k): v for k, v in it.by_kind.items()},
            spans=it.spans,
            versions=it.versions,
            kept_versions=self.versions.versions(),
            kind_peak_bytes=dict(self.memory.peak_each),
            activation_peak_bytes=self.memory.peak_activation,
            device_memory_bytes=self.device_memory.snapshot(),
            samples=it.samples,
            phase_seconds=it.phases,
            weights_digest=self.weights_digest() if self._check_groups(step) else "",
            layer_seconds=dict(self._layer_seconds),
        )

    def _count_phase(self, kind: Kind, elapsed: float, recompute: float, it: _Iteration
                     ) -> None:
        """Records an F or B action's compute phases (a B's recompute apart) and samples."""
        if kind is self._sample_kind:
            it.samples += self.plan.microbatch_size
        if kind is Kind.F:
            it.phases.append(("forward", elapsed))
        elif kind is Kind.B:
            it.phases.append(("backward", elapsed - recompute))
            if recompute:
                it.phases.append(("recompute", recompute))

    def _account(self) -> None:
        seen: set[int] = set()
        stashed = storage_bytes(self.flight.held(), exclude=self._param_storage, seen=seen)
        self.memory.set({
            "parameters": self.param_bytes,
            "gradients": self._grad_bytes,
            "optimizer_state": self._optimizer_bytes,
            "weight_versions": self.versions.nbytes + self._eval_bytes,
            "stashed": stashed,
            "activations": tensor_bytes(self.flight.live(), seen=seen),
        })

    # -- compute ---------------------------------------------------------------------------

    def _forward(self, action: Action, step: int, it: _Iteration) -> None:
        """Runs the stage's layers; each layer's saved tensors follow its policy.

        keep and offload save what the layer's backward needs (STASH moves the offloaded
        ones to the store); recompute saves only the inputs of the first layer of a run.
        """
        m = _mb(action)
        x, targets = self._stage_input(action.stage, m, step)
        for i in self.fwd_layers:
            inputs = [x, targets] if i == self.n_layers - 1 and targets is not None else [x]
            x, stash = self._run_layer(i, step, m, inputs, None)
            if self.plan.policy[i] == "recompute":
                stash = ({f"input_{j}": t for j, t in enumerate(inputs)}
                         if self.run_start[i] == i else {})
            if stash:
                self.flight.saved[(step, m, i)] = stash
        if self.fwd_layers and self.fwd_layers[-1] == self.n_layers - 1:
            self.flight.losses[(step, m)] = float(x)
        if action.stage in self._sent_outputs:
            self.flight.outputs[(step, action.stage, m)] = x
        if self.role == "combined":
            self.flight.forward_version[(step, action.stage, m)] = self.version
        it.versions.append((str(action.base), step, self.version))

    def _run_layer(self, i: int, step: int, m: int, inputs: list[torch.Tensor],
                   params: list[torch.Tensor] | None) -> tuple[torch.Tensor, Saved]:
        if self.execs[i].has_random_ops:
            seed_random_ops(derive_seed(self.job.seed, step, self.mb_offset + m, i))
        with self._timed_layer(step, i):
            return self.execs[i].forward(inputs, params)

    def _stage_input(self, stage: int, m: int, step: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        needs_data = stage == 0 or self.fwd_layers[-1] == self.n_layers - 1
        inputs, targets = self._microbatch(step, m) if needs_data else (None, None)
        x = inputs if stage == 0 else self.flight.inputs.pop((step, stage, m))
        assert x is not None  # stage 0 always has data
        return x, targets

    def _microbatch(self, step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch m of `step` (inputs, targets) on this rank's device."""
        x, y = self.dataset.microbatch(step, self.mb_offset + m, self.plan.microbatch_size)
        return x.to(self.device), y.to(self.device)

    def _forward_version(self, step: int, stage: int, m: int) -> int:
        """The weight version the forward of (step, m) used: what its stash is keyed by and
        what its backward computes with. A combined rank recorded it; on split ranks it is
        step - staleness (at least 0), the version RECV_W installed."""
        if self.role == "combined":
            return self.flight.forward_version[(step, stage, m)]
        return self._split_version(step)

    def _split_version(self, step: int) -> int:
        """The weight version a split rank's forward of `step` uses: step - staleness (at
        least 0)."""
        return max(0, step - self.plan.staleness)

    def _params(self, version: int, layer: int) -> list[torch.Tensor] | None:
        """A layer's parameters at `version`; None for the live (newest) ones."""
        return None if version == self.version else self.versions.params(version, layer)

    def _backward(self, action: Action, step: int, it: _Iteration) -> None:
        """Runs the stage's layers backward, last to first, accumulating weight grads.

        [Note: input grads first] The previous stage waits for this stage's input
        gradient, never for its weight gradients. So a rank of backward stage s > 0 (sync
        modes) runs each layer's input-grad half first (`LayerSplit.backward_input`; the
        halves give bit for bit the whole backward's grads), sends the gradient at once
        (its SEND_B then finds it gone), and lets the weight-grad halves of up to s
        micro-batches wait: each B then runs the halves of the oldest beyond s, and the
        rank's last B of a step runs every one left, before OPT. The previous stage gets
        its gradients a weight-grad time sooner; the waiting halves run where this rank
        would otherwise idle (the 1F1B drain). This is ZB-H1's idea (Qi et al., "Zero
        Bubble Pipeline Parallelism", 2024) kept inside 1F1B's order; s bounds the
        micro-batches a stage holds tensors for by the p that stage 0 holds in 1F1B, so the
        pipeline's largest activation peak stays 1F1B's.
        """
        m = _mb(action)
        version = self._forward_version(step, action.stage, m)
        last = len(self.topology.backward_workers) - 1
        grad: torch.Tensor | None
        if action.stage == last:
            # d(mean over the step's micro-batches, every group's)
            grad = torch.full((), 1.0 / (self.plan.microbatches * self.plan.groups),
                              device=self.device)
        else:
            grad = self.flight.grads.pop((step, action.stage, m))
        recomputed: dict[int, dict[str, torch.Tensor]] = {}
        deferred: dict[int, DeferredGrads] = {}
        for i in reversed(self.bwd_layers):
            assert grad is not None  # only the model's first layer (data input) gets no grad
            if self.plan.policy[i] == "recompute":
                if i not in recomputed:
                    started = time.perf_counter()
                    recomputed.update(self._recompute(step, m, i, version))
                    it.recompute += time.perf_counter() - started
                saved = recomputed.pop(i)
            else:
                saved = self.flight.saved.pop((step, m, i))
            execute, params = self.execs[i], self._params(version, i)
            with self._timed_layer(step, i):
                if self._defer and isinstance(execute, SplitExec):
                    grads, deferred[i] = execute.backward_input(saved, grad, params)
                else:
                    grads = execute.backward(saved, grad, params)
            grad = grads[0]
        if grad is not None and action.stage > 0:
            self.flight.input_grads[(step, action.stage, m)] = grad
            if deferred:
                self._send_grad(Action(action.stage, Kind.SEND_B, m), step, it)
        if deferred:
            self.flight.defer((step, m), deferred)
        self._run_deferred(step, keep=0 if m == self._last_b else self._defer)
        it.versions.append((str(action.base), step, version))
        if self.role == "combined":
            del self.flight.forward_version[(step, action.stage, m)]
            self.versions.prune(self.flight.forward_version.values())

    def _run_deferred(self, step: int, keep: int) -> None:
        """Runs the oldest waiting weight-grad halves until `keep` micro-batches' wait."""
        while len(self.flight.deferred) > keep:
            for i, deferred in self.flight.undefer().items():
                with self._timed_layer(step, i):
                    cast(SplitExec, self.execs[i]).backward_weights(deferred)
        self._grad_bytes = tensor_bytes(p.grad for p in self._owned if p.grad is not None)

    def _recompute(self, step: int, m: int, end: int, version: int
                   ) -> dict[int, dict[str, torch.Tensor]]:
        """Re-runs the forward of the recomputed run ending at layer `end` from its saved
        inputs, with the forward's weight version and random seeds; returns each layer's
        saved tensors."""
        start = self.run_start[end]
        saved = self.flight.saved.pop((step, m, start))
        inputs = [saved[f"input_{j}"] for j in range(self.n_inputs[start])]
        out: dict[int, dict[str, torch.Tensor]] = {}
        for i in range(start, end + 1):
            x, out[i] = self._run_layer(i, step, m, inputs, self._params(version, i))
            inputs = [x]
            if i + 1 == self.n_layers - 1:  # the loss layer also takes the targets
                inputs.append(self._microbatch(step, m)[1])
        return out

    def _optimizer_step(self, action: Action, step: int, it: _Iteration) -> None:
        self._run_deferred(step, keep=0)  # the last B ran them; OPT needs every grad
        needed = self._versions_needed_after(step)
        if self.version in needed:
            self.versions.keep(self.version, {i: self.layers[i] for i in self.bwd_layers})
        if self.optimizer is not None:  # None: the stage owns no parameters
            if self.reducer is not None:
                self._sum_gradients_across_groups(self.reducer)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._optimizer_bytes = optimizer_state_bytes(self.optimizer)
        for i in self.bwd_layers:
            self.execs[i].weights_changed()
        self._grad_bytes = 0
        self.version += 1
        self.versions.prune(needed)
        every = self.job.eval_every
        if every and self.version % every == 0 and self.version < self.job.steps:
            self._eval_weights[self.version] = {k: v.clone()
                                                for k, v in self.owned_weights().items()}
            self._eval_bytes = self._kept_eval_bytes()

    def _sum_gradients_across_groups(self, reducer: Reducer) -> None:
        """Every group's copy of this stage ends with the step's whole gradient (a parameter
        no micro-batch touched contributes zeros)."""
        for p in self._owned:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        reducer.sum_([p.grad for p in self._owned if p.grad is not None])

    def _versions_needed_after(self, step: int) -> set[int]:
        """Weight versions some backward after step `step`'s OPT will still use."""
        if self.role == "combined":
            return set(self.flight.forward_version.values())
        lag = self.plan.staleness
        return {max(0, t - lag) for t in range(step + 1, min(self.job.steps, step + lag + 1))}

    # -- communication ---------------------------------------------------------------------

    def _send_activation(self, action: Action, step: int, it: _Iteration) -> None:
        m = _mb(action)
        dst = self.topology.forward_workers[action.stage + 1]
        out = self.flight.outputs.pop((step, action.stage, m))
        self.transport.send(Kind.RECV_F, dst, step, action.stage + 1, m, self.version,
                            {"x": out})

    def _recv_activation(self, action: Action, step: int, it: _Iteration) -> None:
        m = _mb(action)
        got = self.transport.recv(Kind.RECV_F, step, action.stage, m)
        self.flight.inputs[(step, action.stage, m)] = got["x"].to(self.device)

    def _send_loss(self, action: Action, step: int, it: _Iteration) -> None:
        m = _mb(action)
        last = len(self.topology.backward_workers) - 1
        loss = self.flight.outputs.pop((step, action.stage, m))
        self.transport.send(Kind.RECV_L, self.topology.backward_workers[last], step, last,
                            m, self.version, {"loss": loss})

    def _recv_loss(self, action: Action, step: int, it: _Iteration) -> None:
        self.transport.recv(Kind.RECV_L, step, action.stage, _mb(action))

    def _send_grad(self, action: Action, step: int, it: _Iteration) -> None:
        m = _mb(action)
        dst = self.topology.backward_workers[action.stage - 1]
        grad = self.flight.input_grads.pop((step, action.stage, m), None)
        if grad is None:
            return  # its B sent it already ([Note: input grads first])
        self.transport.send(Kind.RECV_B, dst, step, action.stage - 1, m, self.version,
                            {"g": grad})

    def _recv_grad(self, action: Action, step: int, it: _Iteration) -> None:
        m = _mb(action)
        got = self.transport.recv(Kind.RECV_B, step, action.stage, m)
        self.flight.grads[(step, action.stage, m)] = got["g"].to(self.device)

    def _stored_layers(self, layers: range) -> list[int]:
        """Layers whose saved tensors go through the offload store (all on split ranks)."""
        split = self.role != "combined"
        return [i for i in layers if self.stash_names(i)
                and (split or self.plan.policy[i] == "offload")]

    def _stash(self, action: Action, step: int, it: _Iteration) -> None:
        m = _mb(action)
        tensors = {i: self.flight.saved.pop((step, m, i)) for i in self._stash_layers}
        version = self._forward_version(step, action.stage, m)
        it.stashed += self.transport.stash(step, self.mb_offset + m, version, tensors)
        self.flight.stashed_here.add((step, m))

    def _fetch(self, action: Action, step: int, it: _Iteration) -> None:
        m = _mb(action)
        version = self._forward_version(step, action.stage, m)
        got = self.transport.fetch(step, self.mb_offset + m, version, self._fetch_names)
        for i, stash in got.items():
            self.flight.saved[(step, m, i)] = {k: t.to(self.device) for k, t in stash.items()}
        self.flight.stashed_here.discard((step, m))

    def _prefetch_next(self, todo: list[tuple[int, Action]], index: int) -> None:
        """Starts fetching the next FETCH's tensors while this backward runs, when they
        are already in the store (a combined rank stashed them itself)."""
        nxt = next(((t, a) for t, a in islice(todo, index + 1, None) if a.kind is Kind.FETCH),
                   None)
        if nxt is not None and (nxt[0], _mb(nxt[1])) in self.flight.stashed_here:
            step, action = nxt
            m = _mb(action)
            version = self._forward_version(step, action.stage, m)
            self.transport.prefetch(step, self.mb_offset + m, version, self._fetch_names)

    def _push_weights(self, action: Action, step: int, it: _Iteration) -> None:
        if self.version + self.plan.staleness >= self.job.steps:
            return  # no forward step uses this version
        for fwd_stage in self.topology.forward_stages_overlapping(action.stage):
            layers = set(self.topology.layers_of_forward(fwd_stage)) & set(self.bwd_layers)
            tensors = {f"{i}.{name}": p.detach() for i in sorted(layers)
                       for name, p in self.layers[i].named_parameters()}
            if not tensors:
                continue  # those layers hold no parameters: their forward never waits for one
            self.transport.push_weights(self.topology.forward_workers[fwd_stage], self.version,
                                        tensors)
        if self.plan.mode == "sync":  # the next backward runs with these weights: derive
            for i in self.bwd_layers:  # now, while the forward ranks compute its stash
                self.execs[i].prepare()

    def _recv_weights(self, action: Action, step: int, it: _Iteration) -> None:
        """Installs the version step `step`'s forward uses: step - staleness (at least 0)."""
        version = self._split_version(step)
        if version <= self.version:
            return  # version 0: initial weights, identical everywhere by construction
        got = self.transport.wait_weights(version, self._param_names(self.fwd_layers))
        with torch.no_grad():
            for i in self.fwd_layers:
                for name, p in self.layers[i].named_parameters():
                    p.copy_(got[f"{i}.{name}"])
                self.execs[i].weights_changed()
        self.version = version

    # -- weights ---------------------------------------------------------------------------

    def owned_weights(self) -> dict[str, torch.Tensor]:
        """The weights this rank owns (its backward layers), named `layers.{i}.{param}`."""
        return self._weights_of(self.bwd_layers)

    def _weights_of(self, layers: Iterable[int]) -> dict[str, torch.Tensor]:
        """The weights of `layers`, named `layers.{i}.{param}` as in rank files."""
        return {f"layers.{i}.{name}": p.detach()
                for i in layers for name, p in self.layers[i].named_parameters()}

    def _param_names(self, layers: Iterable[int]) -> list[str]:
        """`{layer}.{param}` of every parameter of `layers`, in order (for the owned
        layers, the optimizer's order)."""
        return [f"{i}.{n}" for i in layers for n, _ in self.layers[i].named_parameters()]

    def _owned_names(self) -> list[str]:
        """`{layer}.{param}` of every owned parameter, in the optimizer's order."""
        return self._param_names(self.bwd_layers)

    def save_checkpoint(self, path: Path) -> None:
        """Writes the owned weights and optimizer state (`pipefb.runtime.checkpoint.save_rank`)."""
        save_rank(path, self.owned_weights(), self.optimizer, self._owned_names())

    def layer_state(self, layers: Iterable[int], optimizer_layers: Iterable[int]
                    ) -> dict[str, torch.Tensor]:
        """What a migration moves off this rank: the weights of `layers` and the optimizer
        state of `optimizer_layers`, each owned here, named as in a rank file.

        Raises:
            ConfigError: a layer this rank does not own.
        """
        wanted, optim = set(layers), set(optimizer_layers)
        foreign = sorted((wanted | optim) - set(self.bwd_layers))
        if foreign:
            raise ConfigError(f"layers {foreign} are not owned by rank {self.rank} "
                              f"(it owns {list(self.bwd_layers)})")
        out = self._weights_of(sorted(wanted))
        if self.optimizer is not None and optim:
            state, _ = optimizer_tensors(self.optimizer, self._owned_names())
            out.update({k: v for k, v in state.items() if layer_of(k)[0] in optim})
        return out

    def pending_weights(self, step: int) -> dict[str, torch.Tensor]:
        """A forward rank's weights of the version step `step` uses, `layers.i.p`: the
        pushed version waiting in its inbox, or the installed one if it is that version
        (a migration keeps a forward layer that stays on this rank from here)."""
        version = self._split_version(step)
        if version <= self.version:
            return self._weights_of(self.fwd_layers)
        got = self.transport.wait_weights(version, self._param_names(self.fwd_layers))
        return {f"layers.{k}": v for k, v in got.items()}

    def restore(self, files: Mapping[int, Path], step: int) -> None:
        """Resumes at `step` from a checkpoint's rank files (rank -> file): the weights
        of every layer held here and the optimizer state of every layer owned here,
        whichever rank saved them (the checkpoint's partition may differ from this one).

        Raises:
            ConfigError: a held weight is missing or has another shape or dtype.
        """
        order = sorted(files, key=lambda r: r != self.rank)  # its own file first
        self.restore_parts([load_rank(files[rank]) for rank in order], step,
                           f"checkpoint of step {step}")

    def restore_parts(self, parts: Sequence[Part], step: int, source: str) -> None:
        """Resumes at `step` from parts of the job's state, each (weights `layers.i.p`,
        optimizer tensors `optimizer.i.p.key`, metadata with the param groups) as a rank
        file or a migrating peer gives them; the first part with param groups gives the
        optimizer's hyper-parameters, else this rank's own optimizer does.

        Raises:
            ConfigError: a held weight is missing from every part, or has another shape
                or dtype (the message names `source`).
        """
        weights: dict[str, torch.Tensor] = {}
        states: list[tuple[dict[str, torch.Tensor], dict[str, str]]] = []
        for got, optim, meta in parts:
            weights.update(got)
            states.append((optim, meta))
        with torch.no_grad():
            for i, layer in self.layers.items():
                for name, p in layer.named_parameters():
                    saved = weights.get(f"layers.{i}.{name}")
                    if saved is None or saved.shape != p.shape or saved.dtype != p.dtype:
                        raise ConfigError(f"{source} has no weight layers.{i}.{name} "
                                          f"{list(p.shape)} {p.dtype}")
                    p.copy_(saved)
                self.execs[i].weights_changed()
        if self.optimizer is not None:
            names = self._owned_names()
            states.append(({}, optimizer_tensors(self.optimizer, names)[1]))  # groups last
            load_optimizer(self.optimizer, names, *optimizer_share(states, names))
            self._optimizer_bytes = optimizer_state_bytes(self.optimizer)
        self.version = step
        self._account()

    def _check_groups(self, step: int) -> bool:
        """Whether this step's reply carries `weights_digest`: with several groups, on the
        job's `check_groups_every` cadence."""
        return self.reducer is not None and due(step, self.job.check_groups_every,
                                                self.job.steps)

    def weights_digest(self) -> str:
        """`weights_digest` of the owned weights (the coordinator compares the groups')."""
        return weights_digest(self.owned_weights())

    def take_eval_weights(self, version: int) -> dict[str, torch.Tensor]:
        """The owned weights of `version`, kept after its OPT for evaluation (`eval_every`).

        Raises:
            KeyError: the version was not kept or was already taken.
        """
        if version not in self._eval_weights:
            raise KeyError(f"weight version {version} is not kept for evaluation "
                           f"(kept: {sorted(self._eval_weights)})")
        weights = self._eval_weights.pop(version)
        self._eval_bytes = self._kept_eval_bytes()
        return weights

    def _kept_eval_bytes(self) -> int:
        return tensor_bytes(t for kept in list(self._eval_weights.values())
                            for t in kept.values())


def _stage_of(workers: tuple[int, ...], rank: int) -> int | None:
    return workers.index(rank) if rank in workers else None


def _needs_grad(layer: int, specs: list[TensorSpec]) -> list[bool]:
    """Layer 0's input is data and a loss's targets are labels: neither needs a gradient."""
    return [layer > 0 and j == 0 and s.dtype.is_floating_point for j, s in enumerate(specs)]


def _mb(action: Action) -> int:
    assert action.microbatch is not None  # the validator guarantees it
    return action.microbatch
