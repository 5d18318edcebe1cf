"""Mixed precision: the autocast a job's layers compute under, by the job's `precision`.

[Note: mixed precision] `bf16` and `fp16` run every layer's forward under
`torch.autocast` (on the job's device type), exactly as one process does around its whole
forward: the parameters and the optimizer state stay float32 (master weights), autocast
casts them to the low dtype inside the ops it covers, and each layer's output keeps the
dtype autocast gave it. A layer's explicit forward/backward split
(`pipefb.runtime.layersplit`) is traced under the same autocast, so its graphs hold the
casts as ops: they run without autocast, the casts of the weights are derived from the
weights on the backward rank (never stashed), and the saved tensors, the activations sent
to the next stage and the stash in the offload store keep their autocast dtype (half the
bytes of float32 where autocast gave bfloat16 or float16). Shape propagation runs under
the same autocast, so every rank expects the dtypes it will receive. `fp16` adds loss
scaling (`pipefb.runtime.lossscale`). Both run on the cpu and on CUDA: the cpu's autocast
takes float16 as it takes bfloat16, and torch's non-finite check and unscale (what
`torch.amp.GradScaler` runs) have cpu kernels.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext

import torch

from pipefb.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")  # the values of JobConfig.precision
#: The dtype autocast computes in, for each precision that autocasts.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# fp16's loss scaling starts from torch.amp.GradScaler's defaults
INITIAL_LOSS_SCALE = 2.0**16  # the first step's scale (JobConfig.initial_loss_scale)
LOSS_SCALE_WINDOW = 2000  # finite steps in a row before the scale doubles
# (JobConfig.loss_scale_window; GradScaler's growth_interval)


def autocast(precision: str, device: torch.device | str) -> AbstractContextManager[object]:
    """The context a job's forwards run under: `torch.autocast` on `device`'s type with the
    precision's dtype, or nothing for fp32."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def check_precision(precision: object) -> None:
    """Refuses a precision that is not one of PRECISIONS (each runs on every device).

    Raises:
        ConfigError: naming the value.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")


def check_loss_scaling(precision: str, initial_scale: object, window: object) -> None:
    """Refuses an fp16 loss scale that is not a finite number > 0, a window that is not an
    integer >= 1, and either set to other than its default on a job that is not fp16
    (where nothing would use it).

    Raises:
        ConfigError: naming the value.
    """
    if isinstance(initial_scale, bool) or not isinstance(initial_scale, int | float) or not (
            math.isfinite(initial_scale) and initial_scale > 0):
        raise ConfigError(f"initial_loss_scale {initial_scale!r} must be a finite number > 0")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"loss_scale_window {window!r} must be an integer >= 1")
    if precision != "fp16":
        for name, value, default in (("initial_loss_scale", initial_scale, INITIAL_LOSS_SCALE),
                                     ("loss_scale_window", window, LOSS_SCALE_WINDOW)):
            if value != default:
                raise ConfigError(f"{name} {value!r} applies to precision 'fp16' only; "
                                  f"this job's is {precision!r}")
