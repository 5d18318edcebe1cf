"""Loss layers: the last layer of a layer sequence, taking the targets as second input.

Built-in losses come first; user losses are found through the entry-point group
`pipefb.losses`, whose entry points load a callable `config: dict -> nn.Module` whose
`forward(x, targets)` returns a scalar.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipefb.configparse import parse_config, require
from pipefb.errors import ConfigError
from pipefb.plugins import find_builder, plugin_names

ENTRY_POINT_GROUP = "pipefb.losses"


@dataclass(frozen=True)
class CrossEntropyConfig:
    """Options of `cross_entropy`, as `torch.nn.functional.cross_entropy` takes them."""

    ignore_index: int = -100  # targets of this class add nothing to the loss or the mean
    label_smoothing: float = 0.0  # mass spread evenly over all classes, in [0, 1]

    def __post_init__(self) -> None:
        require(-(2**63) <= self.ignore_index < 2**63, "cross_entropy ignore_index",
                self.ignore_index, "an int64")
        require(0.0 <= self.label_smoothing <= 1.0, "cross_entropy label_smoothing",
                self.label_smoothing, "in [0, 1]")


class CrossEntropy(nn.Module):
    """Mean cross entropy over all leading dims: logits (..., K), int64 targets (...)."""

    def __init__(self, config: CrossEntropyConfig | None = None) -> None:
        super().__init__()
        self.config = config or CrossEntropyConfig()

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # (N, K) logits against (N,) classes, N = product of the leading dims
        return F.cross_entropy(x.reshape(-1, x.shape[-1]), targets.reshape(-1),
                               ignore_index=self.config.ignore_index,
                               label_smoothing=self.config.label_smoothing)


class MSE(nn.Module):
    """Mean squared error between x and float targets of the same shape."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(x, targets)


Builder = Callable[[dict[str, Any]], nn.Module]


def _cross_entropy(config: dict[str, Any]) -> nn.Module:
    return CrossEntropy(parse_config(CrossEntropyConfig, config, "loss 'cross_entropy'"))


def _mse(config: dict[str, Any]) -> nn.Module:
    parse_config(_NoOptions, config, "loss 'mse'")
    return MSE()


@dataclass(frozen=True)
class _NoOptions:
    """A loss without options."""


_LOSSES: dict[str, Builder] = {"cross_entropy": _cross_entropy, "mse": _mse}
LOSSES: tuple[str, ...] = tuple(_LOSSES)


def build_loss(name: str, config: dict[str, Any] | None = None) -> nn.Module:
    """Builds the loss layer `name`, whose `forward(x, targets)` returns a scalar.

    Args:
        name: one of `LOSSES` or an entry point of group `pipefb.losses`.
        config: JSON-able options (cross_entropy: ignore_index, label_smoothing).

    Raises:
        ConfigError: an unknown name, a bad option, or a plugin that fails to load or
            returns something other than a module.
    """
    builder: Builder = find_builder("loss", name, _LOSSES, ENTRY_POINT_GROUP,
                                    known_losses(), "losses")
    try:
        loss = builder(dict(config or {}))
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"loss {name!r} failed to build: {exc!r}") from exc
    if not isinstance(loss, nn.Module):
        raise ConfigError(f"loss {name!r} returned a {type(loss).__name__}, not a Module")
    return loss


def known_losses() -> tuple[str, ...]:
    """The built-in loss names followed by the installed plugins' names."""
    return LOSSES + tuple(plugin_names(ENTRY_POINT_GROUP, _LOSSES))
