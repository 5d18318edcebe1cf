"""The `mlp` model: a stack of Linear + ReLU hidden layers and a final Linear."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from torch import nn

from pipefb.configparse import parse_config, require


@dataclass(frozen=True)
class MLPConfig:
    """Sizes of the `mlp` model."""

    in_features: int = 64  # width of each input row, e.g. the 8x8 digits flattened
    hidden: int = 128  # width of every hidden layer
    depth: int = 3  # number of hidden (Linear + ReLU) layers; 0 gives one Linear
    out_features: int = 10  # width of the output: class logits or regression targets

    def __post_init__(self) -> None:
        for key in ("in_features", "hidden", "out_features"):
            require(getattr(self, key) > 0, f"mlp {key}", getattr(self, key), "positive")
        require(self.depth >= 0, "mlp depth", self.depth, ">= 0")


def build(config: dict[str, Any]) -> list[nn.Module]:
    """Returns `depth` x Sequential(Linear, ReLU) then Linear: (B, in) -> (B, out)."""
    cfg = parse_config(MLPConfig, config, "model 'mlp'")
    widths = [cfg.in_features] + [cfg.hidden] * cfg.depth
    layers: list[nn.Module] = [
        nn.Sequential(nn.Linear(w_in, w_out), nn.ReLU())
        for w_in, w_out in itertools.pairwise(widths)
    ]
    layers.append(nn.Linear(widths[-1], cfg.out_features))
    return layers
