"""The `convnet` model: a small CNN for flat square grayscale images (8x8 digits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from pipefb.configparse import parse_config, require


@dataclass(frozen=True)
class ConvNetConfig:
    """Sizes of the `convnet` model; no BatchNorm, so layers hold no mutable buffers."""

    image_size: int = 8  # side of the square input, given flat as (B, image_size**2)
    channels1: int = 16  # output channels of the first 3x3 convolution
    channels2: int = 32  # output channels of the second 3x3 convolution (then 2x2 pool)
    hidden: int = 64  # width of the fully connected hidden layer
    classes: int = 10  # number of output logits

    def __post_init__(self) -> None:
        for key in ("channels1", "channels2", "hidden", "classes"):
            require(getattr(self, key) > 0, f"convnet {key}", getattr(self, key), "positive")
        require(self.image_size >= 2, "convnet image_size", self.image_size, ">= 2")


def build(config: dict[str, Any]) -> list[nn.Module]:
    """Returns the four layers: conv, conv + pool, flatten + linear, linear."""
    cfg = parse_config(ConvNetConfig, config, "model 'convnet'")
    side = cfg.image_size
    pooled = cfg.channels2 * (side // 2) ** 2
    return [
        nn.Sequential(  # (B, side*side) -> (B, c1, side, side)
            nn.Unflatten(1, (1, side, side)),
            nn.Conv2d(1, cfg.channels1, 3, padding=1),
            nn.ReLU(),
        ),
        nn.Sequential(  # -> (B, c2, side/2, side/2)
            nn.Conv2d(cfg.channels1, cfg.channels2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        ),
        nn.Sequential(nn.Flatten(), nn.Linear(pooled, cfg.hidden), nn.ReLU()),  # (B, hidden)
        nn.Linear(cfg.hidden, cfg.classes),  # (B, classes)
    ]
