"""One rank's weights, optimizer and weight versions: what its actions update and what
checkpoints, migrations and evaluations read and write."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pipefb.codec import raw_view
from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig
from pipefb.job.lr import LearningRates
from pipefb.job.optim import build_optimizer, optimizer_state_bytes
from pipefb.memory import tensor_bytes
from pipefb.runtime.allreduce import Reducer
from pipefb.runtime.checkpoint import (
    Digest,
    Part,
    layer_of,
    load_optimizer,
    load_rank,
    optimizer_share,
    optimizer_tensors,
    save_rank,
)
from pipefb.runtime.clipping import GlobalNormClip
from pipefb.runtime.execs import LayerExec
from pipefb.runtime.lossscale import METADATA_KEY, LossScale
from pipefb.runtime.versions import WeightVersions

KEPT_PREFIX = "kept."  # a rank file's copies of old weight versions: kept.{v}.layers.{i}.{p}


@dataclass
class OptStep:
    """What one optimizer step did."""

    lr: float  # the learning rate of the step
    grad_norm: float | None = None  # the whole model's gradient norm (with clipping)
    skipped: bool = False  # the norm was not finite: no owner updated its weights


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """CRC-32 of the tensors' names and bytes in name order: equal across groups when their
    copies of a stage are bit-identical.

    A consistency check, not a security one: it runs on the step's critical path, where a
    cryptographic hash would cost a noticeable share of a small model's step."""
    crc = 0
    for name, tensor in sorted(weights.items()):
        crc = zlib.crc32(raw_view(tensor)[2], zlib.crc32(name.encode(), crc))
    return f"{crc:08x}"


class RankState:
    """The layers a rank holds (forward and backward), the optimizer of those it owns (its
    backward layers), their weight version, and the copies kept of older versions.

    Every in-place change of a layer's weights goes through here and tells the layer's
    executor (`LayerExec.weights_changed`).
    """

    def __init__(self, job: JobConfig, rank: int, layers: dict[int, torch.nn.Module],
                 execs: Mapping[int, LayerExec], forward_layers: range, owned_layers: range,
                 scale: LossScale | None = None) -> None:
        """`scale`: an fp16 owner's copy of the loss scale ([Note: loss scaling]); None
        otherwise."""
        self.job, self.rank = job, rank
        self.scale = scale
        self.layers, self.execs = layers, execs
        self.fwd_layers, self.bwd_layers = forward_layers, owned_layers
        # the parameters the optimizer updates: trainable ones (a frozen one keeps no
        # gradient and no optimizer state, as in one process), each once
        self.owned = [p for _, p in self._trainable(owned_layers)]
        # tied copies ([Note: tied parameters]), each summed across groups in a collective of
        # its own: a buffer of the same size on every owner of a copy adds alike
        self.summed_apart: set[int] = set()
        # the largest tensor a migrating peer may send: a parameter or its optimizer state
        self.max_state_bytes = max((p.numel() * p.element_size() for layer in layers.values()
                                    for p in layer.parameters()), default=0) + 8
        self.optimizer = (
            build_optimizer(job.optimizer, self.owned, job.lr, job.optimizer_config)
            if self.owned else None  # a stage of parameter-free layers has nothing to update
        )
        self.rates = LearningRates(job.lr_schedule, job.lr, job.steps, job.warmup_steps,
                                   job.min_lr)
        self.version = 0
        self.versions = WeightVersions()
        self._eval_weights: dict[int, dict[str, torch.Tensor]] = {}  # version -> owned weights
        self._eval_bytes = 0  # of `_eval_weights`, updated where it changes
        params = [p for layer in layers.values() for p in layer.parameters()]
        self.param_bytes = tensor_bytes(params)
        self.param_storage = {p.untyped_storage().data_ptr() for p in params}
        self.grad_bytes = self.optimizer_bytes = 0  # updated where they change
        # (step, the forward layers' buffers before that step's first forward), taken
        # when a lead forward runs ahead of the step boundary ([Note: boundary buffers])
        self._boundary: tuple[int, dict[str, torch.Tensor]] | None = None

    def memory(self) -> dict[str, int]:
        """Bytes by kind: parameters, gradients, optimizer state, kept weight versions."""
        return {
            "parameters": self.param_bytes,
            "gradients": self.grad_bytes,
            "optimizer_state": self.optimizer_bytes,
            "weight_versions": self.versions.nbytes + self._eval_bytes,
        }

    # -- the weights the actions use and change --------------------------------------------

    def params(self, version: int, layer: int) -> list[torch.Tensor] | None:
        """A layer's parameters at `version`; None for the live (newest) ones."""
        return None if version == self.version else self.versions.params(version, layer)

    def count_grads(self) -> None:
        """Counts the owned parameters' gradient bytes (after gradients were accumulated)."""
        self.grad_bytes = tensor_bytes(p.grad for p in self.owned if p.grad is not None)

    def step(self, step: int, needed: set[int], reducer: Reducer | None,
             clip: GlobalNormClip | None = None) -> OptStep:
        """The optimizer step (OPT) of training step `step`: keeps the current version if a
        later backward needs it (`needed`), sums the gradients across groups (`reducer`),
        clips them by the whole model's gradient norm (`clip`, a collective of the
        group's owners), sets the step's learning rate ([Note: learning-rate schedules]),
        updates the owned weights to the next version, unless the norm is not finite,
        and drops the kept versions not `needed`; on the job's `eval_every` cadence keeps
        a copy of the new version for evaluation. With a loss scale (fp16), the gradients
        are unscaled first and a step whose gradients overflowed on any owner is skipped
        ([Note: loss scaling])."""
        if self.version in needed:
            self.versions.keep(self.version, {i: self.layers[i] for i in self.bwd_layers})
        done = OptStep(lr=self.rates.at(step))
        if self.optimizer is not None and reducer is not None:
            self._sum_gradients_across_groups(reducer)
        scale = self.scale
        overflowed = scale is not None and scale.unscale_(self.owned)  # a collective too
        if clip is not None:  # every owner takes part, one without parameters too
            done.grad_norm = clip.clip_(self.owned)
            done.skipped = not math.isfinite(done.grad_norm)
        if scale is not None:
            done.skipped = done.skipped or overflowed
            scale.update(overflowed)
        if self.optimizer is not None:  # None: the stage owns no parameters
            if not done.skipped:
                for group in self.optimizer.param_groups:
                    group["lr"] = done.lr
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer_bytes = optimizer_state_bytes(self.optimizer)
        for i in self.bwd_layers:
            self.execs[i].weights_changed()
        self.grad_bytes = 0
        self.version += 1
        self.versions.prune(needed)
        self.keep_for_eval(self.version)
        return done

    def _sum_gradients_across_groups(self, reducer: Reducer) -> None:
        """Every group's copy of this stage ends with the step's whole gradient (a parameter
        no micro-batch touched contributes zeros)."""
        for p in self.owned:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        reducer.sum_([p.grad for p in self.owned
                      if p.grad is not None and id(p) not in self.summed_apart])
        for p in self.owned:
            if p.grad is not None and id(p) in self.summed_apart:
                reducer.sum_([p.grad])

    def prepare(self, versions: Iterable[int]) -> None:
        """Derives now what the owned layers' next backwards need from weight `versions`
        (the live one or kept ones)."""
        for version in sorted(set(versions)):
            for i in self.bwd_layers:
                self.execs[i].prepare(self.params(version, i))

    def install(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies a pushed weight version (`{layer}.{param}` names) into the forward layers."""
        with torch.no_grad():
            for i in self.fwd_layers:
                for name, p in self.layers[i].named_parameters():
                    p.copy_(weights[f"{i}.{name}"])
                self.execs[i].weights_changed()
        self.version = version

    # -- names -----------------------------------------------------------------------------

    def named_params(self, layers: Iterable[int]) -> dict[str, torch.Tensor]:
        """The parameters of `layers`, named `{layer}.{param}` as weight pushes name them."""
        return {f"{i}.{name}": p.detach()
                for i in layers for name, p in self.layers[i].named_parameters()}

    def weights_of(self, layers: Iterable[int]) -> dict[str, torch.Tensor]:
        """The weights of `layers`, named `layers.{i}.{param}` as in rank files."""
        return {f"layers.{i}.{name}": p.detach()
                for i in layers for name, p in self.layers[i].named_parameters()}

    def buffers_of(self, layers: Iterable[int]) -> dict[str, torch.Tensor]:
        """The persistent buffers of `layers` (BatchNorm's statistics), `layers.{i}.{name}`."""
        return {f"layers.{i}.{name}": b.detach() for i in layers
                for name, b in persistent_buffers(self.layers[i])}

    def owned_weights(self) -> dict[str, torch.Tensor]:
        """What this rank owns, named `layers.{i}.{name}`: the parameters of its backward
        layers, and the buffers of its forward layers ([Note: buffer owners])."""
        return {**self.weights_of(self.bwd_layers), **self.buffers_of(self.fwd_layers)}

    def param_names(self, layers: Iterable[int]) -> list[str]:
        """`{layer}.{param}` of every parameter of `layers`, in order (for the owned
        layers, the optimizer's order)."""
        return [f"{i}.{n}" for i in layers for n, _ in self.layers[i].named_parameters()]

    def owned_names(self) -> list[str]:
        """`{layer}.{param}` of every parameter the optimizer updates, in its order."""
        return [name for name, _ in self._trainable(self.bwd_layers)]

    def _trainable(self, layers: Iterable[int]) -> list[tuple[str, torch.Tensor]]:
        """(`{layer}.{param}`, parameter) of every trainable parameter of `layers`, each
        parameter once (under the first name it has)."""
        seen: set[int] = set()
        out: list[tuple[str, torch.Tensor]] = []
        for i in layers:
            for name, p in self.layers[i].named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{i}.{name}", p))
        return out

    # -- checkpoints, migration, evaluation ------------------------------------------------

    def keep_boundary_buffers(self, step: int) -> None:
        """Keeps the forward layers' buffers as they are before step `step`'s first
        forward, once per step.

        [Note: boundary buffers] PipeDream runs the next step's warm-up forwards (lead
        forwards) before the current step's update, and each updates BatchNorm's
        statistics. A checkpoint of step boundary N is written after step N - 1's
        iteration, when step N's lead forwards already counted their micro-batches; a
        job resumed from it runs them again. So the checkpoint (and the copy kept for
        the held-out evaluation of version N) takes the statistics kept here, before step
        N's first forward: what a job of N steps ends with.
        """
        if self._boundary is None or self._boundary[0] != step:
            self._boundary = (step, {k: v.clone()
                                     for k, v in self.buffers_of(self.fwd_layers).items()})

    def boundary_weights(self) -> dict[str, torch.Tensor]:
        """`owned_weights` at the step boundary of the live version: the buffers as they
        were before that step's lead forwards, if any ran ([Note: boundary buffers])."""
        weights = self.owned_weights()
        if self._boundary is not None and self._boundary[0] == self.version:
            weights.update(self._boundary[1])
        return weights

    def save_checkpoint(self, path: Path) -> Digest:
        """Writes the owned weights (`boundary_weights`), optimizer state and loss scale;
        returns the file's digest (`pipefb.runtime.checkpoint.save_rank`)."""
        return save_rank(path, {**self.boundary_weights(), **self.kept_weights()},
                         self.optimizer, self.owned_names(), self.loss_scale_metadata())

    def kept_weights(self) -> dict[str, torch.Tensor]:
        """The old weight versions this rank keeps of its owned layers, named
        `kept.{version}.layers.{i}.{param}`.

        [Note: resumed leads] PipeDream runs step N's warm-up forwards (lead forwards)
        in iteration N - 1, before that step's OPT makes version N, and their backwards
        in iteration N take version N - 1 from `WeightVersions`. A checkpoint of step
        boundary N is written after iteration N - 1, so it holds that copy too; a job
        resumed from it restores the copy, re-runs the lead forwards with it in the
        prologue of iteration N (`ir.iteration`'s `start`), and trains on exactly as the
        uninterrupted job does. A job's last step runs no lead forwards; when a checkpoint
        follows it (by the cadence or requested: the Step's `checkpoint`), its OPT keeps
        the version it replaces all the same (`StageRuntime._versions_needed_after`), so
        a longer job can resume from it."""
        return {f"{KEPT_PREFIX}{v}.layers.{i}.{name}": t
                for v in self.versions.versions() for i in self.bwd_layers
                for (name, _), t in zip(self.layers[i].named_parameters(),
                                        self.versions.params(v, i), strict=True)}

    def loss_scale_metadata(self) -> dict[str, str]:
        """The fp16 loss scale as a rank file's metadata entry; {} without one."""
        return self.scale.metadata() if self.scale is not None else {}

    def layer_state(self, layers: Iterable[int], optimizer_layers: Iterable[int]
                    ) -> dict[str, torch.Tensor]:
        """What a migration moves off this rank: the weights of `layers` owned here, the
        buffers of `layers` whose forward runs here ([Note: buffer owners]), and the
        optimizer state of `optimizer_layers`, owned here, named as in a rank file.

        Raises:
            ConfigError: a layer this rank neither owns nor runs the forward of, or
                optimizer state of a layer it does not own.
        """
        wanted, optim = set(layers), set(optimizer_layers)
        owned, forward = set(self.bwd_layers), set(self.fwd_layers)
        foreign = sorted((wanted - owned - forward) | (optim - owned))
        if foreign:
            raise ConfigError(f"layers {foreign} are not owned by rank {self.rank} "
                              f"(it owns {list(self.bwd_layers)})")
        out = {**self.weights_of(sorted(wanted & owned)),
               **self.buffers_of(sorted(wanted & forward))}
        if self.optimizer is not None and optim:
            state, _ = optimizer_tensors(self.optimizer, self.owned_names())
            out.update({k: v for k, v in state.items() if layer_of(k)[0] in optim})
        return out

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
        optimizer tensors `optimizer.i.p.key`, metadata with the param groups and the fp16
        loss scale) as a rank file or a migrating peer gives them; the first part with
        param groups gives the optimizer's hyper-parameters, else this rank's own
        optimizer does; the first with a loss scale gives an fp16 owner its scale.

        Raises:
            ConfigError: a held weight is missing from every part, or has another shape
                or dtype; an fp16 owner finds no loss scale (the message names `source`).
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
                load_buffers(layer, i, weights)  # absent: a rank that never ran its forward
                self.execs[i].weights_changed()
        self._restore_kept(weights, step)
        if self.scale is not None:  # every owner saved the same scale
            self.scale.load(next((meta for _, meta in states if METADATA_KEY in meta), {}),
                            source)
        if self.optimizer is not None:
            names = self.owned_names()
            states.append(({}, optimizer_tensors(self.optimizer, names)[1]))  # groups last
            load_optimizer(self.optimizer, names, *optimizer_share(states, names))
            self.optimizer_bytes = optimizer_state_bytes(self.optimizer)
        self.version = step

    def _restore_kept(self, weights: Mapping[str, torch.Tensor], step: int) -> None:
        """Keeps each old version (below `step`) of which the parts hold a copy of every
        parameter of the layers this rank keeps versions of: its owned layers, or a
        forward rank's forward layers ([Note: resumed leads], [Note: resumed stale
        forwards]); a version some parameter lacks is not kept."""
        layers = self.bwd_layers or self.fwd_layers
        found = {int(k[len(KEPT_PREFIX):].split(".", 1)[0]) for k in weights
                 if k.startswith(KEPT_PREFIX)}
        for version in sorted(v for v in found if 0 <= v < step):
            kept: dict[int, list[torch.Tensor]] = {}
            for i in layers:
                params = list(self.layers[i].parameters())
                got = [weights.get(f"{KEPT_PREFIX}{version}.layers.{i}.{name}")
                       for name, _ in self.layers[i].named_parameters()]
                whole = [t.to(p.device) for t, p in zip(got, params, strict=True)
                         if t is not None and t.shape == p.shape and t.dtype == p.dtype]
                if len(whole) < len(params):
                    break
                kept[i] = whole
            else:
                if kept:
                    self.versions.put(version, kept)

    def resume_stale(self, step: int, used: set[int], first: int | None) -> None:
        """Readies an async PipeFB rank resumed at `step` for the old weight versions
        the forwards of its first steps run on (`used`); `first`: on a forward rank, the
        version its first forward runs on, which it installs now.

        [Note: resumed stale forwards] An async PipeFB forward rank runs step k's
        forwards on version k - S (k - S + 1 past the first K micro-batches: [Note:
        micro-batch staleness] in pipefb.runtime.place), which the owners push once
        their OPT of step k - S - 1 made it. A job resumed at step N runs no step before
        N: no owner pushes versions N - S + 1 .. N, and the owners' backwards of steps N
        .. N + S - 1 need the old versions those steps' forwards ran on. After step N - 1's OPT
        the owners keep exactly those (`WeightVersions`), so their rank files of step
        boundary N hold them (`kept_weights`) beside the live version N. Every resumed
        rank restores the copies of its layers (`_restore_kept`); a forward rank also
        keeps the live version N where a forward uses it, installs `first`, and takes
        each newer version from its copies instead of a push (`install_kept`, from
        `Exchange.install_version`), dropping each copy once installed. So the resumed
        job's forwards and backwards run on the versions the uninterrupted job's ran on.
        The owners keep them as if the job went on past its last step, whose OPT drops
        them unless a checkpoint follows it (`StageRuntime._versions_needed_after`), so a
        longer job resumes from that checkpoint too.

        Raises:
            ConfigError: the checkpoint holds no copy of one of `used`.
        """
        missing = sorted(used - {step} - set(self.versions.versions()))
        if missing:
            raise ConfigError(f"the checkpoint of step {step} holds no copy of weight version "
                              f"{missing[0]}, which the forwards of its first steps run on "
                              "(async staleness)")
        self.versions.prune(used)
        if first is not None and first < step:
            if step in used:
                self.versions.keep(step, {i: self.layers[i] for i in self.fwd_layers})
            self.install_kept(first)

    def install_kept(self, version: int) -> None:
        """Installs a kept copy of `version` into the forward layers and drops the copies
        of it and older versions ([Note: resumed stale forwards])."""
        with torch.no_grad():
            for i in self.fwd_layers:
                for p, kept in zip(self.layers[i].parameters(),
                                   self.versions.params(version, i), strict=True):
                    p.copy_(kept)
                self.execs[i].weights_changed()
        self.version = version
        self.versions.prune(v for v in self.versions.versions() if v > version)

    def weights_digest(self) -> str:
        """`weights_digest` of the owned parameters (the coordinator compares the groups';
        buffers are left out: where the groups do not replay one process's statistics,
        each group's follow its own micro-batches, [Note: group statistics] in
        pipefb.runtime.groupstats)."""
        return weights_digest(self.weights_of(self.bwd_layers))

    def keep_for_eval(self, version: int) -> None:
        """Keeps a copy of the owned weights (`boundary_weights`) for the held-out
        evaluation of `version` when the job's `eval_every` cadence asks for it: an owner
        at the OPT that makes `version`, a rank that steps no optimizer (a PipeFB forward
        rank, whose buffers are the model's: [Note: buffer owners]) once the forwards of
        the step before `version` ran."""
        every = self.job.eval_every
        if every and version % every == 0 and version < self.job.steps:
            self._eval_weights[version] = {k: v.clone()
                                           for k, v in self.boundary_weights().items()}
            self._eval_bytes = self._kept_eval_bytes()

    def take_eval_weights(self, version: int) -> dict[str, torch.Tensor]:
        """The owned weights of `version`, kept for evaluation (`keep_for_eval`).

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


def persistent_buffers(layer: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A layer's buffers that its state dict keeps (not the non-persistent ones, such as a
    causal mask the layer rebuilds), by name.

    [Note: buffer owners] A buffer the forward updates (BatchNorm's running statistics)
    is right on the rank that runs the layer's forward: a combined rank, or a PipeFB
    forward rank; a backward rank's copy never changes. So a rank exports the parameters
    of the layers whose backward it runs and the buffers of the layers whose forward it
    runs, and the coordinator collects both from every rank of the first group: for the
    exported weights, a checkpoint (each rank writes its own part) and the held-out
    evaluation of a kept version (`keep_for_eval`: an owner keeps its parameters at the
    OPT that makes version v, a PipeFB forward rank its buffers once step v - 1's
    forwards ran).
    """
    kept = layer.state_dict(keep_vars=True)
    return [(name, b) for name, b in layer.named_buffers() if name in kept]


def load_buffers(layer: torch.nn.Module, index: int, weights: Mapping[str, torch.Tensor]
                 ) -> None:
    """Copies `layers.{index}.{name}` of `weights` into the layer's persistent buffers where
    they are given with the buffer's shape; a buffer they lack keeps its value."""
    with torch.no_grad():
        for name, buffer in persistent_buffers(layer):
            saved = weights.get(f"layers.{index}.{name}")
            if saved is not None and saved.shape == buffer.shape:
                buffer.copy_(saved)
