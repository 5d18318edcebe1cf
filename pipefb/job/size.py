"""A job's size before anything is allocated: its layer sequence built on the meta device
(parameters with shapes and no storage), its parameter count, and the activation bytes
of one step from shapes propagated with fake tensors; checked against operator caps.

[Note: size at submit] The coordinator builds every submitted job's model to check it
(`pipefb.job.checks.check_job`). Built for real, a spec asking for `hidden: 100000`
allocates tens of gigabytes inside the submit handler. Built on the meta device, each
parameter is a shape: the count and the activation estimate cost no memory, and a job
over the caps is refused naming its numbers and the cap before any real tensor exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig, build_layers
from pipefb.job.shapes import TensorSpec


@dataclass(frozen=True)
class SizeLimits:
    """Operator caps on what one job may ask for (coordinator flags and env)."""

    max_layers: int = 1024  # layers of the sequence (loss included)
    max_parameters: int = 500_000_000  # parameters of the whole model (2 GB in fp32)
    max_activation_bytes: int = 8 << 30  # every layer's input of every micro-batch, one step


def meta_layers(config: JobConfig) -> list[torch.nn.Module]:
    """The job's layer sequence on the meta device: shapes only, no storage.

    Raises:
        ConfigError: the model does not build (a bad name or option).
    """
    with torch.device("meta"):
        return build_layers(config)


def parameter_count(layers: list[torch.nn.Module]) -> int:
    """Parameters of the layers, a tensor two layers share counted once."""
    seen: dict[int, int] = {}
    for layer in layers:
        for p in layer.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def check_parameters(config: JobConfig, layers: list[torch.nn.Module],
                     limits: SizeLimits) -> None:
    """Refuses a model with more layers or parameters than `limits` allow.

    Raises:
        ConfigError: naming the model, its count and the cap.
    """
    if len(layers) > limits.max_layers:
        raise ConfigError(f"model {config.model!r} has {len(layers)} layers (loss "
                          f"included); this coordinator accepts at most {limits.max_layers}")
    count = parameter_count(layers)
    if count > limits.max_parameters:
        raise ConfigError(f"model {config.model!r} has {count} parameters; this coordinator "
                          f"accepts at most {limits.max_parameters}")


def activation_bytes(config: JobConfig, specs: list[list[TensorSpec]]) -> int:
    """Every layer's input bytes for one micro-batch (targets included), times the
    step's micro-batches: what a step's forward passes hand from layer to layer."""
    return sum(s.nbytes for layer_specs in specs for s in layer_specs) * config.microbatches


def check_activations(config: JobConfig, specs: list[list[TensorSpec]],
                      limits: SizeLimits) -> None:
    """Refuses a job whose step's activations exceed the cap.

    Raises:
        ConfigError: naming the byte count and the cap.
    """
    total = activation_bytes(config, specs)
    if total > limits.max_activation_bytes:
        raise ConfigError(
            f"model {config.model!r} with micro-batches of {config.microbatch_size} samples "
            f"makes {total} bytes of activations per step; this coordinator accepts at "
            f"most {limits.max_activation_bytes}")
