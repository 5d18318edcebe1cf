"""The layer profiler: each layer's time and bytes, measured here or derived from FLOPs.

`measure_profile` times every layer of a job's layer sequence (the loss layer last) in
this process, with the executor a split rank runs (`pipefb.runtime.execs.SplitExec`: the captured
forward and backward graphs), on the job's own data, loading that data, and steps of the
job's optimizer.
`analytic_profile` derives the same table for a device that is not here, from FLOPs
counted on fake tensors (`torch.utils.flop_counter.FlopCounterMode`) and bytes. Both return
a `pipefb.sim.costs.Profile`; the worker's Profile RPC wraps `measure_profile`.

[Note: profiled bytes] `input_bytes` are the dense bytes of a layer's inputs (the targets
too for the loss layer: what `recompute` keeps), `output_bytes` those of its output,
`param_bytes` the storage of its parameters, and `saved_bytes` the storage its split's
stash reaches beyond the parameters, counted with `pipefb.memory.tensor_bytes` exactly as
the runtime counts `stashed` memory (a storage two stash tensors share counts once; the
stash may alias the layer's input or output).

[Note: profiled layers] `measure_profile(layers=...)` times only the given layers. Every
layer still runs its forward on each micro-batch, for its `saved_bytes` and for the inputs
of the layers after it; a layer outside `layers` reports zero times and runs no backward.
The second micro-batch of the fixed parts runs through layers 0 .. the last timed one.

[Note: timed as a pipeline runs]
A step's time is the sum of its actions' times, so the profile holds means, not medians:
the occasional slow call (a page fault, the allocator growing, the scheduler) is part of
what a pipeline pays. The calls are timed as a pipeline makes them, not one layer over
and over on one input: each round loads `IN_FLIGHT` fresh micro-batches (timed: the
profile's `data_seconds`), runs each through every layer, keeping what the backwards
need, then runs the backwards, last layer first, each as its input half then its weight half
(`weight_grad_seconds`; [Note: input grads first] in pipefb.runtime.stage; the caches are
evicted before the pair). So a layer meets its outputs as new
allocations while earlier micro-batches' stashes are alive, as on a worker; a layer
timed alone in a loop runs from reused memory, 10-40% faster than inside a run on this
machine's CPU. The optimizer's time is the runtime's OPT: the step, dropping the
gradients and counting the state, after fresh gradients.

[Note: cold caches]
Every timed call (a micro-batch's loading, a layer's forward or backward, an optimizer
step) starts after `EVICT_BYTES` were written on the device (`_Caches`: one buffer,
overwritten in place, so no allocation or page fault is timed with it): on a worker,
other layers, other micro-batches and, where workers share a host, other processes ran
since the layer last touched its weights and inputs. Measured on this machine's CPU
(2 cores, 32 MiB L3), a 512x512 linear layer and ReLU at 32 samples: forward 0.18 ms
timed warm, 0.35 ms after the buffer was written, 0.36 ms of thread CPU inside a 4-worker
local pipeline; a gpt block (n_embd 128, 16 samples of 64 tokens): forward 5.6 ms warm,
6.2-6.7 ms cold, 6.5 ms in the pipeline; backward 11.0, 11.7 and 11.8 ms. An optimizer
step over cached state runs about twice as fast as one over evicted state here.

[Note: fixed part]
The planner tries micro-batch sizes other than the profiled one, and `Profile.at` rescales
each time as a fixed part plus a part in proportion to samples. The fixed part is the
line through the times at two sizes, the profiled one and a second (`second_size`),
taken at 0 samples. The second is four times the profiled size, within the job's batch
(the largest micro-batch a plan can have); at the whole batch, a quarter of it. Far
apart and the second above: where a layer's time is mostly per call (the bench's small
`mlp`, about 0.2 ms a layer), the slope is a small difference of two noisy times, and
from a quarter of the size an error in it was multiplied on the way up. Measured here:
the 8-sample `mlp` profiles the workers took in one simulator-accuracy run, scaled to 32
samples along the line through 2 and 8, gave 1.4-2.7 ms of forward (1.65-1.68 ms measured
at 32 samples in a quiet process); in a quiet process both pairs came within -13%..+8%
of the times measured at 2, 4, 16 and 32 samples for the bench's `gpt` and `mlp`
(forward and backward sums, two runs each). A single sample is a poor point: a `gpt`
block (n_embd 128, 64 tokens) costs more per call at 1 sample than the line through 2 to
32 samples gives (with the fixed part from 1 sample, 8-sample profiles scaled to 2
samples came out 28-33% over).

[Note: optimizer fixed part]
An optimizer step costs a fixed part per call beyond its bytes, and the simulator charges
each stage's OPT for its own parameters, so a stage with few of them paid almost nothing
when the step's time was all per byte. The profiler times the step over the parameters
and over their smallest tensor alone; the fixed part is the line through the two at zero
bytes. Measured here (AdamW, one torch thread, cold caches): 0.19 ms for 0.13 MB of
parameters, 0.24 ms for 1.05 MB, 0.51 ms for 3.2 MB. The bench `mlp`'s first stage (0.13
MB) was predicted 0.02 ms per OPT from the per-byte figure alone, and measured 0.14-0.30
ms in the simulator-accuracy runs.

Where the parameters hold few bytes, their step is no slower than the smallest tensor's
within the noise (the tests' one-block `gpt`, 0.12 MB: about 0.52 ms either way, and once
the line had no slope, which made the whole step fixed and its bytes free). So the far
point holds at least `CONTRAST_BYTES` (1 MiB, about 0.2 ms of AdamW here): fewer
parameters are timed with a tensor of zeros beside them that makes up the rest.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from pipefb.errors import ConfigError
from pipefb.job.config import MAXIMA, JobConfig, build_layers, job_device
from pipefb.job.data import Dataset, build_dataset
from pipefb.job.optim import build_optimizer, optimizer_state_bytes
from pipefb.job.shapes import TensorSpec, infer_input_specs, output_spec, spec_of
from pipefb.memory import tensor_bytes
from pipefb.runtime.execs import Saved, SplitExec, needs_grad
from pipefb.runtime.versions import WeightVersions
from pipefb.seeding import derive_seed, seed_random_ops
from pipefb.sim.costs import LayerProfile, Profile

WARMUP = 2  # default untimed rounds before the timed ones
REPEATS = 5  # default timed rounds (times are their mean)
IN_FLIGHT = 2  # micro-batches a round forwards before their backwards
EVICT_BYTES = 64 << 20  # written before each timed call (beyond a CPU's caches)
MAX_RUNS = 100  # warm-up or timed runs a request may ask for (bounds a Profile call)
#: the second micro-batch timed is this many times the profiled one's size, within the
#: job's batch, else this many times smaller (at least 1 sample); each time's fixed part
#: is the line through the two sizes, at 0 samples ([Note: fixed part])
SECOND_FACTOR = 4
MIN_SECOND_ROUNDS = 2  # timed rounds at a larger second size, at least
#: the optimizer's per-byte cost comes from a step over at least this many bytes: fewer
#: parameters are padded with zeros up to it ([Note: optimizer fixed part])
CONTRAST_BYTES = 1 << 20
KEPT_COPIES = 2  # weight copies the profiler holds at once, as a PipeDream stage keeps
DATA_STEP = 0  # shapes come from step 0's micro-batch 0; round r runs step DATA_STEP + r
_EXAMPLE_SEED = 0  # seeds the example inputs of the analytic stash (never the global RNG)

T = TypeVar("T")


@dataclass(frozen=True)
class _Sequence:
    """A job's layers with their input specs at one micro-batch size, and that micro-batch."""

    layers: list[nn.Module]
    specs: list[list[TensorSpec]]
    inputs: torch.Tensor  # the micro-batch's inputs (layer 0's input)
    targets: torch.Tensor  # its targets (the loss layer's second input)

    @property
    def last(self) -> int:
        """Index of the loss layer."""
        return len(self.layers) - 1

    def layer_inputs(self, i: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Layer `i`'s inputs when `x` is its first: the loss layer also takes the targets."""
        return [x, self.targets] if i == self.last else [x]

    def output_specs(self) -> list[TensorSpec]:
        """Each layer's output spec (the loss's by shape propagation, without compute)."""
        return [s[0] for s in self.specs[1:]] + [output_spec(self.layers[-1], self.specs[-1])]


def _sequence(layers: list[nn.Module], dataset: Dataset, size: int) -> _Sequence:
    """The layers with their input specs and the micro-batch, on the layers' device."""
    x, y = dataset.microbatch(DATA_STEP, 0, size)
    device = next((p.device for p in _params(layers)), torch.device("cpu"))
    specs = infer_input_specs(layers, spec_of(x), spec_of(y))
    return _Sequence(layers, specs, x.to(device), y.to(device))


@dataclass(frozen=True)
class _Run:
    """One layer's mean forward and backward seconds (0 when untimed), the backward's
    weight-grad half among them, and stash bytes."""

    forward: float
    backward: float
    weights: float
    saved_bytes: int


@dataclass
class _Samples:
    """Seconds sampled per layer while timing micro-batches as a pipeline runs them."""

    forward: dict[int, list[float]]
    backward: dict[int, list[float]]
    weights: dict[int, list[float]]
    data: list[float]
    saved_bytes: dict[int, int]

    def runs(self, stop: int) -> list[_Run]:
        """Layer 0 .. stop-1's runs: mean times (0 untimed) and stash bytes."""
        return [_Run(_mean(self.forward.get(i)), _mean(self.backward.get(i)),
                     _mean(self.weights.get(i)), self.saved_bytes[i]) for i in range(stop)]


def measure_profile(job: JobConfig, microbatch_size: int, layers: range | None = None,
                    warmup: int = WARMUP, repeats: int = REPEATS) -> Profile:
    """Times every layer of `job` on this process (see [Note: profiled layers] and
    [Note: timed as a pipeline runs]).

    Layer i runs on what layers 0 .. i-1 computed from the job's data, through `SplitExec`
    as a split rank runs it (random ops seeded as the runtime seeds them), on the job's
    device. Each time is the mean over `repeats` rounds of `IN_FLIGHT` micro-batches, after
    `warmup` untimed rounds (on CUDA each call waits for its kernels); the fixed parts
    come from the same timed at `second_size(microbatch_size, job.batch_size)` samples
    ([Note: fixed part]). The torch thread count is the caller's; the caller's random
    generator state is left unchanged.

    Args:
        job: the job whose layers, data, seed and optimizer to profile.
        microbatch_size: samples per micro-batch, >= 1.
        layers: which layers to time, a non-empty range of step 1; None: all of them.
        warmup: untimed rounds before the timed ones, >= 0.
        repeats: timed rounds, >= 1.

    Returns:
        A measured profile: one `LayerProfile` per layer, the loss layer last, the seconds
        of loading one micro-batch, and the optimizer's seconds per byte and state ratio
        over the timed layers' parameters (all layers' when those have none).

    Raises:
        ConfigError: a bad argument or job value, naming it.
    """
    _check_int("micro-batch size", microbatch_size, 1, MAXIMA["batch_size"])
    _check_int("warmup", warmup, 0, MAX_RUNS)
    _check_int("repeats", repeats, 1, MAX_RUNS)
    device = job_device(job)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        dataset = build_dataset(job.dataset, job.dataset_config, job.seed)
        seq = _sequence([layer.to(device) for layer in build_layers(job)], dataset,
                        microbatch_size)
        timed = _timed_layers(layers, len(seq.layers))
        caches = _Caches(device)
        full = _pipeline(seq, dataset, microbatch_size, timed, len(seq.layers), job.seed,
                         warmup, repeats, caches)
        size = second_size(microbatch_size, job.batch_size)
        rounds = _second_rounds(warmup, repeats, microbatch_size, size)
        second = (full if microbatch_size == size else
                  _pipeline(_sequence(seq.layers, dataset, size), dataset, size,
                            timed, timed.stop, job.seed, *rounds, caches))
        owned = _owned_layers(seq.layers, timed)
        optimizer = _optimizer_costs(job, _params(list(owned.values())), warmup, repeats,
                                     caches)
        copy = _weight_copy_seconds_per_byte(owned, warmup, repeats, caches)
    runs, fixed = full.runs(len(seq.layers)), second.runs(timed.stop)
    sizes = (size, microbatch_size)
    rows = (_measured_layer(seq, i, out, runs[i], fixed[i] if i in timed else None, sizes)
            for i, out in enumerate(seq.output_specs()))
    return Profile(microbatch_size, tuple(rows),
                   optimizer_seconds_per_byte=optimizer.per_byte,
                   optimizer_fixed_seconds=optimizer.fixed,
                   optimizer_state_ratio=optimizer.state_ratio, source="measured",
                   data_seconds=_mean(full.data), weight_copy_seconds_per_byte=copy)


def _pipeline(seq: _Sequence, dataset: Dataset, size: int, timed: range, stop: int, seed: int,
              warmup: int, repeats: int, caches: _Caches) -> _Samples:
    """Rounds of `IN_FLIGHT` micro-batches of `size` samples (each round's data fresh):
    every micro-batch's forward through layers 0 .. stop-1, then every one's backward of
    the layers in `timed`, last layer first; times from the rounds after `warmup`, each
    call's from cold caches ([Note: cold caches])."""
    device = seq.inputs.device
    executors = [SplitExec(seq.layers[i], seq.specs[i], needs_grad(i, seq.specs[i]), device)
                 for i in range(stop)]
    samples = _Samples({}, {}, {}, [], {})
    for r in range(warmup + repeats):
        record = r >= warmup
        flight = [_forwards(seq, dataset, executors, timed, size, DATA_STEP + r, m, seed,
                            samples, caches if record else None) for m in range(IN_FLIGHT)]
        for kept in flight:
            for i, saved, out in reversed(kept):
                grad = torch.ones_like(out)  # the values do not change the work
                if record:
                    caches.evict()
                # in two halves, input grads first, as a stage that sends gradients on runs
                # it ([Note: input grads first] in pipefb.runtime.stage)
                inputs, (_, deferred) = _timed(partial(executors[i].backward_input, saved,
                                                       grad))
                weights, _ = _timed(partial(executors[i].backward_weights, deferred))
                if record:
                    samples.backward.setdefault(i, []).append(inputs + weights)
                    samples.weights.setdefault(i, []).append(weights)
    return samples


def _forwards(seq: _Sequence, dataset: Dataset, executors: list[SplitExec], timed: range,
              size: int, step: int, m: int, seed: int, samples: _Samples,
              caches: _Caches | None) -> list[tuple[int, Saved, torch.Tensor]]:
    """Micro-batch m of `step`: loads it and runs every executor's forward; in a timed
    round (`caches` given) times the load and the timed layers' forwards, each from cold
    caches; returns what the timed layers' backwards need."""
    record = caches is not None
    if caches is not None:
        caches.evict()
    seconds, (x, y) = _timed(lambda: dataset.microbatch(step, m, size))
    x, y = x.to(seq.inputs.device), y.to(seq.inputs.device)
    kept: list[tuple[int, Saved, torch.Tensor]] = []
    for i, executor in enumerate(executors):
        inputs = [x, y] if i == seq.last else [x]

        def forward(i: int = i, executor: SplitExec = executor,
                    inputs: list[torch.Tensor] = inputs) -> tuple[torch.Tensor, Saved]:
            if executor.has_random_ops:
                seed_random_ops(derive_seed(seed, step, m, i))  # as the runtime's F does
            return executor.forward(inputs)

        if caches is not None and i in timed:
            caches.evict()
        forward_seconds, (x, saved) = _timed(forward)
        samples.saved_bytes.setdefault(i, _stash_bytes(seq.layers[i], saved))
        if i in timed:
            kept.append((i, saved, x))
            if record:
                samples.forward.setdefault(i, []).append(forward_seconds)
    if record:
        samples.data.append(seconds)
    return kept


class _Caches:
    """Empties a device's caches before a timed call ([Note: cold caches]) by writing
    `EVICT_BYTES` into a buffer allocated once."""

    def __init__(self, device: torch.device) -> None:
        self.buffer = torch.empty(EVICT_BYTES, dtype=torch.uint8, device=device)
        self.value = 0

    def evict(self) -> None:
        """Overwrites the buffer (with a new value each time), its writes done."""
        self.value = (self.value + 1) % 256
        self.buffer.fill_(self.value)
        if self.buffer.is_cuda:
            torch.cuda.synchronize()


def _mean(samples: list[float] | None) -> float:
    """The mean of the samples, 0 when there are none."""
    return statistics.fmean(samples) if samples else 0.0


def _mean_seconds(fn: Callable[[], object], warmup: int, repeats: int,
                  before: Callable[[], object] = lambda: None) -> float:
    """Runs `before` (untimed) and then `fn`, `warmup` times untimed and `repeats` (>= 1)
    times timed; returns the mean seconds of the timed calls of `fn`."""
    times = []
    for k in range(warmup + repeats):
        before()
        seconds, _ = _timed(fn)
        if k >= warmup:
            times.append(seconds)
    return statistics.fmean(times)


def _timed(fn: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()  # the kernels, not their launch
    return time.perf_counter() - start, result


def _stash_bytes(layer: nn.Module, saved: Saved) -> int:
    """The stash's storage bytes beyond the layer's parameters (runtime `_account` rule)."""
    storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    return tensor_bytes(saved.values(), exclude=storages)


def _params(layers: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [p for layer in layers for p in layer.parameters()]


def _owned_layers(layers: Sequence[nn.Module], timed: range) -> dict[int, nn.Module]:
    """The layers whose optimizer step and weight copy are timed: the timed ones, or every
    layer where those hold no parameters."""
    owned = {i: layers[i] for i in timed}
    return owned if _params(list(owned.values())) else dict(enumerate(layers))


@dataclass(frozen=True)
class _OptimizerCosts:
    """A step of the job's optimizer: seconds per parameter byte plus fixed seconds per
    call, and state bytes per parameter byte."""

    per_byte: float = 0.0
    fixed: float = 0.0
    state_ratio: float = 0.0


def _optimizer_costs(job: JobConfig, params: list[torch.Tensor], warmup: int, repeats: int,
                     caches: _Caches | None = None) -> _OptimizerCosts:
    """Steps of the job's optimizer over `params`, and over their smallest tensor alone;
    the fixed part is the line through the two at zero bytes ([Note: optimizer fixed
    part]). All zeros when there are no parameters; no fixed part for a single tensor.
    """
    nbytes = tensor_bytes(params)
    if not nbytes:
        return _OptimizerCosts()
    seconds, ratio = _optimizer_step(job, params, warmup, repeats, caches)
    smallest = [min(params, key=lambda p: tensor_bytes([p]))]
    if tensor_bytes(smallest) == nbytes:
        return _OptimizerCosts(seconds / nbytes, 0.0, ratio)
    if nbytes < CONTRAST_BYTES:  # too few bytes to show a slope: pad them with zeros
        first = params[0]
        pad = nn.Parameter(torch.zeros((CONTRAST_BYTES - nbytes) // first.element_size(),
                                       dtype=first.dtype, device=first.device))
        params = [*params, pad]
        nbytes = tensor_bytes(params)
        seconds, _ = _optimizer_step(job, params, warmup, repeats, caches)
    small, _ = _optimizer_step(job, smallest, warmup, repeats, caches)
    fixed = fixed_part(small, seconds, (tensor_bytes(smallest), nbytes))
    return _OptimizerCosts((seconds - fixed) / nbytes, fixed, ratio)


def _weight_copy_seconds_per_byte(layers: Mapping[int, nn.Module], warmup: int,
                                  repeats: int, caches: _Caches | None = None) -> float:
    """Keeping a weight version of `layers`, per parameter byte, with the runtime's own
    `WeightVersions` ([Note: weight versions] in pipefb.sim.simulate): each copy is held while
    the next `KEPT_COPIES - 1` are made, and the caches are emptied (if given) before
    each."""
    nbytes = tensor_bytes(_params(list(layers.values())))
    if not nbytes:
        return 0.0
    versions, made = WeightVersions(), itertools.count()

    def copy() -> None:
        version = next(made)
        versions.keep(version, layers)
        versions.prune(range(version - KEPT_COPIES + 1, version + 1))

    evict = caches.evict if caches is not None else lambda: None
    return _mean_seconds(copy, max(warmup, KEPT_COPIES), repeats, evict) / nbytes


def _optimizer_step(job: JobConfig, params: list[torch.Tensor], warmup: int, repeats: int,
                    caches: _Caches | None) -> tuple[float, float]:
    """A step of the job's optimizer over `params` as the runtime's OPT takes it: the step,
    then the gradients dropped (`zero_grad(set_to_none=True)`) and the state counted; fresh
    gradients are set before each, untimed, after `caches` were emptied (if given).

    The first step allocates the optimizer state, so at least one untimed step runs first.

    Returns:
        (mean seconds of a step, state bytes per parameter byte).
    """
    optimizer = build_optimizer(job.optimizer, params, job.lr, job.optimizer_config)

    def set_grads() -> None:
        if caches is not None:
            caches.evict()
        for p in params:
            p.grad = torch.zeros_like(p)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        optimizer_state_bytes(optimizer)

    seconds = _mean_seconds(step, max(warmup, 1), repeats, set_grads)
    return seconds, optimizer_state_bytes(optimizer) / tensor_bytes(params)


def second_size(microbatch_size: int, batch_size: int) -> int:
    """Samples of the second micro-batch the profiler times ([Note: fixed part]): up to
    `SECOND_FACTOR` times the profiled size within the batch; at the whole batch (or
    beyond), `SECOND_FACTOR` times smaller, at least 1."""
    larger = min(batch_size, SECOND_FACTOR * microbatch_size)
    return larger if larger > microbatch_size else max(1, microbatch_size // SECOND_FACTOR)


def _second_rounds(warmup: int, repeats: int, microbatch_size: int, size: int
                   ) -> tuple[int, int]:
    """Warm-up and timed rounds at the second size: as many when it is smaller; when it
    is larger, the same warm-up (a new size first meets page faults and a growing
    allocator: with one warm-up round the bench `gpt`'s forward at 32 samples came out
    13% over) and timed rounds of about as many samples as the profiled size's, at least
    `MIN_SECOND_ROUNDS` (each call starts by evicting the caches, which costs more than a
    small layer's compute)."""
    if size <= microbatch_size:
        return warmup, repeats
    return warmup, max(MIN_SECOND_ROUNDS, math.ceil(repeats * microbatch_size / size))


def fixed_part(other: float, full: float, sizes: tuple[int, int]) -> float:
    """The part of a time that does not scale with samples: the line through `other`
    seconds at `sizes[0]` samples and `full` (the profiled size's) at `sizes[1]`, at 0
    samples, within [0, full]; `full` itself when the sizes are the same (a one-sample
    micro-batch is all fixed part; [Note: fixed part])."""
    n, m = sizes
    if n == m:
        return full
    slope = (full - other) / (m - n)
    return min(max(other - slope * n, 0.0), full)


def _measured_layer(seq: _Sequence, i: int, out: TensorSpec, full: _Run, other: _Run | None,
                    sizes: tuple[int, int]) -> LayerProfile:
    """Layer i's row: times from the profiled size's run and the second size's, bytes
    from shapes."""
    layer = seq.layers[i]
    return LayerProfile(
        name=type(layer).__name__, forward_seconds=full.forward, backward_seconds=full.backward,
        input_bytes=sum(s.nbytes for s in seq.specs[i]), output_bytes=out.nbytes,
        saved_bytes=full.saved_bytes, param_bytes=tensor_bytes(layer.parameters()),
        forward_fixed_seconds=fixed_part(other.forward, full.forward, sizes) if other else 0.0,
        backward_fixed_seconds=(fixed_part(other.backward, full.backward, sizes) if other
                                else 0.0),
        weight_grad_seconds=min(full.weights, full.backward))


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
    `measure_profile` (see [Note: profiled bytes]); `saved_bytes` comes from one forward of
    the captured split on example inputs. The optimizer moves its parameters (read and
    written), gradients and state (read and written): `(3 + 2 * state ratio) /
    bytes_per_second` seconds per byte, 0 without a bandwidth; the state ratio is measured
    after one real step here. A copy of the weights (a kept weight version) reads and
    writes them: `2 / bytes_per_second` per byte.

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
    _check_int("micro-batch size", microbatch_size, 1, MAXIMA["batch_size"])
    _check_rate("flops_per_second", flops_per_second, positive=True)
    _check_rate("bytes_per_second", bytes_per_second, positive=False)
    _check_rate("launch_seconds", launch_seconds, positive=False)
    device = _Device(float(flops_per_second), float(bytes_per_second), float(launch_seconds))
    with torch.random.fork_rng(devices=[]):
        dataset = build_dataset(job.dataset, job.dataset_config, job.seed)
        seq = _sequence(build_layers(job), dataset, microbatch_size)
        rows = tuple(_analytic_layer(seq, i, out, device, derive_seed(job.seed, DATA_STEP, 0, i))
                     for i, out in enumerate(seq.output_specs()))
        params = _params(seq.layers)
        ratio = _optimizer_step(job, params, 0, 1, None)[1] if params else 0.0
    rate = device.bytes_per_second
    per_byte = (3 + 2 * ratio) / rate if rate else 0.0
    return Profile(microbatch_size, rows, optimizer_seconds_per_byte=per_byte,
                   optimizer_state_ratio=ratio, source="analytic",
                   weight_copy_seconds_per_byte=2 / rate if rate else 0.0)


def _analytic_layer(seq: _Sequence, i: int, out: TensorSpec, device: _Device, seed: int
                    ) -> LayerProfile:
    """Layer i's row from its FLOPs, its bytes and the device's rates."""
    layer, specs = seq.layers[i], seq.specs[i]
    needs = needs_grad(i, specs)
    forward_flops, backward_flops = layer_flops(layer, specs, needs)
    inputs = sum(s.nbytes for s in specs)
    input_grads = sum(s.nbytes for s, g in zip(specs, needs, strict=True) if g)
    params = tensor_bytes(layer.parameters())
    saved = _example_stash_bytes(layer, specs, needs, seed)
    launch = device.launch_seconds
    return LayerProfile(
        name=type(layer).__name__,
        forward_seconds=device.seconds(forward_flops, inputs + params + out.nbytes),
        backward_seconds=device.seconds(backward_flops,
                                        saved + out.nbytes + 2 * params + input_grads),
        input_bytes=inputs, output_bytes=out.nbytes, saved_bytes=saved, param_bytes=params,
        forward_fixed_seconds=launch, backward_fixed_seconds=launch)


def _example_stash_bytes(layer: nn.Module, specs: list[TensorSpec], needs: list[bool],
                         seed: int) -> int:
    """The stash bytes of one forward of the layer's captured split on example inputs."""
    executor = SplitExec(layer, specs, needs)
    generator = torch.Generator().manual_seed(_EXAMPLE_SEED)
    if executor.has_random_ops:
        seed_random_ops(seed)
    _, saved = executor.forward([s.example(generator=generator) for s in specs])
    return _stash_bytes(layer, saved)


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


_BYTES = ("input_bytes", "output_bytes", "saved_bytes", "param_bytes")


def median_profile(profiles: Sequence[Profile]) -> Profile:
    """The per-layer median of profiles of the same job measured on several workers.

    Every time field, both optimizer fields and the data time are medians; the bytes must
    agree.

    Raises:
        ConfigError: no profiles, or profiles of different layers, sizes or bytes.
    """
    if not profiles:
        raise ConfigError("median_profile needs at least one profile")
    for k, p in enumerate(profiles):
        _check_same(profiles[0], p, k)
    rows = (_median_layer([p.layers[i] for p in profiles]) for i in range(profiles[0].n_layers))
    return replace(profiles[0], layers=tuple(rows),
                   optimizer_seconds_per_byte=statistics.median(
                       p.optimizer_seconds_per_byte for p in profiles),
                   optimizer_fixed_seconds=statistics.median(
                       p.optimizer_fixed_seconds for p in profiles),
                   optimizer_state_ratio=statistics.median(
                       p.optimizer_state_ratio for p in profiles),
                   data_seconds=statistics.median(p.data_seconds for p in profiles),
                   weight_copy_seconds_per_byte=statistics.median(
                       p.weight_copy_seconds_per_byte for p in profiles))


def _median_layer(rows: list[LayerProfile]) -> LayerProfile:
    def median(get: Callable[[LayerProfile], float]) -> float:
        return statistics.median(get(r) for r in rows)

    return replace(rows[0], forward_seconds=median(lambda r: r.forward_seconds),
                   backward_seconds=median(lambda r: r.backward_seconds),
                   forward_fixed_seconds=median(lambda r: r.forward_fixed_seconds),
                   backward_fixed_seconds=median(lambda r: r.backward_fixed_seconds),
                   weight_grad_seconds=median(lambda r: r.weight_grad_seconds))


def _check_same(first: Profile, other: Profile, k: int) -> None:
    """Refuses profile `k` unless it has the same size, layers and bytes as profile 0."""
    if (other.microbatch_size, other.n_layers) != (first.microbatch_size, first.n_layers):
        raise ConfigError(f"profile {k} has {other.n_layers} layers at micro-batch size "
                          f"{other.microbatch_size}, profile 0 {first.n_layers} at "
                          f"{first.microbatch_size}")
    for i, (a, b) in enumerate(zip(first.layers, other.layers, strict=True)):
        for f in _BYTES:
            if getattr(a, f) != getattr(b, f):
                raise ConfigError(f"profile {k} has {f} {getattr(b, f)} for layer {i}, "
                                  f"profile 0 {getattr(a, f)}")


def relative_speeds(profiles: Sequence[Profile]) -> list[float]:
    """Each profile's speed: the median total layer time (forward + backward) over its own.

    Raises:
        ConfigError: no profiles, or a profile whose layers took no time.
    """
    totals = [p.forward_seconds(range(p.n_layers)) + p.backward_seconds(range(p.n_layers))
              for p in profiles]
    if not totals:
        raise ConfigError("relative_speeds needs at least one profile")
    if min(totals) <= 0:
        raise ConfigError(f"profile {totals.index(min(totals))} has no timed layer")
    middle = statistics.median(totals)
    return [middle / t for t in totals]


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} {value!r} must be an integer in {low}..{high}")


def _check_rate(name: str, value: object, positive: bool) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, int | float)
          and math.isfinite(value) and (value > 0 if positive else value >= 0))
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"{name} {value!r} must be a finite number {bound}")


def _timed_layers(layers: range | None, n_layers: int) -> range:
    """The layers to time: all by default, else a non-empty step-1 range inside 0..n."""
    if layers is None:
        return range(n_layers)
    if (not isinstance(layers, range) or layers.step != 1
            or not 0 <= layers.start < layers.stop <= n_layers):
        raise ConfigError(f"layers {layers!r} must be a non-empty range of step 1 within "
                          f"range(0, {n_layers}) (the loss layer included)")
    return layers
