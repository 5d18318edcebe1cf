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
scaling (`pipefb.runtime.lossscale`); it runs on CUDA only.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from pipefb.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")  # the values of JobConfig.precision
#: The dtype autocast computes in, for each precision that autocasts.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device | str) -> AbstractContextManager[object]:
    """The context a job's forwards run under: `torch.autocast` on `device`'s type with the
    precision's dtype, or nothing for fp32."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def check_precision(precision: object, device: str) -> None:
    """Refuses a precision that is not one of PRECISIONS, and fp16 off CUDA.

    Raises:
        ConfigError: naming the value.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
    if precision == "fp16" and device != "cuda":
        raise ConfigError(f"precision 'fp16' needs --device cuda (its loss scaling runs on "
                         f"CUDA only), not {device!r}; use bf16 on the cpu")
