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


class Stripes:
    """A user dataset: (size, 64) inputs whose targets (size, 10) are ten stripe means."""

    splits: tuple[str, ...] = ("train",)

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def microbatch(self, step: int, microbatch: int, size: int,
                   split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(hash((self.seed, step, microbatch)) & 0xFFFF_FFFF)
        x = torch.rand(size, 64, generator=gen)
        return x, x[:, :60].reshape(size, 10, 6).mean(dim=2)

    def held_out(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None


def stripes(config: dict[str, Any], seed: int, context: object) -> Stripes:
    """The pipefb.datasets entry point: (config, seed, context) -> a dataset."""
    return Stripes(seed)


def smooth_l1(config: dict[str, Any]) -> nn.Module:
    """The pipefb.losses entry point: config -> a loss layer (x, targets) -> scalar."""
    return nn.SmoothL1Loss(beta=float(config.get("beta", 1.0)))
