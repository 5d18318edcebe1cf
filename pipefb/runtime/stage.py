"""The stage runtime: interprets one rank's action list for a step; knows nothing of gRPC.

Every schedule kind runs through the same interpreter: one handler per action kind, no
hand-written loop per schedule. The compute handlers (F, B, OPT) are here; the
communication handlers are `Exchange`'s. The runtime holds the rank's place in the plan
(`RankPlace`), its state (`RankState`: the layers, their optimizer and weight versions),
the tensors in flight between its actions (`InFlight`) and the runner of its layers'
forwards (`LayerRunner`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import cast

import torch

from pipefb.errors import Aborted, ConfigError
from pipefb.job.config import JobConfig, build_layers, job_device
from pipefb.job.precision import autocast
from pipefb.job.shapes import (
    TensorSpec,
    output_spec,
    replays_statistics,
    spec_of,
    writes_its_input,
)
from pipefb.memory import DeviceMemory, MemoryAccount, storage_bytes, tensor_bytes
from pipefb.plan.plan import Plan
from pipefb.runtime.allreduce import Reducer
from pipefb.runtime.checkpoint import Digest, Part, due
from pipefb.runtime.clipping import GlobalNormClip, parameter_places
from pipefb.runtime.clock import LayerClock
from pipefb.runtime.exchange import Exchange, microbatch
from pipefb.runtime.execs import (
    AutogradExec,
    LayerExec,
    Saved,
    SplitExec,
    grad_flows,
    needs_grad,
    split_exec,
    trains,
)
from pipefb.runtime.flight import InFlight
from pipefb.runtime.groupstats import GroupStatistics, replays_on
from pipefb.runtime.inputs import MicroBatches
from pipefb.runtime.layersplit import DeferredGrads
from pipefb.runtime.lossscale import LossScale
from pipefb.runtime.place import place
from pipefb.runtime.receives import check_received, receive_specs
from pipefb.runtime.renorm import Renorms
from pipefb.runtime.result import COMPUTE, Iteration, StepResult
from pipefb.runtime.runner import LayerRunner
from pipefb.runtime.state import RankState
from pipefb.runtime.step_metrics import step_metrics
from pipefb.runtime.tied import TiedGrads, find_ties, secondary_names, tie_stages, untie
from pipefb.runtime.transport import Transport
from pipefb.schedule import Action, Kind, iteration

Handler = Callable[[Action, int, Iteration], None]


class StageRuntime:
    """One rank of a job: its place in the plan, its state and its action interpreter."""

    def __init__(self, job: JobConfig, plan: Plan, rank: int, transport: Transport,
                 reducer: Reducer | None = None, norm_reducer: Reducer | None = None
                 ) -> None:
        """Places rank `rank` in `plan` and builds its layers, executors and state.

        `reducer` sums the gradients of this stage across groups (None with one group);
        `norm_reducer`, with gradient clipping or fp16, sums over the weight owners of this
        rank's group ([Note: global norm], [Note: loss scaling]; None where one owner
        holds every stage).

        Raises:
            ConfigError: the plan gives `rank` no stage.
        """
        self.job, self.plan, self.rank, self.transport = job, plan, rank, transport
        # the rank's bytes in the node-local tier (memory kind `node_tier`); its host sets it
        self.node_tier_bytes: Callable[[], int] = _no_bytes
        self._node_tier = 0  # its last figure (see `_account`)
        self.reducer = reducer  # sums gradients across groups; None with one group
        self.norm_reducer = norm_reducer
        self.place = place(plan, rank, job.stale_microbatches())
        self.actions, self.topology = self.place.actions, self.place.topology
        self.fwd_layers, self.bwd_layers = self.place.fwd_layers, self.place.bwd_layers
        self.device = job_device(job)
        # the forwards' autocast ([Note: mixed precision] in pipefb.job.precision)
        self.autocast = partial(autocast, job.precision, self.device)
        self.device_memory = DeviceMemory(self.device)
        self.clock = LayerClock(job, rank, self.device_memory)
        self.stopped: str | None = None  # why the host stopped this rank's steps (`stop`)
        self.flight = InFlight()
        self.start = 0  # the step the run starts at: a resumed job's checkpoint step
        # (stage, micro-batch) of the forwards this rank runs ahead of the step boundary
        self.lead_forwards = {(a.stage, a.microbatch) for a in self.actions
                              if a.lead and a.kind is Kind.F}
        self._build()
        self.memory = MemoryAccount()
        # the action that counts a micro-batch's samples: each is counted once per rank
        self._sample_kind = Kind.F if self.place.fwd_stage is not None else Kind.B
        ex = self.exchange
        self._handlers: dict[Kind, Handler] = {
            Kind.F: self._forward, Kind.B: self._backward, Kind.OPT: self._optimizer_step,
            Kind.SEND_F: ex.send_activation, Kind.RECV_F: ex.recv_activation,
            Kind.SEND_L: ex.send_loss, Kind.RECV_L: ex.recv_loss,
            Kind.SEND_B: ex.send_grad, Kind.RECV_B: ex.recv_grad,
            Kind.STASH: ex.stash, Kind.FETCH: ex.fetch,
            Kind.PUSH_W: ex.push_weights, Kind.RECV_W: ex.recv_weights,
        }
        self._account()

    def _build(self) -> None:
        """Builds the held layers and their executors, the rank's state, the runner of its
        forwards, its exchange, and what it may receive."""
        all_layers = build_layers(self.job)  # on the cpu until the held ones move
        self.n_layers = len(all_layers)
        # [Note: tied parameters]: the model's order lists a tied parameter once, at its
        # first use; this rank's layers each get a copy of their own
        self.ties = find_ties(all_layers)
        self.places = parameter_places(all_layers)
        untie(dict(enumerate(all_layers)), self.ties)
        self.data = MicroBatches(self.job, self.plan.microbatch_size, self.place.mb_offset,
                                 self.device)
        with self.autocast():  # each layer's inputs in the dtypes autocast gives them
            specs = self.data.layer_specs(all_layers)
        self.specs = specs
        flows = grad_flows(all_layers)
        held = self.place.held
        layers = {i: all_layers[i].to(self.device) for i in held}
        # [Note: renormalised rows]: max_norm off here, applied in one process's order
        self.renorms = Renorms(layers, self.data, self.plan.microbatches * self.plan.groups)
        execs = {i: self._executor(i, layers[i], specs[i], flows[i]) for i in held}
        self.renorms.execs = execs
        self.runner = LayerRunner(self.plan, self.job.seed, execs,
                                  {i: len(specs[i]) for i in held}, self.n_layers, self.data,
                                  self.clock, fixed=set(self.renorms.norms))
        # [Note: group statistics]: every group's copy ends a step with one process's
        exact = replays_on(self.device, self.plan.mode, self.job.precision,
                           bool(self.lead_forwards))
        self.stats = GroupStatistics(
            layers, [i for i in self.fwd_layers if exact and replays_statistics(layers[i],
                                                                                specs[i])],
            self.plan.microbatches, self.plan.groups, self.place.mb_offset)
        # fp16: every owner's copy of the loss scale ([Note: loss scaling])
        scale = (LossScale(self.device, self.norm_reducer, self.job.initial_loss_scale,
                           growth_interval=self.job.loss_scale_window)
                 if self.job.precision == "fp16" and self.role != "forward" else None)
        self.state = RankState(self.job, self.rank, layers, execs, self.fwd_layers,
                               self.bwd_layers, scale)
        self.clip = self._clip(all_layers)
        self.tied = TiedGrads(self.ties, layers, self.bwd_layers, self.plan.microbatches,
                              self.device)
        self.state.summed_apart = {id(p) for p in self.tied.owned_copies()}
        self.exchange = Exchange(
            self.transport, self.place, self.flight, self.state, self.device, self.job.steps,
            self._stored_layers(self.fwd_layers),
            {i: self.runner.stash_names(i) for i in self._stored_layers(self.bwd_layers)})
        forward_params = {k: spec_of(p) for k, p in
                          self.state.named_params(self.fwd_layers).items()}
        with self.autocast():
            loss_spec = output_spec(all_layers[-1], specs[-1])
        self.loss_dtype = loss_spec.dtype
        self.receives = receive_specs(self.place, specs, loss_spec, forward_params)
        self.max_receive_bytes = max((s.nbytes for named in self.receives.values()
                                      for s in named.values()), default=0)

    def _clip(self, all_layers: Sequence[torch.nn.Module]) -> GlobalNormClip | None:
        """With `clip_grad_norm`, a weight owner's share of the global norm."""
        if not self.job.clip_grad_norm or self.role == "forward":
            return None
        places, copies = self.places, secondary_names(self.ties)
        dtype = next((p.dtype for layer in all_layers for p in layer.parameters()),
                     torch.get_default_dtype())
        return GlobalNormClip(self.job.clip_grad_norm,  # a tied copy counts at its first use
                              [-1 if name in copies else places[name]
                               for name in self.state.owned_names()],
                              len(places), dtype, self.device, self.norm_reducer)

    def tie_membership(self) -> tuple[int, int] | None:
        """(this rank's index, member count) in its group's exchange of tied gradients
        ([Note: tied parameters]); None where it owns no use or one stage owns them all."""
        stages = tie_stages(self.ties, self.plan.backward_partition)
        if self.place.bwd_stage not in stages or len(stages) < 2:
            return None
        return stages.index(self.place.bwd_stage), len(stages)

    def set_tie_reducer(self, reducer: Reducer) -> None:
        """The exchange of tied gradients among the stages that own a use."""
        self.tied.reducer = reducer

    @property
    def role(self) -> str:
        """forward, backward or combined."""
        return self.place.role

    def _executor(self, i: int, layer: torch.nn.Module, specs: list[TensorSpec], flows: bool
                  ) -> LayerExec:
        """None for a layer nothing differentiates; autograd where saved tensors stay here,
        the weights never change under them and no weight grad waits; the split everywhere
        else (see [Note: two executors] in pipefb.runtime.execs)."""
        needs = needs_grad(i, specs, flows)
        if (trains(layer, needs) and self.role == "combined" and self.plan.policy[i] == "keep"
                and self.plan.mode == "sync" and not self.place.defer):
            with self.autocast():
                copy = writes_its_input(layer, specs, needs)
            return AutogradExec(layer, needs, copy_inputs=copy, autocast=self.autocast)
        return split_exec(layer, specs, needs, self.device, self.autocast)

    def _stored_layers(self, layers: range) -> list[int]:
        """Layers whose saved tensors go through the offload store (all on split ranks)."""
        split = self.role != "combined"
        return [i for i in layers if self.runner.stash_names(i)
                and (split or self.plan.policy[i] == "offload")]

    def check_received(self, kind: str, stage: int, tensors: dict[str, torch.Tensor]) -> None:
        """Refuses a transfer this rank does not expect (`receives.check_received`).

        Raises:
            CodecError: an unexpected kind or stage, name, shape or dtype.
        """
        check_received(self.receives, self.rank, kind, stage, tensors)

    # -- the interpreter -------------------------------------------------------------------

    def run_step(self, step: int, checkpoint: bool = False) -> StepResult:
        """Runs iteration `step` of this rank's action list and reports what it did;
        `checkpoint`: the host saves a checkpoint of the boundary after it (by cadence or
        on request), which may need an old weight version kept ([Note: resumed leads])."""
        it = Iteration(step, checkpoint=checkpoint)
        self.clock.start_step()
        self.memory.reset_peak()
        self.device_memory.reset_peak()
        todo = iteration(self.actions, step, self.job.steps, self.start)
        self.exchange.prefetch_next(todo, -1)  # the step's first FETCH: a lead's stash
        for index in range(len(todo)):
            if self.stopped is not None:  # between actions: one micro-batch's compute at most
                raise Aborted(self.stopped)
            self._run_action(todo, index, it)
        self.stats.reduce_()  # [Note: group statistics] on a rank without OPT
        if self.role == "forward":  # its buffers, the model's, for version step + 1
            self.state.keep_for_eval(step + 1)
        return self._result(it, self.transport.flush())

    def stop(self, reason: str) -> None:
        """Stops the running step before its next action, and every later one, with
        Aborted(`reason`) (its caller gave up, [Note: callers that give up] in
        worker/caller.py); a waiting receive is ended by the host's transport."""
        self.stopped = reason

    def _run_action(self, todo: list[tuple[int, Action]], index: int, it: Iteration) -> None:
        """Runs action `index` of the iteration's (training step, action) list, timed."""
        at, action = todo[index]
        wall, started, recomputed = time.time(), time.perf_counter(), it.recompute
        self.clock.start_action()
        if action.kind is Kind.STASH:
            self.exchange.skip_if_back_to_back(todo, index)
        if action.kind is Kind.F and self.role == "forward" and self.exchange.install_version(
                self.place.split_version(at, microbatch(action))):
            # [Note: micro-batch staleness]: a later micro-batch may run one version newer;
            # the wait for it is timed as a RECV_W of its own, not as the F's compute
            elapsed = time.perf_counter() - started
            it.record(str(Action(action.stage, Kind.RECV_W)), Kind.RECV_W,
                      wall, elapsed)
            wall, started = wall + elapsed, started + elapsed
        self._handlers[action.kind](action, at, it)
        if action.kind in COMPUTE:
            self.device_memory.synchronize()  # time the kernels, not their launch
            self.clock.slow_rest(at, time.perf_counter() - started - self.clock.in_layers)
        if action.kind is Kind.FETCH:
            self.exchange.prefetch_next(todo, index)
        elapsed = time.perf_counter() - started
        if action.kind is self._sample_kind:
            it.samples += self.plan.microbatch_size
        it.record_phase(action.kind, elapsed, it.recompute - recomputed)
        label = str(Action(action.stage, action.kind, action.microbatch, at - it.step))
        it.record(label, action.kind, wall, elapsed)
        self._account(tier=action.kind in (Kind.STASH, Kind.FETCH))

    def _result(self, it: Iteration, sent: int) -> StepResult:
        """The step's report, once its actions ran and its `sent` bytes were flushed."""
        step = it.step
        return StepResult(
            step=step,
            losses=self.flight.take_losses(step),
            compute_seconds=it.compute,
            idle_seconds=it.idle,
            memory_bytes=dict(self.memory.peak),
            peak_memory_bytes=self.memory.peak_total,
            bytes_sent=sent,
            bytes_stashed=it.stashed,
            weight_version=self.state.version,
            action_seconds={str(k): v for k, v in it.by_kind.items()},
            spans=it.spans,
            versions=it.versions,
            kept_versions=self.state.versions.versions(),
            kind_peak_bytes=dict(self.memory.peak_each),
            activation_peak_bytes=self.memory.peak_activation,
            device_memory_bytes=self.device_memory.snapshot(),
            samples=it.samples,
            phase_seconds=it.phases,
            weights_digest=self.state.weights_digest() if self._check_groups(step) else "",
            layer_seconds=dict(self.clock.layer_seconds),
            metrics=step_metrics(it.counted),
            lr=it.lr,
            grad_norm=it.grad_norm,
            skipped=it.skipped,
            loss_scale=it.loss_scale,
            tied_digests=self.tied.digests() if self._check_ties(step) else {},
        )

    def _check_groups(self, step: int) -> bool:
        """Whether this step's reply carries `weights_digest`: with several groups, on the
        job's `check_groups_every` cadence."""
        return self.reducer is not None and due(step, self.job.check_groups_every,
                                                self.job.steps)

    def _check_ties(self, step: int) -> bool:
        """Whether this step's reply carries `tied_digests`: on an owner of a tied copy,
        on the job's `check_groups_every` cadence."""
        return self.tied.holds_any and due(step, self.job.check_groups_every, self.job.steps)

    def _account(self, tier: bool = True) -> None:
        """Sets the memory account from what the rank holds now; `tier`: asks the node
        tier for its bytes too (a directory scan: after the actions that change them,
        STASH and FETCH, else the last figure stands)."""
        if tier:
            self._node_tier = self.node_tier_bytes()
        seen: set[int] = set()
        stashed = storage_bytes(self.flight.held(), exclude=self.state.param_storage, seen=seen)
        in_flight = 0
        if self.device.type == "cpu":  # a local-tier stash, and one the store's I/O thread
            stashed += self.transport.held_bytes()  # has not written, are in this process's
            in_flight = self.transport.in_flight_bytes()  # memory (on CUDA: pinned host)
        owned = self.state.memory()
        owned["gradients"] += self.tied.nbytes  # tied copies' gradients kept until OPT
        self.memory.set({**owned, "stashed": stashed,
                         "stash_in_flight": in_flight, "node_tier": self._node_tier,
                         "activations": tensor_bytes(self.flight.live(), seen=seen)})

    # -- compute ---------------------------------------------------------------------------

    def _forward(self, action: Action, step: int, it: Iteration) -> None:
        """Runs the stage's layers; each layer's saved tensors follow its policy.

        keep and offload save what the layer's backward needs (STASH moves the offloaded
        ones to the store); recompute saves only the inputs of the first layer of a run.
        """
        m = microbatch(action)
        if step > it.step:  # a lead forward of the next step ([Note: boundary buffers])
            self.state.keep_boundary_buffers(step)
        version = self._forward_weights(action.stage, step, m)
        x, targets = self._stage_input(action.stage, m, step)
        self.renorms.before_forward(step, m, owner=self.role == "combined")
        for i in self.fwd_layers:
            inputs = [x, targets] if i == self.n_layers - 1 and targets is not None else [x]
            self.stats.record(i, m, x)
            x, saved = self.runner.forward(i, step, m, inputs, self.state.params(version, i))
            kept = self.runner.kept(i, inputs, saved)
            if kept:
                self.flight.saved[(step, m, i)] = kept
        if self.fwd_layers and self.fwd_layers[-1] == self.n_layers - 1:
            self.flight.losses[(step, m)] = float(x)
        if action.stage in self.place.sent_outputs:
            self.flight.outputs[(step, action.stage, m)] = x
        if self.role == "combined":
            self.flight.forward_version[(step, action.stage, m)] = version
        it.versions.append((str(action.base), step, version))

    def _forward_weights(self, stage: int, step: int, m: int) -> int:
        """The weight version of the forward of (step, m): the live one, except for a
        resumed job's lead forwards of its first step N, which the uninterrupted job ran
        before step N - 1's OPT, on version N - 1 ([Note: resumed leads] in
        pipefb.runtime.state).

        Raises:
            ConfigError: the checkpoint held no copy of version N - 1.
        """
        if not (step == self.start > 0 and (stage, m) in self.lead_forwards):
            return self.state.version
        if step - 1 not in self.state.versions.versions():
            raise ConfigError(f"the checkpoint of step {step} holds no copy of weight version "
                              f"{step - 1}, which step {step}'s warm-up forwards run on")
        return step - 1

    def _stage_input(self, stage: int, m: int, step: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        needs_data = stage == 0 or self.fwd_layers[-1] == self.n_layers - 1
        inputs, targets = self.data.get(step, m) if needs_data else (None, None)
        x = inputs if stage == 0 else self.flight.inputs.pop((step, stage, m))
        assert x is not None  # stage 0 always has data
        return x, targets

    def _backward(self, action: Action, step: int, it: Iteration) -> None:
        """Runs the stage's layers backward, last to first, accumulating weight grads.

        [Note: input grads first] The previous stage waits for this stage's input
        gradient, never for its weight gradients. So a rank of backward stage s > 0 (sync
        modes, and backward-only ranks in async mode too) runs each layer's input-grad half
        first (`LayerSplit.backward_input`; the halves give bit for bit the whole
        backward's grads), sends the gradient at once
        (its SEND_B then finds it gone), and lets the weight-grad halves of up to s
        micro-batches wait: each B then runs the halves of the oldest beyond s, and the
        rank's last B of a step runs every one left, before OPT. The previous stage gets
        its gradients a weight-grad time sooner; the waiting halves run where this rank
        would otherwise idle (the 1F1B drain). This is ZB-H1's idea (Qi et al., "Zero
        Bubble Pipeline Parallelism", 2024) kept inside 1F1B's order; s bounds the
        micro-batches a stage holds tensors for by the p that stage 0 holds in 1F1B, so the
        pipeline's largest activation peak stays 1F1B's.
        """
        m = microbatch(action)
        version = self.place.forward_version(self.flight.forward_version, step, action.stage, m)
        grad, deferred = self._backward_layers(step, m, version,
                                               self._output_grad(action, step, m), it)
        if action.stage > 0:
            if grad is None:  # [Note: no gradient]
                grad = self.specs[self.bwd_layers[0]][0].zeros().to(self.device)
            self.flight.input_grads[(step, action.stage, m)] = grad
            if deferred:
                self.exchange.send_grad(Action(action.stage, Kind.SEND_B, m), step, it)
        if deferred:
            self.flight.defer((step, m), deferred)
        self._run_deferred(step, keep=0 if m == self.place.last_b else self.place.defer)
        it.versions.append((str(action.base), step, version))
        if self.role == "combined":
            del self.flight.forward_version[(step, action.stage, m)]
            self.state.versions.prune(self.flight.forward_version.values())

    def _output_grad(self, action: Action, step: int, m: int) -> torch.Tensor:
        """The gradient of the loss with respect to the stage's output for (step, m)."""
        if action.stage == len(self.topology.backward_workers) - 1:
            # d(mean over the step's micro-batches, every group's), in the loss's dtype,
            # times the loss scale with fp16 ([Note: loss scaling])
            scale = self.state.scale.scale if self.state.scale is not None else 1.0
            return torch.full((), scale / (self.plan.microbatches * self.plan.groups),
                              dtype=self.loss_dtype, device=self.device)
        return self.flight.grads.pop((step, action.stage, m))

    def _backward_layers(self, step: int, m: int, version: int, grad: torch.Tensor | None,
                         it: Iteration) -> tuple[torch.Tensor | None, dict[int, DeferredGrads]]:
        """Runs the backward layers, last first, from the output gradient `grad` with
        weight `version`; returns the stage's input gradient and the weight-grad halves
        left waiting ([Note: input grads first])."""
        recomputed: dict[int, Saved] = {}
        deferred: dict[int, DeferredGrads] = {}
        for i in reversed(self.bwd_layers):
            if grad is None:  # nothing before here trains ([Note: no gradient])
                self.flight.saved.pop((step, m, i), {})
                continue
            saved = self._saved_for(step, m, i, version, recomputed, it)
            execute, params = self.state.execs[i], self.state.params(version, i)
            with self.clock.layer(step, i):
                if self.place.defer and isinstance(execute, SplitExec):
                    grads, deferred[i] = execute.backward_input(saved, grad, params)
                else:
                    grads = execute.backward(saved, grad, params)
                    self.tied.take(step, m, i)
            grad = grads[0]
        return grad, deferred

    def _saved_for(self, step: int, m: int, i: int, version: int,
                   recomputed: dict[int, Saved], it: Iteration) -> Saved:
        """Layer i's saved tensors for the backward of (step, m): those its forward kept,
        or, for a recompute layer, those of its run's forwards re-run now (kept in
        `recomputed` for the run's other layers)."""
        if self.runner.policy[i] != "recompute":
            return self.flight.saved.pop((step, m, i), {})  # {}: its backward saves nothing
        if i not in recomputed:
            started = time.perf_counter()
            inputs = self.flight.saved.pop((step, m, self.runner.run_start[i]))
            recomputed.update(self.runner.recompute(step, m, i, inputs,
                                                    partial(self.state.params, version)))
            it.recompute += time.perf_counter() - started
        return recomputed.pop(i)

    def _run_deferred(self, step: int, keep: int) -> None:
        """Runs the oldest waiting weight-grad halves until `keep` micro-batches' wait."""
        while len(self.flight.deferred) > keep:
            at, m = next(iter(self.flight.deferred))
            for i, deferred in self.flight.undefer().items():
                with self.clock.layer(step, i):
                    cast(SplitExec, self.state.execs[i]).backward_weights(deferred)
                self.tied.take(at, m, i)
        self.state.count_grads()

    def _optimizer_step(self, action: Action, step: int, it: Iteration) -> None:
        self._run_deferred(step, keep=0)  # the last B ran them; OPT needs every grad
        if self.tied.holds_any:  # before the groups' sum and the norm: the whole gradient
            self.tied.reduce_(step)
        self.renorms.before_update(step)  # [Note: renormalised rows]
        self.stats.reduce_()  # [Note: group statistics], before a copy kept for evaluation
        done = self.state.step(step, self._versions_needed_after(step, it.checkpoint),
                               self.reducer, self.clip)
        it.lr, it.grad_norm, it.skipped = done.lr, done.grad_norm, done.skipped
        it.loss_scale = self.state.scale.scale if self.state.scale is not None else 0.0

    def _versions_needed_after(self, step: int, checkpoint: bool) -> set[int]:
        """Weight versions some backward after step `step`'s OPT will still use, and those
        a checkpoint after the job's last step (`checkpoint`) keeps."""
        if self.role == "combined":
            needed = set(self.flight.forward_version.values())
            if self.lead_forwards and step == self.job.steps - 1 and checkpoint:
                # [Note: resumed leads]: a checkpoint after the job's last step (its
                # cadence's or one requested) keeps the version a longer job resumed from
                # it runs the next step's lead forwards on
                needed.add(self.state.version)
            return needed
        # split ranks: the versions the next steps' forwards run on, as if the job went
        # on past its last step, whose OPT keeps them only for a checkpoint after it: a
        # longer job resumed from it runs its first forwards on them ([Note: resumed
        # stale forwards] in pipefb.runtime.state)
        if step == self.job.steps - 1 and not checkpoint:
            return set()
        return self.place.versions_from(step + 1, self.job.steps + self.plan.staleness)

    # -- the rank's state, for checkpoints, migration and evaluation -----------------------

    @property
    def version(self) -> int:
        """The weight version of the live weights."""
        return self.state.version

    @property
    def param_bytes(self) -> int:
        """Bytes of the held layers' parameters."""
        return self.state.param_bytes

    @property
    def max_state_bytes(self) -> int:
        """The largest tensor a migrating peer may send this rank."""
        return self.state.max_state_bytes

    def owned_weights(self) -> dict[str, torch.Tensor]:
        """The owned weights, named `layers.{i}.{param}` (`RankState.owned_weights`)."""
        return self.state.owned_weights()

    @property
    def saves_checkpoints(self) -> bool:
        """Whether this rank writes a rank file: it owns parameters (a backward or combined
        rank), or the buffers of the forwards it runs ([Note: buffer owners] in
        pipefb.runtime.state)."""
        return self.role != "forward" or bool(self.state.buffers_of(self.fwd_layers))

    def save_checkpoint(self, path: Path) -> Digest:
        """Writes the owned weights and optimizer state; returns the file's digest
        (`RankState.save_checkpoint`)."""
        return self.state.save_checkpoint(path)

    def layer_state(self, layers: Iterable[int], optimizer_layers: Iterable[int]
                    ) -> dict[str, torch.Tensor]:
        """What a migration moves off this rank (`RankState.layer_state`)."""
        return self.state.layer_state(layers, optimizer_layers)

    def loss_scale_metadata(self) -> dict[str, str]:
        """The fp16 loss scale as a rank file's metadata entry; {} without one."""
        return self.state.loss_scale_metadata()

    def pending_weights(self, step: int) -> dict[str, torch.Tensor]:
        """A forward rank's weights of step `step`'s version (`Exchange.pending_weights`)."""
        return self.exchange.pending_weights(step)

    def restore(self, files: Mapping[int, Path], step: int) -> None:
        """Resumes at `step` from a checkpoint's rank files (`RankState.restore`)."""
        self.state.restore(files, step)
        self.start = step
        if self.role != "combined" and self.plan.staleness:  # async PipeFB
            self.state.resume_stale(step, self.place.versions_from(step, self.job.steps),
                                    self.place.split_version(step)
                                    if self.role == "forward" else None)
        self._account()

    def restore_parts(self, parts: Sequence[Part], step: int, source: str) -> None:
        """Resumes at `step` from parts of the job's state (`RankState.restore_parts`)."""
        self.state.restore_parts(parts, step, source)
        self.start = step
        self._account()

    def take_eval_weights(self, version: int) -> dict[str, torch.Tensor]:
        """The owned weights of `version` kept for evaluation (`RankState.take_eval_weights`)."""
        return self.state.take_eval_weights(version)


def _no_bytes() -> int:
    """`StageRuntime.node_tier_bytes` of a host without a node-local tier."""
    return 0
