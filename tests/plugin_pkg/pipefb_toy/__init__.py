"""A user model shipped as a separate distribution, found through the pipefb.models entry point."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Scale(nn.Module):
    """Multiplies by a learned per-feature scale."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def build(config: dict[str, Any]) -> list[nn.Module]:
    """Layers: Linear+Tanh, Scale, Linear (digits: 64 -> 10)."""
    hidden = int(config.get("hidden", 32))
    return [nn.Sequential(nn.Linear(64, hidden), nn.Tanh()), Scale(hidden), nn.Linear(hidden, 10)]
