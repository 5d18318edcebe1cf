"""A job's layer sequence at one micro-batch size, as both profilers walk it, and the
bytes they count.

[Note: profiled bytes] `input_bytes` are the dense bytes of a layer's inputs (the targets
too for the loss layer: what `recompute` keeps), `output_bytes` those of its output,
`param_bytes` the storage of its parameters, and `saved_bytes` the storage its split's
stash reaches beyond the parameters, counted with `pipefb.memory.tensor_bytes` exactly as
the runtime counts `stashed` memory (a storage two stash tensors share counts once; the
stash may alias the layer's input or output).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from pipefb.errors import ConfigError
from pipefb.job.data import Dataset
from pipefb.job.precision import autocast
from pipefb.job.shapes import TensorSpec, infer_input_specs, output_spec, spec_of
from pipefb.memory import tensor_bytes
from pipefb.runtime.execs import Autocast, Saved

DATA_STEP = 0  # shapes come from step 0's micro-batch 0; round r runs step DATA_STEP + r


@dataclass(frozen=True)
class LayerSequence:
    """A job's layers with their input specs at one micro-batch size, and that micro-batch."""

    layers: list[nn.Module]
    specs: list[list[TensorSpec]]
    inputs: torch.Tensor  # the micro-batch's inputs (layer 0's input)
    targets: torch.Tensor  # its targets (the loss layer's second input)
    # the job's autocast: specs, and the splits traced, in the dtypes it gives
    # ([Note: mixed precision] in pipefb.job.precision)
    autocast: Autocast = field(default=nullcontext)

    @property
    def last(self) -> int:
        """Index of the loss layer."""
        return len(self.layers) - 1

    def output_specs(self) -> list[TensorSpec]:
        """Each layer's output spec (the loss's by shape propagation, without compute)."""
        with self.autocast():
            loss = output_spec(self.layers[-1], self.specs[-1])
        return [s[0] for s in self.specs[1:]] + [loss]


def sequence(layers: list[nn.Module], dataset: Dataset, size: int, precision: str = "fp32"
             ) -> LayerSequence:
    """The layers with their input specs and the micro-batch, on the layers' device,
    under the autocast of `precision` (the job's)."""
    x, y = dataset.microbatch(DATA_STEP, 0, size)
    device = next((p.device for p in params_of(layers)), torch.device("cpu"))
    cast = partial(autocast, precision, device)
    with cast():
        specs = infer_input_specs(layers, spec_of(x), spec_of(y))
    return LayerSequence(layers, specs, x.to(device), y.to(device), cast)


def params_of(layers: Sequence[nn.Module]) -> list[torch.Tensor]:
    """The parameters of `layers`, in order."""
    return [p for layer in layers for p in layer.parameters()]


def stash_bytes(layer: nn.Module, saved: Saved) -> int:
    """The stash's storage bytes beyond the layer's parameters, as the runtime counts its
    `stashed` memory ([Note: profiled bytes])."""
    storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    return tensor_bytes(saved.values(), exclude=storages)


def check_int(name: str, value: object, low: int, high: int) -> None:
    """Refuses `value` unless it is an integer in low..high.

    Raises:
        ConfigError: naming `name`.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} {value!r} must be an integer in {low}..{high}")
