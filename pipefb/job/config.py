"""The job: what to train, as one validated, JSON-able frozen dataclass."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from pipefb.errors import ConfigError
from pipefb.job.lr import LR_SCHEDULES
from pipefb.job.precision import (
    INITIAL_LOSS_SCALE,
    LOSS_SCALE_WINDOW,
    check_loss_scaling,
    check_precision,
)
from pipefb.schedule.kinds import REGISTRY, runs_in_process
from pipefb.schedule.kinds import SCHEDULES as SCHEDULES  # the names a job may run

MODES = ("sync", "async")
#: The modes each schedule runs in; the first is its default.
SCHEDULE_MODES = {name: kind.modes for name, kind in REGISTRY.items()}
POLICIES = ("keep", "offload", "recompute")
PLANS = ("", "even", "auto")  # "" and even: stages balanced by parameter count
AUTO = "auto"  # schedule and plan value: the planner picks
DEVICES = ("cpu", "cuda")  # cuda: each worker's current CUDA device (CUDA_VISIBLE_DEVICES)
MAX_STALENESS = 8  # bounds the weight versions and stashed steps a job may hold
MAX_SLOWDOWN = 100.0  # fault injection: the most a slowdown may stretch compute
MAX_RESTARTS = 100  # a crash loop ends long before; bounds what a spec may ask
MAX_JOB_ID = 64  # characters of a job id
_JOB_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # matched whole (fullmatch: no trailing newline)
MAX_CONFIG_BYTES = 1 << 20  # a JSON config (model, dataset, optimizer, job file) at most
MAX_CONFIG_DEPTH = 32  # nesting of objects and arrays a JSON config may have


def parse_json_object(text: str | dict[str, Any] | None, what: str) -> dict[str, Any]:
    """Parses a JSON object given as text (or passes a dict through).

    Raises:
        ConfigError: malformed JSON or not an object, naming `what`.
    """
    if text is None or text == "":
        return {}
    if isinstance(text, dict):
        check_depth(text, what)
        return dict(text)
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{what} has {len(text)} characters; at most {MAX_CONFIG_BYTES} "
                          "are allowed")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{what} is not valid JSON ({error.msg}): {text[:200]!r}") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise ConfigError(f"{what} is nested deeper than {MAX_CONFIG_DEPTH} levels") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a JSON object, got {text[:200]!r}")
    check_depth(value, what)
    return value


def check_depth(value: object, what: str) -> None:
    """Refuses a JSON-able value nested deeper than MAX_CONFIG_DEPTH (checked without
    recursion, so a deep value cannot exhaust the stack).

    Raises:
        ConfigError: naming `what` and the limit.
    """
    level: list[object] = [value]
    for _ in range(MAX_CONFIG_DEPTH):
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return
    if any(isinstance(item, (dict, list)) for item in level):
        raise ConfigError(f"{what} is nested deeper than {MAX_CONFIG_DEPTH} levels")


@dataclass(frozen=True)
class JobConfig:
    """A training run's definition; the same fields as `pipefb local train` flags."""

    model: str = "gpt"  # model registry name or a pipefb.models entry point
    dataset: str = "text"  # dataset registry name or a pipefb.datasets entry point
    loss: str = "cross_entropy"  # loss name or a pipefb.losses entry point
    schedule: str = "pipefb"  # a name in SCHEDULES (single: the one-process reference)
    workers: int = 4  # workers taking part (ignored by single)
    batch_size: int = 16  # samples per step
    microbatches: int = 4  # micro-batches per step; divides batch_size
    steps: int = 20  # optimizer steps
    optimizer: str = "adamw"  # sgd or adamw
    lr: float = 1e-3  # learning rate
    seed: int = 0  # seeds weights, data sampling and random ops
    mode: str = ""  # sync (results equal one process) or async; "": the schedule's default
    staleness: int = 1  # async pipefb: the forward of step k uses weight version k - staleness
    staleness_microbatches: int = 0  # async pipefb: only a step's first K micro-batches use
    # version k - staleness, the rest wait for k - staleness + 1 ([Note: micro-batch
    # staleness] in pipefb.runtime.place); microbatches: all of them (PipeDream-2BW);
    # 0: the default, 1 on one pipeline group and all on several (`stale_microbatches`)
    policy: str = ""  # keep, offload, recompute or a comma list per layer; "": schedule default
    eval_every: int = 0  # held-out evaluation every K steps in the step reports; 0: at the end
    plan: str = ""  # "" or even: balanced by parameter count; auto: profile, search, simulate
    memory_cap: int = 0  # plan auto: bytes each worker may hold; 0: the cluster's caps
    device: str = "cpu"  # where workers hold layers, activations and optimizer state
    groups: int = 1  # pipeline groups, data-parallel across groups; 0 with plan auto: it picks
    checkpoint_every: int = 0  # checkpoint after every K steps and the last; 0: never
    check_groups_every: int = 10  # several groups: compare each stage's weight digests
    # across groups after every K steps and the last; 0: never (see `weights_digest`);
    # the copies of a tied parameter likewise ([Note: tied parameters])
    checkpoint_dir: str = ""  # where (inside the services' checkpoint root); "": the
    # job's own checkpoints/{job_id}, named by the coordinator at submit
    resume: bool = False  # start from the newest intact checkpoint in checkpoint_dir
    max_restarts: int = 0  # failed attempts replayed (newest checkpoint, or step 0); 0: none
    slowdown: str = ""  # fault injection: "RANK=FACTOR[@STEP],..." (a rank's compute) and
    # "LLAYER=FACTOR[@STEP]" (a layer's, wherever it runs), slower from STEP
    replan: bool = False  # move layers when measured stage times make another partition pay
    job_id: str = ""  # empty: the coordinator names it
    model_config: dict[str, Any] = field(default_factory=dict)  # passed to the model builder
    dataset_config: dict[str, Any] = field(default_factory=dict)  # passed to the dataset
    optimizer_config: dict[str, Any] = field(default_factory=dict)  # optimizer options
    loss_config: dict[str, Any] = field(default_factory=dict)  # loss options (cross_entropy:
    # ignore_index, label_smoothing)
    lr_schedule: str = "constant"  # constant, cosine or linear ([Note: learning-rate schedules])
    warmup_steps: int = 0  # steps of linear warm-up before the schedule's decay
    min_lr: float = 0.0  # the floor cosine and linear decay to, reached after the last step
    clip_grad_norm: float = 0.0  # clip the whole model's gradient norm to this; 0: off
    precision: str = "fp32"  # fp32, bf16 (autocast, float32 master weights) or fp16 (also
    # autocast and loss scaling); [Note: mixed precision] in pipefb.job.precision
    initial_loss_scale: float = INITIAL_LOSS_SCALE  # fp16: the first step's loss scale
    loss_scale_window: int = LOSS_SCALE_WINDOW  # fp16: finite steps in a row before the
    # scale doubles ([Note: loss scaling] in pipefb.runtime.lossscale)

    def __post_init__(self) -> None:
        _check_positive(self, ("workers", "batch_size", "microbatches", "steps"))
        self._check_plan()
        if self.schedule not in (*SCHEDULES, AUTO):
            raise ConfigError(f"unknown schedule {self.schedule!r}; choose one of {SCHEDULES}"
                              " (or auto with --plan auto)")
        if self.mode == "":
            object.__setattr__(self, "mode", SCHEDULE_MODES.get(self.schedule, ("sync",))[0])
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {MODES}")
        if self.schedule in SCHEDULE_MODES and self.mode not in SCHEDULE_MODES[self.schedule]:
            raise ConfigError(f"schedule {self.schedule!r} cannot run in mode {self.mode!r}; "
                              f"it runs in {' or '.join(SCHEDULE_MODES[self.schedule])}")
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or (
                self.eval_every < 0):
            raise ConfigError(f"eval_every {self.eval_every!r} must be an integer >= 0")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or not (
                0 <= self.staleness <= MAX_STALENESS):
            raise ConfigError(f"staleness {self.staleness!r} must be an integer in "
                              f"0..{MAX_STALENESS}")
        self._check_staleness_microbatches()
        if self.device not in DEVICES:
            raise ConfigError(f"unknown device {self.device!r}; choose one of {DEVICES}")
        self._check_groups()
        self._check_checkpoints()
        for rank in slowdowns(self.slowdown):
            if rank >= self.workers:
                raise ConfigError(f"slowdown names rank {rank}; the job has ranks "
                                  f"0..{self.workers - 1}")
        if self.batch_size % self.microbatches:
            raise ConfigError(
                f"microbatches {self.microbatches} does not divide batch size {self.batch_size}"
            )
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"learning rate {self.lr!r} must be a finite number > 0")
        self._check_lr_schedule()
        check_precision(self.precision)
        check_loss_scaling(self.precision, self.initial_loss_scale, self.loss_scale_window)
        if self.precision == "fp16" and self.mode != "sync":
            raise ConfigError(f"precision 'fp16' runs sync jobs only; this one is "
                              f"{self.mode!r} (each backward must take the scale its "
                              "step's update divides by)")
        if self.job_id and not _JOB_ID.fullmatch(self.job_id):
            raise ConfigError(f"job id {self.job_id!r} must match [A-Za-z0-9_.-]{{1,64}}")

    def _check_staleness_microbatches(self) -> None:
        """`staleness_microbatches`: 0 (the default) or 1..microbatches; fewer than all
        on one pipeline group."""
        k = self.staleness_microbatches
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.microbatches:
            raise ConfigError(f"staleness_microbatches {k!r} must be an integer in "
                              f"0..{self.microbatches} (the step's micro-batches; 0: the default)")
        if 0 < k < self.microbatches and self.groups != 1:
            raise ConfigError(f"staleness_microbatches {k} needs one pipeline group; the "
                              f"job has groups {self.groups}")

    def stale_microbatches(self) -> int:
        """How many of a step's micro-batches run on the older version: the job's K, or
        by default (0) 1 on one pipeline group and all of them on several.

        One is the default because it keeps async training's held-out loss within 3% of
        sync's on the demo, where all of them (PipeDream-2BW's rule) ends 14% above it,
        and its forwards wait no longer than sync's (docs/benchmarks.md, "Asynchronous
        convergence"). Several groups run PipeDream-2BW's rule (`_check_staleness_
        microbatches`)."""
        if self.staleness_microbatches:
            return self.staleness_microbatches
        return 1 if self.groups == 1 else self.microbatches

    def _check_lr_schedule(self) -> None:
        """The learning-rate schedule and gradient clipping (pipefb.job.lr)."""
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"unknown lr schedule {self.lr_schedule!r}; choose one of "
                              f"{LR_SCHEDULES}")
        warmup = self.warmup_steps
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ConfigError(f"warmup_steps {warmup!r} must be an integer >= 0")
        if warmup >= self.steps and (warmup or self.lr_schedule != "constant"):
            raise ConfigError(f"warmup_steps {warmup} must be fewer than the job's "
                              f"{self.steps} steps")
        floor = self.min_lr
        if isinstance(floor, bool) or not isinstance(floor, int | float) or not (
                math.isfinite(floor) and 0 <= floor <= self.lr):
            raise ConfigError(f"min_lr {floor!r} must be a finite number in 0..lr "
                              f"({self.lr!r})")
        clip = self.clip_grad_norm
        if isinstance(clip, bool) or not isinstance(clip, int | float) or not (
                math.isfinite(clip) and clip >= 0):
            raise ConfigError(f"clip_grad_norm {clip!r} must be a finite number > 0 "
                              "(0: no clipping)")

    def _check_plan(self) -> None:
        if self.plan not in PLANS:
            raise ConfigError(f"unknown plan {self.plan!r}; choose even or auto")
        if self.schedule == AUTO and self.plan != AUTO:
            raise ConfigError("schedule 'auto' needs --plan auto (the planner picks it)")
        if self.plan == AUTO and self.policy.strip():
            raise ConfigError(f"--policy {self.policy!r} conflicts with --plan auto, which "
                              "chooses each layer's policy")
        if self.plan == AUTO and runs_in_process(self.schedule):
            raise ConfigError(f"schedule {self.schedule!r} runs in one process: there is "
                              "nothing to plan")
        if isinstance(self.memory_cap, bool) or not isinstance(self.memory_cap, int) or (
                self.memory_cap < 0):
            raise ConfigError(f"memory_cap {self.memory_cap!r} must be a byte count >= 0")
        if self.memory_cap and self.plan != AUTO:
            raise ConfigError("--memory-cap is honoured by --plan auto only")

    def _check_checkpoints(self) -> None:
        every = self.checkpoint_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError(f"checkpoint_every {every!r} must be an integer >= 0")
        check = self.check_groups_every
        if isinstance(check, bool) or not isinstance(check, int) or check < 0:
            raise ConfigError(f"check_groups_every {check!r} must be an integer >= 0")
        restarts = self.max_restarts
        if isinstance(restarts, bool) or not isinstance(restarts, int) or not (
                0 <= restarts <= MAX_RESTARTS):
            raise ConfigError(f"max_restarts {restarts!r} must be an integer in "
                              f"0..{MAX_RESTARTS}")
        in_process = runs_in_process(self.schedule)
        if self.replan and (self.mode != "sync" or in_process):
            raise ConfigError("replan moves a sync job's layers between its workers: it "
                              "needs --mode sync and a pipeline schedule")
        if restarts and in_process:
            raise ConfigError(f"schedule {self.schedule!r} runs in this process: it has no "
                              "workers to restart")
        if (every or self.resume) and in_process:
            raise ConfigError(f"schedule {self.schedule!r} runs in this process: it takes no "
                              "checkpoints")
        if self.resume and not (self.checkpoint_dir or self.job_id):
            raise ConfigError("resume needs the checkpoint directory of the job it resumes "
                              "(--checkpoint-dir), or that job's --job-id (a job's own "
                              "directory is checkpoints/JOB_ID)")

    def _check_groups(self) -> None:
        """Each of `groups` pipelines takes an equal share of the workers and micro-batches."""
        g = self.groups
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ConfigError(f"groups {g!r} must be an integer >= 1 (or 0: auto)")
        if g == 0 and self.plan != AUTO:
            raise ConfigError("groups 0 (auto: the planner picks) needs --plan auto")
        if g <= 1 or runs_in_process(self.schedule):
            return
        if self.workers % g:
            raise ConfigError(f"groups {g} does not divide workers {self.workers}")
        if self.microbatches % g:
            raise ConfigError(f"groups {g} does not divide microbatches {self.microbatches} "
                              "(each group runs microbatches / groups of them)")

    @property
    def microbatch_size(self) -> int:
        """Samples per micro-batch."""
        return self.batch_size // self.microbatches

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (round-trips through `from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        """Builds a config from a dict, rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown job field {unknown[0]!r}")
        return cls(**data)


def slowdowns(text: str, layers: bool = False) -> dict[int, tuple[float, int]]:
    """Parses a `slowdown` spec: rank -> (factor >= 1, first step), e.g. "1=2@10,3=1.5";
    with `layers`, its layer entries instead, layer -> (factor, first step), e.g. "L3=4@20"
    (that layer's forward and backward, wherever it runs: a per-layer cost that changes).

    Raises:
        ConfigError: naming the entry that is not [L]INDEX=FACTOR[@STEP].
    """
    out: dict[int, tuple[float, int]] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        index, _, rest = entry.partition("=")
        factor, _, step = rest.partition("@")
        is_layer = index.startswith("L")
        try:
            parsed = int(index.removeprefix("L")), float(factor), int(step or 0)
        except ValueError:
            parsed = (-1, 0.0, -1)
        if parsed[0] < 0 or not 1.0 <= parsed[1] <= MAX_SLOWDOWN or parsed[2] < 0:
            raise ConfigError(f"slowdown entry {entry!r} is not RANK=FACTOR[@STEP] or "
                              f"LLAYER=FACTOR[@STEP] with FACTOR in 1..{MAX_SLOWDOWN:g} and "
                              "STEP >= 0")
        if is_layer == layers:
            out[parsed[0]] = parsed[1:]
    return out


def layer_policies(config: JobConfig, n_layers: int) -> tuple[str, ...]:
    """The per-layer activation policy of a job (loss layer included).

    "" gives the schedule kind's default policy (`ScheduleKind.default_policy`: `offload`
    where saved tensors must cross to another worker's backward, `keep` otherwise). One
    name applies to every layer; a comma list names one policy per layer.

    Raises:
        ConfigError: an unknown policy, a list of the wrong length, or `keep` under a kind
            that runs a layer's backward on another worker.
    """
    kind = REGISTRY.get(config.schedule)  # None: auto, the planner picks each policy
    text = config.policy.strip()
    if not text:
        names = [kind.default_policy if kind else "keep"] * n_layers
    else:
        names = [p.strip() for p in text.split(",")]
        if len(names) == 1:
            names *= n_layers
    for i, name in enumerate(names):
        if name not in POLICIES:
            raise ConfigError(f"policy {name!r} of layer {i} is not one of {POLICIES}")
    if len(names) != n_layers:
        raise ConfigError(f"policy lists {len(names)} layers; the model has {n_layers} "
                          "(loss included)")
    if kind and not kind.keep_allowed and "keep" in names:
        raise ConfigError(f"policy 'keep' of layer {names.index('keep')} cannot cross the "
                          f"forward/backward split of {kind.name}; use offload or recompute")
    return tuple(names)


def job_device(config: JobConfig) -> torch.device:
    """The torch device a process computes the job on.

    Checked where the tensors are placed (a worker, the single process), not at submit:
    the coordinator of a GPU cluster may itself have no GPU.

    Raises:
        ConfigError: the job asks for cuda and this process sees no CUDA device.
    """
    if config.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked for, but this process sees no CUDA device "
                              "(torch.cuda.is_available() is False)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# What a job may ask for: an allocation, thread or process count a request can set is
# bounded before anything is built from it.
MAXIMA = {"workers": 4096, "batch_size": 1 << 16, "microbatches": 4096, "steps": 1 << 40}


def _check_positive(config: JobConfig, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if value > MAXIMA[name]:
            raise ConfigError(f"{name} {value} is more than the {MAXIMA[name]} a job may ask "
                              "for")


def build_layers(config: JobConfig) -> list[torch.nn.Module]:
    """The job's layer sequence: the model's layers, then the loss layer (last)."""
    from pipefb.job.losses import build_loss
    from pipefb.models import build_model

    layers = build_model(config.model, config.model_config, seed=config.seed)
    return [*layers, build_loss(config.loss, config.loss_config)]


def layer_costs(layers: Sequence[torch.nn.Module]) -> list[float]:
    """The placeholder planner's cost of each layer: 1 + its parameter count."""
    return [1.0 + sum(p.numel() for p in layer.parameters()) for layer in layers]
