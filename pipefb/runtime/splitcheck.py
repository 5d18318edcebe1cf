"""The submit check of a job's layers' explicit forward/backward splits, traced on the meta
device before any worker starts.

[Note: split at submit] A rank traces each of its layers' split when it is assigned
(`pipefb.runtime.layersplit.LayerSplit`): a layer whose split cannot be traced (a backward
that branches on tensor values, an output that carries no gradient back) passes the
shape check of `pipefb.job.checks` and fails only there, on every rank that holds it. So
the coordinator and the CLI trace, at submit, every layer that has a backward
(`pipefb.runtime.execs.trains`) the way a rank does, on the meta device: the layers of
`check_model` (shapes without storage) and example inputs of their input specs without
storage, so the check allocates nothing and stays within the same caps. Every schedule
but `single` is checked: any of its layers may land where it is split (a later stage,
whose weight grads wait; `offload` or `recompute`; a PipeFB rank; a layer move). Layers
alike (class, printed form, weights' and inputs' specs) are traced once. The trace runs
outside the job's autocast (meta tensors are never autocast), so a cast's own failure
shows on the rank only.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from pipefb.errors import ConfigError
from pipefb.job.checks import CheckedModel, check_model
from pipefb.job.config import JobConfig
from pipefb.job.shapes import TensorSpec
from pipefb.job.size import SizeLimits
from pipefb.runtime.capture import SplitError
from pipefb.runtime.execs import grad_flows, needs_grad, trains
from pipefb.runtime.layersplit import LayerSplit
from pipefb.schedule.kinds import runs_in_process

# what is wrong with a layer whose trace reads tensor values (shapes alone cannot say them)
_DATA = ("its forward or backward reads tensor values (Python control flow on a tensor, "
         ".item() or .tolist()), which the split's trace, on shapes alone, cannot follow; "
         "compute it with tensor ops (torch.where, clamp)")
_DATA_ERRORS = (DataDependentOutputException, DynamicOutputShapeException,
                GuardOnDataDependentSymNode)


def check_submit(config: JobConfig, limits: SizeLimits | None = None) -> CheckedModel:
    """Everything `pipefb.job.checks.check_model` checks, then every layer's split
    ([Note: split at submit]) unless the job runs in one process.

    Returns:
        The checked model: the placeholder planner's cost of each layer (loss included)
        and the lines to warn the job's submitter with.

    Raises:
        ConfigError: as `check_job`, or one line naming the first layer whose split
            cannot be traced (its index and class) and what is wrong.
    """
    model = check_model(config, limits)
    if not runs_in_process(config.schedule):
        check_splits(config, model)
    return model


def check_splits(config: JobConfig, model: CheckedModel) -> None:
    """Traces the split of every layer of `model` that has a backward, as a rank would.

    Raises:
        ConfigError: `model 'M': layer I (Class) cannot be split into its forward and
            backward parts: <what is wrong>`.
    """
    flows = grad_flows(model.layers)
    traced: set[tuple[object, ...]] = set()
    for i, (layer, specs) in enumerate(zip(model.layers, model.specs, strict=True)):
        needs = needs_grad(i, specs, flows[i])
        key = _likeness(layer, specs, needs)
        if not trains(layer, needs) or key in traced:
            continue
        reason = _split_failure(layer, specs, needs)
        if reason is not None:
            raise ConfigError(f"model {config.model!r}: layer {i} ({type(layer).__name__}) "
                              f"cannot be split into its forward and backward parts: {reason}")
        traced.add(key)


def _split_failure(layer: torch.nn.Module, specs: list[TensorSpec], needs: list[bool]
                   ) -> str | None:
    """What stops the split of `layer` (on the meta device), in one line; None if none."""
    try:
        with warnings.catch_warnings():  # torch warns of meta kernels it traces through
            warnings.simplefilter("ignore")
            # the cut too: a stage whose weight grads wait runs it ([Note: input grads first])
            LayerSplit(layer, specs, needs, device=torch.device("meta")).cut()
    except SplitError as error:
        return error.reason
    except _DATA_ERRORS:
        return _DATA
    except NotImplementedError:
        return None  # an op without a meta kernel: only the rank's own trace can tell
    except (RuntimeError, TypeError, ValueError, IndexError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"its forward and backward do not trace ({first or type(error).__name__})"
    return None


def _likeness(layer: torch.nn.Module, specs: Sequence[TensorSpec], needs: Sequence[bool]
              ) -> tuple[object, ...]:
    """What makes two layers' traces alike: class, printed form (the submodules and their
    options), each weight's name, shape, dtype and whether it trains, inputs and grads."""
    weights = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                    for n, t in [*layer.named_parameters(), *layer.named_buffers()])
    return type(layer), repr(layer), weights, tuple(specs), tuple(needs)
