"""The analytic profile: each layer's time derived from its FLOPs and bytes for a device
that is not here (FLOPs counted on fake tensors by `torch.utils.flop_counter`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from pipefb.errors import ConfigError
from pipefb.job.config import MAXIMA, JobConfig, build_layers
from pipefb.job.data import job_dataset
from pipefb.job.shapes import TensorSpec
from pipefb.memory import tensor_bytes
from pipefb.profile.measure import optimizer_step
from pipefb.profile.sequence import (
    DATA_STEP,
    LayerSequence,
    check_int,
    params_of,
    sequence,
    stash_bytes,
)
from pipefb.runtime.execs import grad_flows, needs_grad, split_exec
from pipefb.seeding import derive_seed, seed_random_ops
from pipefb.sim.costs import LayerProfile, Profile

_EXAMPLE_SEED = 0  # seeds the example inputs of the analytic stash (never the global RNG)


@dataclass(frozen=True)
class _Device:
    """The rates of a device that is not here (see `analytic_profile`)."""

    flops_per_second: float
    bytes_per_second: float  # 0: memory traffic is not charged
    launch_seconds: float  # fixed cost of one layer's forward or backward call

    def seconds(self, flops: int, moved: int) -> float:
        """Time of one call doing `flops` and moving `moved` bytes."""
        memory = moved / self.bytes_per_second if self.bytes_per_second else 0.0
        return self.launch_seconds + flops / self.flops_per_second + memory


def analytic_profile(job: JobConfig, microbatch_size: int, flops_per_second: float,
                     bytes_per_second: float = 0.0, launch_seconds: float = 0.0) -> Profile:
    """Derives a profile for a device that is not here, from FLOPs and bytes.

    FLOPs are counted per layer by `layer_flops` (fake tensors, nothing computed). A call
    takes `launch_seconds + flops / flops_per_second + moved / bytes_per_second` (the last
    term only when `bytes_per_second` > 0), and `launch_seconds` is its fixed part. A
    forward moves its inputs, parameters and output; a backward its stash, output
    gradient, parameters, parameter gradients and input gradients. Bytes are those of
    `measure_profile` (see [Note: profiled bytes] in pipefb.profile.sequence);
    `saved_bytes` comes from one forward of the captured split on example inputs. The
    optimizer moves its parameters (read and written), gradients and state (read and
    written): `(3 + 2 * state ratio) / bytes_per_second` seconds per byte, 0 without a
    bandwidth; the state ratio is measured after one real step here. A copy of the
    weights (a kept weight version) reads and writes them: `2 / bytes_per_second` per byte.

    Args:
        job: the job whose layers and optimizer to profile.
        microbatch_size: samples per micro-batch, >= 1.
        flops_per_second: the device's sustained FLOP rate, finite and > 0.
        bytes_per_second: its memory bandwidth, finite and >= 0 (0: not charged).
        launch_seconds: its fixed cost per layer call, finite and >= 0.

    Returns:
        A profile with source "analytic".

    Raises:
        ConfigError: a bad argument or job value, naming it.
    """
    check_int("micro-batch size", microbatch_size, 1, MAXIMA["batch_size"])
    _check_rate("flops_per_second", flops_per_second, positive=True)
    _check_rate("bytes_per_second", bytes_per_second, positive=False)
    _check_rate("launch_seconds", launch_seconds, positive=False)
    device = _Device(float(flops_per_second), float(bytes_per_second), float(launch_seconds))
    with torch.random.fork_rng(devices=[]):
        dataset = job_dataset(job)
        seq = sequence(build_layers(job), dataset, microbatch_size, job.precision)
        rows = tuple(_analytic_layer(seq, i, out, device, derive_seed(job.seed, DATA_STEP, 0, i))
                     for i, out in enumerate(seq.output_specs()))
        params = params_of(seq.layers)
        ratio = optimizer_step(job, params, 0, 1)[1] if params else 0.0
    rate = device.bytes_per_second
    per_byte = (3 + 2 * ratio) / rate if rate else 0.0
    return Profile(microbatch_size, rows, optimizer_seconds_per_byte=per_byte,
                   optimizer_state_ratio=ratio, source="analytic",
                   weight_copy_seconds_per_byte=2 / rate if rate else 0.0)


def _analytic_layer(seq: LayerSequence, i: int, out: TensorSpec, device: _Device, seed: int
                    ) -> LayerProfile:
    """Layer i's row from its FLOPs, its bytes and the device's rates."""
    layer, specs = seq.layers[i], seq.specs[i]
    needs = needs_grad(i, specs, grad_flows(seq.layers)[i])
    forward_flops, backward_flops = layer_flops(layer, specs, needs)
    inputs = sum(s.nbytes for s in specs)
    input_grads = sum(s.nbytes for s, g in zip(specs, needs, strict=True) if g)
    params = tensor_bytes(layer.parameters())
    saved = _example_stash_bytes(seq, i, needs, seed)
    launch = device.launch_seconds
    return LayerProfile(
        name=type(layer).__name__,
        forward_seconds=device.seconds(forward_flops, inputs + params + out.nbytes),
        backward_seconds=device.seconds(backward_flops,
                                        saved + out.nbytes + 2 * params + input_grads),
        input_bytes=inputs, output_bytes=out.nbytes, saved_bytes=saved, param_bytes=params,
        forward_fixed_seconds=launch, backward_fixed_seconds=launch)


def _example_stash_bytes(seq: LayerSequence, i: int, needs: list[bool], seed: int) -> int:
    """The stash bytes of one forward of layer i's captured split on example inputs (in
    the dtypes the job's autocast gives them)."""
    layer, specs = seq.layers[i], seq.specs[i]
    executor = split_exec(layer, specs, needs, autocast=seq.autocast)
    generator = torch.Generator().manual_seed(_EXAMPLE_SEED)
    if executor.has_random_ops:
        seed_random_ops(seed)
    _, saved = executor.forward([s.example(generator=generator) for s in specs])
    return stash_bytes(layer, saved)


def layer_flops(layer: nn.Module, input_specs: Sequence[TensorSpec],
                input_requires_grad: Sequence[bool]) -> tuple[int, int]:
    """Counts one layer's forward and backward FLOPs on fake tensors (nothing is computed).

    `FlopCounterMode` counts matrix products, convolutions and attention kernels (a
    multiply-add is 2 FLOPs); elementwise ops, reductions and embeddings count 0. The
    backward is autograd's, for every parameter and every input in `input_requires_grad`.

    Args:
        layer: the layer; only its parameters' and buffers' metadata are read.
        input_specs: its positional inputs' specs.
        input_requires_grad: which inputs get a gradient (floating ones only).

    Returns:
        (forward FLOPs, backward FLOPs).
    """
    state = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake: dict[str, torch.Tensor] = {name: mode.from_tensor(t) for name, t in state.items()}
        inputs = tuple(torch.empty(s.shape, dtype=s.dtype).requires_grad_(g)
                       for s, g in zip(input_specs, input_requires_grad, strict=True))
        with FlopCounterMode(display=False) as forward:
            out = functional_call(layer, fake, inputs)
        wrt = [t for t in (*fake.values(), *inputs) if t.requires_grad]
        if not (isinstance(out, torch.Tensor) and out.requires_grad and wrt):
            return forward.get_total_flops(), 0
        with FlopCounterMode(display=False) as backward:
            torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
    return forward.get_total_flops(), backward.get_total_flops()


def _check_rate(name: str, value: object, positive: bool) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, int | float)
          and math.isfinite(value) and (value > 0 if positive else value >= 0))
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"{name} {value!r} must be a finite number {bound}")
