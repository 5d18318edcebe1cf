"""Submit-time checks of a job: builds its model, loss, data and optimizer once, checks they fit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipefb.errors import ConfigError
from pipefb.job.config import AUTO, JobConfig, layer_costs, layer_policies, slowdowns
from pipefb.job.shapes import TensorSpec
from pipefb.job.size import SizeLimits, check_activations, check_parameters, meta_layers
from pipefb.schedule.kinds import runs_in_process, schedule_kind


@dataclass(frozen=True)
class CheckedModel:
    """A job's model as `check_model` built and checked it.

    Attributes:
        layers: the layer sequence on the meta device (loss included).
        specs: each layer's input specs, propagated from a micro-batch's.
        costs: the placeholder planner's cost of each layer.
        warnings: what the job will do unlike one process, one line each (it runs).
    """

    layers: list[torch.nn.Module]
    specs: list[list[TensorSpec]]
    costs: list[float]
    warnings: list[str]


def check_job(config: JobConfig, limits: SizeLimits | None = None) -> list[float]:
    """`check_model`'s checks; returns the placeholder planner's cost of each layer (loss
    included), so the model need not be built again to plan.

    Raises:
        ConfigError: as `check_model`.
    """
    return check_model(config, limits).costs


def check_model(config: JobConfig, limits: SizeLimits | None = None) -> CheckedModel:
    """Checks every name and config by building the model (on the meta device: shapes,
    no storage), loss and dataset once, and its size against `limits` before anything
    of the model is allocated ([Note: size at submit] in pipefb.job.size).

    Args:
        config: the job.
        limits: caps on layers, parameters and a step's activation bytes; None: the
            `SizeLimits` defaults.

    Returns:
        The model's layers, their input specs and their costs.

    Raises:
        ConfigError: naming the bad value (unknown name, bad option, too many stages), or
            the model's layers do not take the dataset's micro-batches, or the loss gives
            no scalar (shapes propagated with fake tensors: nothing is computed), or the
            model or its activations exceed `limits`.
    """
    from pipefb.job.data import job_dataset
    from pipefb.job.optim import build_optimizer
    from pipefb.job.shapes import (
        OutputError,
        SpecError,
        infer_input_specs,
        spec_of,
        written_parameters,
    )

    limits = limits or SizeLimits()
    layers = meta_layers(config)
    check_parameters(config, layers, limits)
    check_tied_parameters(config, layers)
    check_cumulative_statistics(config, layers)
    dataset = job_dataset(config, check_all=True)  # paths, windows, token ids
    x, y = dataset.microbatch(0, 0, config.microbatch_size)
    try:  # the model, data and loss fit together
        specs = infer_input_specs(layers, spec_of(x), spec_of(y))
    except OutputError as error:
        raise ConfigError(f"model {config.model!r}: {error}") from None
    except SpecError as error:
        raise ConfigError(f"model {config.model!r}, dataset {config.dataset!r} and loss "
                          f"{config.loss!r} do not fit: {error}") from None
    check_activations(config, specs, limits)
    for i, (module, layer_specs) in enumerate(zip(layers, specs, strict=True)):
        written = written_parameters(module, layer_specs)
        if written:
            check_written_parameters(config, layers, i, written[0])
    build_optimizer(config.optimizer, [torch.zeros(1, requires_grad=True)], config.lr,
                    config.optimizer_config)
    if config.plan != AUTO:
        layer_policies(config, len(layers))
    for layer in slowdowns(config.slowdown, layers=True):
        if layer >= len(layers):
            raise ConfigError(f"slowdown names layer {layer}; model {config.model!r} has "
                              f"layers 0..{len(layers) - 1} (loss included)")
    if config.schedule != AUTO and not runs_in_process(config.schedule):
        stages = max(schedule_kind(config.schedule).stage_counts(config.workers))
        if stages > len(layers):
            raise ConfigError(
                f"{config.workers} workers make {stages} stages but the model has only "
                f"{len(layers)} layers (loss included)"
            )
    return CheckedModel(layers, specs, layer_costs(layers),
                        [w for w in [group_statistics_warning(config, layers, specs)] if w])


def group_statistics_warning(config: JobConfig, layers: list[torch.nn.Module],
                             specs: list[list[TensorSpec]]) -> str | None:
    """The line that says a job with several pipeline groups does not end with one
    process's buffer statistics, or None where it does. Each group's forwards update the
    statistics of their own micro-batches only ([Note: mutated buffers] in
    pipefb.runtime.layersplit); the ranks replay one process's updates of a float32
    BatchNorm computed on the cpu in a sync schedule at fp32 precision ([Note: group
    statistics] in pipefb.runtime.groupstats). Any other buffer-writing layer keeps its
    group's statistics, and the exported, checkpointed and evaluated ones are group 0's.
    The parameters and losses are not affected (a training forward normalises by its
    micro-batch's own statistics)."""
    from pipefb.job.shapes import replays_statistics, written_buffers

    if config.groups == 1:
        return None
    job_reason = _statistics_not_replayed(config)
    written = [f"{i} ({type(layer).__name__})" for i, (layer, layer_specs)
               in enumerate(zip(layers, specs, strict=True))
               if written_buffers(layer, layer_specs)
               and (job_reason or not replays_statistics(layer, layer_specs))]
    if not written:
        return None
    groups = (f"with {config.groups} groups" if config.groups > 1
              else "if the planner picks several groups")
    reason = job_reason or "one process's are replayed for float32 nn.BatchNorm layers only"
    return (f"model {config.model!r}: layer{'s' * (len(written) > 1)} {', '.join(written)} "
            f"update{'s' * (len(written) == 1)} buffers in the forward (running statistics); "
            f"{groups} each group's statistics follow only its own micro-batches ({reason}), "
            "and the exported, checkpointed and evaluated ones are group 0's, not where one "
            "process leaves them (parameters and training losses are not affected)")


def _statistics_not_replayed(config: JobConfig) -> str | None:
    """Why a job's ranks do not replay one process's BatchNorm statistics, or None where
    they do (`pipefb.runtime.groupstats.replays_on`)."""
    if config.device != "cpu":
        return f"one process's are replayed on the cpu only, not on {config.device}"
    if config.mode != "sync" or config.schedule == "pipedream":
        what = "pipedream" if config.schedule == "pipedream" else f"{config.mode} mode"
        return f"one process's are replayed in sync schedules only, not in {what}"
    if config.precision != "fp32":
        return f"one process's are replayed at fp32 precision only, not at {config.precision}"
    return None


def check_cumulative_statistics(config: JobConfig, layers: list[torch.nn.Module]) -> None:
    """Refuses a BatchNorm with momentum None: its forward takes the factor of its
    cumulative average, 1 / num_batches_tracked, from a buffer's value, which the traces
    on shapes alone (the submit's shape check, a rank's split) cannot follow.

    Raises:
        ConfigError: naming the layer index and class.
    """
    norm = torch.nn.modules.batchnorm._BatchNorm
    for i, layer in enumerate(layers):
        if isinstance(layer, norm) and layer.track_running_stats and layer.momentum is None:
            raise ConfigError(
                f"model {config.model!r}: layer {i} ({type(layer).__name__}) has momentum "
                "None (a cumulative average, whose factor 1 / num_batches_tracked is read "
                "from a buffer's value, which pipefb's traces on shapes alone cannot "
                "follow): not supported; give it a momentum (torch's default is 0.1)")


def check_tied_parameters(config: JobConfig, layers: list[torch.nn.Module]) -> None:
    """Refuses a parameter that two layers share (tied weights, such as a GPT-2 head that
    reuses the embedding) where the job cannot train it exactly: in `async` mode, where
    each use's owner would update its copy from gradients of other weight versions at
    other times, so the copies would part. In `sync` mode the owners of the copies sum
    their gradients and step them alike ([Note: tied parameters] in
    pipefb.runtime.tied).

    Raises:
        ConfigError: naming both layers, their classes and the parameter.
    """
    if config.mode != "async":
        return
    first: dict[int, tuple[int, str]] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            seen = first.setdefault(id(p), (i, name))
            if seen[0] != i:
                j, other = seen
                raise ConfigError(
                    f"model {config.model!r}: layer {j} ({type(layers[j]).__name__}) "
                    f"parameter {other!r} is also layer {i} ({type(layer).__name__}) "
                    f"parameter {name!r}; tied parameters train in sync mode only, and "
                    f"schedule {config.schedule!r} runs in async mode here")


def check_written_parameters(config: JobConfig, layers: list[torch.nn.Module], i: int,
                             written: str) -> None:
    """Refuses a forward that writes into a parameter of layer `i` (`written`, found on
    fake tensors) unless the runtime can replay the write exactly: an `nn.Embedding`
    with `max_norm` as the first layer, untied, not in async PipeFB ([Note: renormalised
    rows] in pipefb.runtime.renorm).

    Raises:
        ConfigError: naming the layer, its class and what is wrong.
    """
    from pipefb.job.shapes import renorms_rows

    module = layers[i]
    what = f"model {config.model!r}: layer {i} ({type(module).__name__})"
    if not renorms_rows(module):
        raise ConfigError(
            f"{what} writes into its parameter {written!r} in its forward, which a pipeline "
            "whose weights live on another rank cannot follow: not supported (only an "
            "nn.Embedding with max_norm, as the first layer, may)")
    renorm = f"{what} renormalises its rows in its forward (max_norm)"
    if i != 0:
        raise ConfigError(f"{renorm} but is not the first layer: only the first layer's "
                          "ids are the data every rank can draw to replay it; put it first")
    assert isinstance(module, torch.nn.Embedding)  # renorms_rows says so
    weight = id(module.weight)
    for j, other in enumerate(layers):
        shared = [n for n, p in other.named_parameters() if id(p) == weight]
        if j != i and shared:
            raise ConfigError(f"{renorm} and its weight is also layer {j} "
                              f"({type(other).__name__}) parameter {shared[0]!r}: not "
                              "supported (that layer's rank would not see the renormalised "
                              "rows when one process's does)")
    split = config.schedule == AUTO or schedule_kind(config.schedule).separate_partitions
    if config.mode == "async" and split and not runs_in_process(config.schedule):
        raise ConfigError(f"{renorm}, which async PipeFB cannot follow: its forward ranks "
                          "would renormalise an old weight version while the owner updates "
                          "the newest; run it in sync mode or with pipedream")
