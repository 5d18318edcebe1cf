"""The measured profile: times every layer of a job in this process as a split rank runs it.

`measure_profile` times every layer of a job's layer sequence (the loss layer last) in
this process, with the executor a split rank runs (`pipefb.runtime.execs.SplitExec`: the
captured forward and backward graphs), on the job's own data, loading that data, and
steps of the job's optimizer. It returns a `pipefb.sim.costs.Profile`; the worker's
Profile RPC wraps it. `pipefb.profile.analytic` derives the same table for a device that
is not here.

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
evicted before the pair). So a layer meets its outputs as new allocations while earlier
micro-batches' stashes are alive, as on a worker; a layer timed alone in a loop runs from
reused memory and would come out faster than it runs inside a pipeline. The optimizer's
time is the runtime's OPT: the step, dropping the gradients and counting the state, after
fresh gradients.

[Note: cold caches]
Every timed call (a micro-batch's loading, a layer's forward or backward, an optimizer
step) starts after `EVICT_BYTES` were written on the device (`_Caches`: one buffer,
overwritten in place, so no allocation or page fault is timed with it): on a worker,
other layers, other micro-batches and, where workers share a host, other processes ran
since the layer last touched its weights and inputs. A call timed after the buffer was
written takes about what the same call takes inside a local pipeline, where a call timed
warm, right after the previous one, is faster; an optimizer step over cached state is
faster than one over evicted state in the same way.

[Note: optimizer fixed part]
An optimizer step costs a fixed part per call beyond its bytes, and the simulator charges
each stage's OPT for its own parameters, so with a per-byte cost alone a stage with few
parameters would pay almost nothing. The profiler times the step over the parameters
and over their smallest tensor alone; the fixed part is the line through the two at zero
bytes.

Where the parameters hold few bytes, their step is no slower than the smallest tensor's
within the noise, and the line may have no slope at all, which would make the whole step
fixed and its bytes free. So the far point holds at least `CONTRAST_BYTES`: fewer
parameters are timed with a tensor of zeros beside them that makes up the rest.
"""

from __future__ import annotations

import contextvars
import itertools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch
from torch import nn

from pipefb.errors import Aborted, ConfigError
from pipefb.job.config import MAXIMA, JobConfig, build_layers, job_device
from pipefb.job.data import Dataset, job_dataset
from pipefb.job.optim import build_optimizer, optimizer_state_bytes
from pipefb.job.shapes import TensorSpec
from pipefb.memory import tensor_bytes
from pipefb.profile.scaling import fixed_part, second_rounds, second_size
from pipefb.profile.sequence import (
    DATA_STEP,
    LayerSequence,
    check_int,
    params_of,
    sequence,
    stash_bytes,
)
from pipefb.runtime.execs import NoGradExec, Saved, SplitExec, grad_flows, needs_grad, split_exec
from pipefb.runtime.versions import WeightVersions
from pipefb.seeding import derive_seed, seed_random_ops
from pipefb.sim.costs import LayerProfile, Profile

WARMUP = 2  # default untimed rounds before the timed ones
REPEATS = 5  # default timed rounds (times are their mean)
IN_FLIGHT = 2  # micro-batches a round forwards before their backwards
EVICT_BYTES = 64 << 20  # written before each timed call (beyond a CPU's caches)
MAX_RUNS = 100  # warm-up or timed runs a request may ask for (bounds a Profile call)
#: the optimizer's per-byte cost comes from a step over at least this many bytes: fewer
#: parameters are padded with zeros up to it ([Note: optimizer fixed part])
CONTRAST_BYTES = 1 << 20
KEPT_COPIES = 2  # weight copies the profiler holds at once, as a PipeDream stage keeps

T = TypeVar("T")
#: the running profile's cancellation test (`measure_profile(cancelled=...)`), asked
#: before every timed call and every layer's tracing
_CANCELLED: contextvars.ContextVar[Callable[[], bool]] = contextvars.ContextVar(
    "cancelled", default=lambda: False)


def _check_cancelled() -> None:
    """Raises Aborted once the caller of the running profile gave up."""
    if _CANCELLED.get()():
        raise Aborted("the profile was cancelled (its caller went away, its deadline "
                      "passed, or the worker is stopping)")


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
                    warmup: int = WARMUP, repeats: int = REPEATS,
                    cancelled: Callable[[], bool] | None = None) -> Profile:
    """Times every layer of `job` on this process (see [Note: profiled layers] and
    [Note: timed as a pipeline runs]).

    Layer i runs on what layers 0 .. i-1 computed from the job's data, through `SplitExec`
    as a split rank runs it (random ops seeded as the runtime seeds them), on the job's
    device. Each time is the mean over `repeats` rounds of `IN_FLIGHT` micro-batches, after
    `warmup` untimed rounds (on CUDA each call waits for its kernels); the fixed parts
    come from the same timed at `second_size(microbatch_size, job.batch_size)` samples
    ([Note: fixed part] in pipefb.profile.scaling). The torch thread count is the
    caller's; the caller's random generator state is left unchanged.

    Args:
        job: the job whose layers, data, seed and optimizer to profile.
        microbatch_size: samples per micro-batch, >= 1.
        layers: which layers to time, a non-empty range of step 1; None: all of them.
        warmup: untimed rounds before the timed ones, >= 0.
        repeats: timed rounds, >= 1.
        cancelled: asked before every timed call and every layer's tracing; once it
            answers True the profile stops (a caller whose deadline passed).

    Returns:
        A measured profile: one `LayerProfile` per layer, the loss layer last, the seconds
        of loading one micro-batch, and the optimizer's seconds per byte and state ratio
        over the timed layers' parameters (all layers' when those have none).

    Raises:
        ConfigError: a bad argument or job value, naming it.
        Aborted: `cancelled` answered True.
    """
    check_int("micro-batch size", microbatch_size, 1, MAXIMA["batch_size"])
    check_int("warmup", warmup, 0, MAX_RUNS)
    check_int("repeats", repeats, 1, MAX_RUNS)
    token = _CANCELLED.set(cancelled or (lambda: False))
    try:
        return _measure(job, microbatch_size, layers, warmup, repeats)
    finally:
        _CANCELLED.reset(token)


def _measure(job: JobConfig, microbatch_size: int, layers: range | None, warmup: int,
             repeats: int) -> Profile:
    """`measure_profile` after its arguments were checked."""
    device = job_device(job)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        dataset = job_dataset(job)
        seq = sequence([layer.to(device) for layer in build_layers(job)], dataset,
                        microbatch_size, job.precision)
        timed = _timed_layers(layers, len(seq.layers))
        caches = _Caches(device)
        full = _pipeline(seq, dataset, microbatch_size, timed, len(seq.layers), job.seed,
                         warmup, repeats, caches)
        size = second_size(microbatch_size, job.batch_size)
        rounds = second_rounds(warmup, repeats, microbatch_size, size)
        second = (full if microbatch_size == size else
                  _pipeline(sequence(seq.layers, dataset, size, job.precision), dataset, size,
                            timed, timed.stop, job.seed, *rounds, caches))
        owned = _owned_layers(seq.layers, timed)
        optimizer = _optimizer_costs(job, params_of(list(owned.values())), warmup, repeats,
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


def _pipeline(seq: LayerSequence, dataset: Dataset, size: int, timed: range, stop: int, seed: int,
              warmup: int, repeats: int, caches: _Caches) -> _Samples:
    """Rounds of `IN_FLIGHT` micro-batches of `size` samples (each round's data fresh):
    every micro-batch's forward through layers 0 .. stop-1, then every one's backward of
    the layers in `timed`, last layer first; times from the rounds after `warmup`, each
    call's from cold caches ([Note: cold caches])."""
    device = seq.inputs.device
    flows = grad_flows(seq.layers)
    executors: list[SplitExec | NoGradExec] = []
    for i in range(stop):
        _check_cancelled()
        executors.append(split_exec(seq.layers[i], seq.specs[i],
                                    needs_grad(i, seq.specs[i], flows[i]), device,
                                    seq.autocast))
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


def _forwards(seq: LayerSequence, dataset: Dataset, executors: list[SplitExec | NoGradExec],
              timed: range,
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

        def forward(i: int = i, executor: SplitExec | NoGradExec = executor,
                    inputs: list[torch.Tensor] = inputs) -> tuple[torch.Tensor, Saved]:
            if executor.has_random_ops:
                seed_random_ops(derive_seed(seed, step, m, i))  # as the runtime's F does
            return executor.forward(inputs)

        if caches is not None and i in timed:
            caches.evict()
        forward_seconds, (x, saved) = _timed(forward)
        samples.saved_bytes.setdefault(i, stash_bytes(seq.layers[i], saved))
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
    _check_cancelled()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()  # the kernels, not their launch
    return time.perf_counter() - start, result


def _owned_layers(layers: Sequence[nn.Module], timed: range) -> dict[int, nn.Module]:
    """The layers whose optimizer step and weight copy are timed: the timed ones, or every
    layer where those hold no parameters."""
    owned = {i: layers[i] for i in timed}
    return owned if params_of(list(owned.values())) else dict(enumerate(layers))


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
    seconds, ratio = optimizer_step(job, params, warmup, repeats, caches)
    smallest = [min(params, key=lambda p: tensor_bytes([p]))]
    if tensor_bytes(smallest) == nbytes:
        return _OptimizerCosts(seconds / nbytes, 0.0, ratio)
    if nbytes < CONTRAST_BYTES:  # too few bytes to show a slope: pad them with zeros
        first = params[0]
        pad = nn.Parameter(torch.zeros((CONTRAST_BYTES - nbytes) // first.element_size(),
                                       dtype=first.dtype, device=first.device))
        params = [*params, pad]
        nbytes = tensor_bytes(params)
        seconds, _ = optimizer_step(job, params, warmup, repeats, caches)
    small, _ = optimizer_step(job, smallest, warmup, repeats, caches)
    fixed = fixed_part(small, seconds, (tensor_bytes(smallest), nbytes))
    return _OptimizerCosts((seconds - fixed) / nbytes, fixed, ratio)


def _weight_copy_seconds_per_byte(layers: Mapping[int, nn.Module], warmup: int,
                                  repeats: int, caches: _Caches | None = None) -> float:
    """Keeping a weight version of `layers`, per parameter byte, with the runtime's own
    `WeightVersions` ([Note: weight versions] in pipefb.sim.program): each copy is held while
    the next `KEPT_COPIES - 1` are made, and the caches are emptied (if given) before
    each."""
    nbytes = tensor_bytes(params_of(list(layers.values())))
    if not nbytes:
        return 0.0
    versions, made = WeightVersions(), itertools.count()

    def copy() -> None:
        version = next(made)
        versions.keep(version, layers)
        versions.prune(range(version - KEPT_COPIES + 1, version + 1))

    evict = caches.evict if caches is not None else lambda: None
    return _mean_seconds(copy, max(warmup, KEPT_COPIES), repeats, evict) / nbytes


def optimizer_step(job: JobConfig, params: list[torch.Tensor], warmup: int, repeats: int,
                   caches: _Caches | None = None) -> tuple[float, float]:
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


def _measured_layer(seq: LayerSequence, i: int, out: TensorSpec, full: _Run, other: _Run | None,
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


def _timed_layers(layers: range | None, n_layers: int) -> range:
    """The layers to time: all by default, else a non-empty step-1 range inside 0..n."""
    if layers is None:
        return range(n_layers)
    if (not isinstance(layers, range) or layers.step != 1
            or not 0 <= layers.start < layers.stop <= n_layers):
        raise ConfigError(f"layers {layers!r} must be a non-empty range of step 1 within "
                          f"range(0, {n_layers}) (the loss layer included)")
    return layers
