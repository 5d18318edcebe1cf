"""What a rank reports of one step: the `StepResult`, and the timings gathered while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipefb.schedule import Kind

COMPUTE = frozenset({Kind.F, Kind.B, Kind.OPT})
WAITS = frozenset({Kind.RECV_F, Kind.RECV_B, Kind.RECV_L, Kind.FETCH, Kind.RECV_W})
STORE = frozenset({Kind.STASH, Kind.FETCH})  # actions that wait on the offload store


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
    metrics: dict[str, float] = field(default_factory=dict)  # [Note: step metrics]
    lr: float = 0.0  # a weight owner: the learning rate of the step's OPT; else 0
    grad_norm: float | None = None  # with clipping, on an owner: the model's gradient norm
    skipped: bool = False  # the norm was not finite (or fp16 overflowed): OPT updated nothing
    loss_scale: float = 0.0  # fp16, on an owner: the next step's loss scale; else 0
    # an owner of a tied copy: tied parameter name -> digest ([Note: tied parameters])
    tied_digests: dict[str, str] = field(default_factory=dict)


@dataclass
class Iteration:
    """Timings and tags of one iteration, gathered action by action."""

    step: int
    checkpoint: bool = False  # a checkpoint of the step boundary after `step` follows it
    compute: float = 0.0
    idle: float = 0.0
    by_kind: dict[str, float] = field(default_factory=dict)
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    versions: list[tuple[str, int, int]] = field(default_factory=list)
    stashed: int = 0
    samples: int = 0
    phases: list[tuple[str, float]] = field(default_factory=list)
    recompute: float = 0.0  # seconds re-running forwards inside B actions so far
    counted: dict[str, float] = field(default_factory=dict)  # [Note: step metrics]
    lr: float = 0.0  # what the OPT did (StepResult's fields of the same names)
    grad_norm: float | None = None
    skipped: bool = False
    loss_scale: float = 0.0

    def count(self, metric: str, amount: float) -> None:
        """Adds `amount` to a catalogue metric of this step ([Note: step metrics])."""
        self.counted[metric] = self.counted.get(metric, 0.0) + amount

    def record(self, label: str, kind: Kind, wall: float, elapsed: float) -> None:
        """Adds an action's span (from wall-clock `wall`) and its seconds to its kind's,
        and to compute or idle time."""
        self.spans.append((label, wall, wall + elapsed))
        self.by_kind[kind] = self.by_kind.get(kind, 0.0) + elapsed
        if kind in COMPUTE:
            self.compute += elapsed
        elif kind in WAITS:
            self.idle += elapsed
        if kind in STORE:
            self.count("store_blocked_seconds", elapsed)

    def record_phase(self, kind: Kind, elapsed: float, recompute: float) -> None:
        """Records an F or B action's compute phases, a B's `recompute` seconds apart."""
        if kind is Kind.F:
            self.phases.append(("forward", elapsed))
        elif kind is Kind.B:
            self.phases.append(("backward", elapsed - recompute))
            if recompute:
                self.phases.append(("recompute", recompute))
