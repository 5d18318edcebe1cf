"""Layer cost profiles: what each layer costs in time and bytes, as the planner sees it.

A `Profile` holds one `LayerProfile` per layer of the layer sequence (loss included),
measured (`pipefb.profile.measure`) or derived from FLOPs and bytes for a device that is not
here. Times are per micro-batch of `microbatch_size` samples on the profiled device;
`at(size)` rescales to another micro-batch size: bytes in proportion to samples, times as
a fixed part (call overhead) plus a part in proportion to samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from pipefb.errors import ConfigError
from pipefb.sim.cluster import Link


@dataclass(frozen=True)
class LayerProfile:
    """One layer's costs for one micro-batch.

    Attributes:
        name: the layer's class name, for tables.
        forward_seconds: forward time.
        backward_seconds: backward time (input and weight gradients).
        forward_fixed_seconds: the part of `forward_seconds` that does not scale with
            samples: the line through the times at two micro-batch sizes, at zero
            samples ([Note: fixed part] in pipefb.profile.scaling).
        backward_fixed_seconds: the same for the backward.
        weight_grad_seconds: the part of `backward_seconds` its weight-grad half takes
            when the backward runs input grads first ([Note: input grads first] in
            pipefb.runtime.stage); 0: not measured (the simulator then sends after the whole B).
        input_bytes: the layer's inputs (what `recompute` keeps for a run it starts).
        output_bytes: the layer's output (what a stage boundary after it sends).
        saved_bytes: tensors its backward needs beyond the weights (what `keep` holds and
            `offload` ships through the store).
        param_bytes: its parameters.
    """

    name: str
    forward_seconds: float
    backward_seconds: float
    input_bytes: int
    output_bytes: int
    saved_bytes: int
    param_bytes: int
    forward_fixed_seconds: float = 0.0
    backward_fixed_seconds: float = 0.0
    weight_grad_seconds: float = 0.0

    def __post_init__(self) -> None:
        for key in _NUMBERS:
            value = getattr(self, key)
            if not value >= 0:
                raise ConfigError(f"layer profile {self.name!r}: {key} = {value!r} must be >= 0")
        if self.weight_grad_seconds > self.backward_seconds:
            raise ConfigError(f"layer profile {self.name!r}: weight_grad_seconds = "
                              f"{self.weight_grad_seconds!r} exceeds backward_seconds = "
                              f"{self.backward_seconds!r}")


_NUMBERS = tuple(f.name for f in fields(LayerProfile) if f.name != "name")


@dataclass(frozen=True)
class Profile:
    """Costs of every layer at one micro-batch size, plus the optimizer's.

    Attributes:
        microbatch_size: samples per micro-batch the layer costs are for.
        layers: one per layer, in order, the loss layer last.
        optimizer_seconds_per_byte: optimizer step time per parameter byte it updates.
        optimizer_fixed_seconds: the step's time beyond that, per call on a stage that
            owns parameters (the call's own overhead; [Note: optimizer fixed part] in
            pipefb.profile.measure).
        optimizer_state_ratio: optimizer state bytes per parameter byte (AdamW: 2).
        source: "measured" or "analytic".
        data_seconds: loading one micro-batch (inputs and targets), which the forward of
            the first stage and of the loss's stage each pay; `at` keeps it (loading costs
            mostly per call).
        weight_copy_seconds_per_byte: copying parameters into fresh memory, per byte: an
            OPT that keeps the weights it replaces pays it for the stage's parameters
            ([Note: weight versions] in pipefb.sim.program).
    """

    microbatch_size: int
    layers: tuple[LayerProfile, ...]
    optimizer_seconds_per_byte: float = 0.0
    optimizer_state_ratio: float = 0.0
    source: str = "measured"
    data_seconds: float = 0.0
    optimizer_fixed_seconds: float = 0.0
    weight_copy_seconds_per_byte: float = 0.0
    _scaled: dict[int, Profile] = field(default_factory=dict, init=False, repr=False,
                                        compare=False)

    def __post_init__(self) -> None:
        if self.microbatch_size < 1:
            raise ConfigError(f"profile micro-batch size {self.microbatch_size} must be >= 1")
        if not self.layers:
            raise ConfigError("a profile needs at least one layer")
        for key in ("data_seconds", "optimizer_seconds_per_byte", "optimizer_fixed_seconds",
                    "weight_copy_seconds_per_byte"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"profile {key} = {getattr(self, key)!r} must be >= 0")

    def at(self, microbatch_size: int) -> Profile:
        """The same layers at another micro-batch size (see the module docstring)."""
        if microbatch_size == self.microbatch_size:
            return self
        if microbatch_size < 1:
            raise ConfigError(f"micro-batch size {microbatch_size} must be >= 1")
        if microbatch_size not in self._scaled:
            self._scaled[microbatch_size] = self._rescaled(microbatch_size)
        return self._scaled[microbatch_size]

    def _rescaled(self, microbatch_size: int) -> Profile:
        r = microbatch_size / self.microbatch_size

        def scale(total: float, fixed: float) -> float:
            fixed = min(fixed, total)
            return fixed + (total - fixed) * r

        def layer(x: LayerProfile) -> LayerProfile:
            backward = scale(x.backward_seconds, x.backward_fixed_seconds)
            share = x.weight_grad_seconds / x.backward_seconds if x.backward_seconds else 0.0
            return replace(
                x,
                forward_seconds=scale(x.forward_seconds, x.forward_fixed_seconds),
                backward_seconds=backward, weight_grad_seconds=backward * share,
                input_bytes=round(x.input_bytes * r), output_bytes=round(x.output_bytes * r),
                saved_bytes=round(x.saved_bytes * r))

        layers = tuple(layer(x) for x in self.layers)
        return replace(self, microbatch_size=microbatch_size, layers=layers)

    @property
    def n_layers(self) -> int:
        """Number of layers, the loss included."""
        return len(self.layers)

    def forward_seconds(self, layers: Sequence[int] | range) -> float:
        """Forward time of some layers, summed."""
        return sum(self.layers[i].forward_seconds for i in layers)

    def backward_seconds(self, layers: Sequence[int] | range) -> float:
        """Backward time of some layers, summed."""
        return sum(self.layers[i].backward_seconds for i in layers)

    def weight_grad_seconds(self, layers: Sequence[int] | range) -> float:
        """The weight-grad halves' part of those layers' backward time, summed."""
        return sum(self.layers[i].weight_grad_seconds for i in layers)

    def load_seconds(self, layers: range) -> float:
        """Loading a micro-batch, which a forward over `layers` pays when they start the
        model (inputs) or end it (targets for the loss); once when both."""
        return self.data_seconds if layers.start == 0 or layers.stop == self.n_layers else 0.0

    def optimizer_seconds(self, owned_bytes: int) -> float:
        """An optimizer step over `owned_bytes` of parameters (none: no step)."""
        if not owned_bytes:
            return 0.0
        return self.optimizer_fixed_seconds + self.optimizer_seconds_per_byte * owned_bytes

    def weight_copy_seconds(self, owned_bytes: int) -> float:
        """Keeping a copy of `owned_bytes` of parameters as a weight version."""
        return self.weight_copy_seconds_per_byte * owned_bytes

    def param_bytes(self, layers: Sequence[int] | range) -> int:
        """Parameter bytes of some layers, summed."""
        return sum(self.layers[i].param_bytes for i in layers)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; inverse of `from_dict`."""
        return {"microbatch_size": self.microbatch_size,
                "layers": [asdict(x) for x in self.layers],
                "optimizer_seconds_per_byte": self.optimizer_seconds_per_byte,
                "optimizer_state_ratio": self.optimizer_state_ratio, "source": self.source,
                "data_seconds": self.data_seconds,
                "optimizer_fixed_seconds": self.optimizer_fixed_seconds,
                "weight_copy_seconds_per_byte": self.weight_copy_seconds_per_byte}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Builds a profile from `to_dict` output (ConfigError on a bad field)."""
        try:
            layers = tuple(LayerProfile(**x) for x in data["layers"])
            return cls(**{**data, "layers": layers})
        except (KeyError, TypeError) as error:
            raise ConfigError(f"not a profile: {error}") from None


def kept_bytes(layer: LayerProfile, policy: str, starts_run: bool = True) -> int:
    """What `layer` holds per micro-batch for its backward under `policy`: its saved
    tensors (keep; offload moves them through the store), or under recompute the input of
    the run it starts (`starts_run`), nothing inside a run."""
    if policy != "recompute":
        return layer.saved_bytes
    return layer.input_bytes if starts_run else 0


def uniform_profile(n_layers: int, forward: float = 1e-3, backward: float = 2e-3,
                    activation: int = 1 << 16, params: int = 1 << 20) -> Profile:
    """A profile of `n_layers` identical layers, for tests and described clusters."""
    layer = LayerProfile("layer", forward, backward, activation, activation, 2 * activation,
                         params)
    return Profile(1, (layer,) * n_layers, optimizer_seconds_per_byte=1e-10,
                   optimizer_state_ratio=2.0)


def ring_allreduce_seconds(nbytes: float, members: int, link: Link) -> float:
    """A ring all-reduce of `nbytes` over `members` ranks: 2(m-1) steps of nbytes/m each
    (reduce-scatter, then all-gather), each paying the link's latency."""
    if members < 2 or nbytes <= 0:
        return 0.0
    return 2 * (members - 1) * link.seconds(nbytes / members)
