"""Optimizers by name; purely per-parameter elementwise, so splitting parameters is exact.

[Note: split optimizers] No option here couples parameters, so an optimizer over a
subset of the parameters updates that subset exactly as one optimizer over all of them
would: backward workers each own one. The two things a step shares across parameters
are outside the optimizer and shared explicitly: the learning rate, a function of the
step number that every owner computes alike ([Note: learning-rate schedules] in
pipefb.job.lr), and gradient clipping by the global norm, whose per-parameter norms the
owners exchange before stepping ([Note: global norm] in pipefb.runtime.clipping).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pipefb.configparse import parse_config, require
from pipefb.errors import ConfigError


@dataclass(frozen=True)
class SGDConfig:
    """Hyper-parameters of `sgd` besides the learning rate."""

    momentum: float = 0.9  # heavy-ball momentum factor
    weight_decay: float = 0.0  # L2 penalty added to the gradient
    nesterov: bool = False  # Nesterov momentum (needs momentum > 0)
    fused: bool = True  # one kernel per parameter (faster; the same in every process)

    def __post_init__(self) -> None:
        require(self.momentum >= 0.0, "sgd momentum", self.momentum, ">= 0")
        require(self.weight_decay >= 0.0, "sgd weight_decay", self.weight_decay, ">= 0")
        require(
            not self.nesterov or self.momentum > 0,
            "sgd nesterov",
            self.nesterov,
            "False when momentum is 0",
        )


@dataclass(frozen=True)
class AdamWConfig:
    """Hyper-parameters of `adamw` besides the learning rate."""

    betas: tuple[float, float] = (0.9, 0.999)  # decay rates of the 1st and 2nd moments
    eps: float = 1e-8  # added to the denominator for numerical stability
    weight_decay: float = 0.01  # decoupled weight decay
    fused: bool = True  # one kernel per parameter, faster on CPU than the per-op loop

    def __post_init__(self) -> None:
        for beta in self.betas:
            require(0.0 <= beta < 1.0, "adamw betas", self.betas, "in [0, 1)")
        require(self.eps > 0.0, "adamw eps", self.eps, "> 0")
        require(self.weight_decay >= 0.0, "adamw weight_decay", self.weight_decay, ">= 0")


def _sgd(params: list[torch.Tensor], lr: float, config: dict[str, Any]) -> torch.optim.Optimizer:
    cfg = parse_config(SGDConfig, config, "optimizer 'sgd'")
    return torch.optim.SGD(params, lr=lr, **asdict(cfg))


def _adamw(params: list[torch.Tensor], lr: float, config: dict[str, Any]) -> torch.optim.Optimizer:
    cfg = parse_config(AdamWConfig, config, "optimizer 'adamw'")
    return torch.optim.AdamW(params, lr=lr, **asdict(cfg))


_OPTIMIZERS: dict[str, Callable[[list[torch.Tensor], float, dict[str, Any]], torch.optim.Optimizer]]
_OPTIMIZERS = {"sgd": _sgd, "adamw": _adamw}
OPTIMIZERS: tuple[str, ...] = tuple(_OPTIMIZERS)


def build_optimizer(
    name: str, params: Iterable[torch.Tensor], lr: float, config: dict[str, Any] | None = None
) -> torch.optim.Optimizer:
    """Builds optimizer `name` over `params`.

    Args:
        name: one of `OPTIMIZERS`.
        params: the tensors to update (may be a subset of a model's parameters).
        lr: the learning rate, finite and > 0.
        config: overrides of the optimizer's config defaults (`SGDConfig`, `AdamWConfig`).

    Returns:
        A torch optimizer.

    Raises:
        ConfigError: an unknown name, a bad learning rate, or a bad config key or value.
    """
    if name not in _OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; known optimizers: {list(OPTIMIZERS)}")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"learning rate {lr!r} must be a finite number > 0")
    return _OPTIMIZERS[name](list(params), float(lr), dict(config or {}))


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Returns the bytes of all tensors in the optimizer's per-parameter state."""
    return sum(
        value.numel() * value.element_size()
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
