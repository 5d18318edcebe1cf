"""Loss layers: the last layer of a layer sequence, taking the targets as second input."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pipefb.errors import ConfigError


class CrossEntropy(nn.Module):
    """Mean cross entropy over all leading dims: logits (..., K), int64 targets (...)."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # (N, K) logits against (N,) classes, N = product of the leading dims
        return F.cross_entropy(x.reshape(-1, x.shape[-1]), targets.reshape(-1))


class MSE(nn.Module):
    """Mean squared error between x and float targets of the same shape."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(x, targets)


_LOSSES: dict[str, type[nn.Module]] = {"cross_entropy": CrossEntropy, "mse": MSE}
LOSSES: tuple[str, ...] = tuple(_LOSSES)


def build_loss(name: str) -> nn.Module:
    """Builds the loss layer `name`, whose `forward(x, targets)` returns a scalar.

    Raises:
        ConfigError: `name` is not one of `LOSSES`.
    """
    if name not in _LOSSES:
        raise ConfigError(f"unknown loss {name!r}; known losses: {list(LOSSES)}")
    return _LOSSES[name]()
