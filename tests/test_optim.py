"""pipefb.job.optim: the named optimizers equal torch's own and split across workers exactly."""

from __future__ import annotations

import math

import pytest
import torch

from pipefb.errors import ConfigError
from pipefb.job.optim import OPTIMIZERS, build_optimizer, optimizer_state_bytes

TORCH = {
    "sgd": lambda p, lr, **kw: torch.optim.SGD(p, lr=lr, **kw),
    "adamw": lambda p, lr, **kw: torch.optim.AdamW(p, lr=lr, **kw),
}
DEFAULTS = {
    "sgd": {"momentum": 0.9, "weight_decay": 0.0, "nesterov": False, "fused": True},
    "adamw": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "fused": True},
}
CUSTOM = {  # also covers the unfused implementations
    "sgd": {"momentum": 0.5, "weight_decay": 0.1, "nesterov": True, "fused": False},
    "adamw": {"betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.0, "fused": False},
}


def make_params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in [(4, 3), (3,), (2, 2, 2), (5,)]]


def run(opt_params: list[torch.Tensor], opts: list[torch.optim.Optimizer], steps: int) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for p in opt_params:
            p.grad = torch.randn(p.shape, generator=gen)
        for opt in opts:
            opt.step()


def clone(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.clone().requires_grad_(True) for p in params]


def test_names() -> None:
    assert OPTIMIZERS == ("sgd", "adamw")


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("custom", [False, True])
def test_equals_torch(name: str, custom: bool) -> None:
    base = make_params()
    ours, theirs = clone(base), clone(base)
    config = CUSTOM[name] if custom else None
    kwargs = dict(CUSTOM[name] if custom else DEFAULTS[name])
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    opt = build_optimizer(name, ours, 0.05, config)
    assert isinstance(opt, type(TORCH[name]([torch.zeros(1, requires_grad=True)], 0.1)))
    run(ours, [opt], 3)
    run(theirs, [TORCH[name](theirs, 0.05, **kwargs)], 3)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], base[0])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_split_params_equal_one_optimizer(name: str) -> None:
    base = make_params(1)
    whole, split = clone(base), clone(base)
    run(whole, [build_optimizer(name, whole, 0.1)], 4)
    opts = [build_optimizer(name, split[:2], 0.1), build_optimizer(name, split[2:], 0.1)]
    run(split, opts, 4)
    for a, b in zip(whole, split, strict=True):
        assert torch.equal(a, b)


def test_state_bytes() -> None:
    params = clone(make_params())
    numel = sum(p.numel() for p in params)
    opt = build_optimizer("adamw", params, 0.1)
    assert optimizer_state_bytes(opt) == 0
    run(params, [opt], 1)
    # exp_avg and exp_avg_sq in float32 per parameter, plus a scalar step tensor each
    assert optimizer_state_bytes(opt) == 2 * 4 * numel + 4 * len(params)
    sgd = build_optimizer("sgd", clone(make_params()), 0.1)
    run(sgd.param_groups[0]["params"], [sgd], 1)
    assert optimizer_state_bytes(sgd) == 4 * numel  # momentum buffers


@pytest.mark.parametrize(
    ("name", "lr", "config", "needle"),
    [
        ("adam", 0.1, None, "'adam'.*'sgd', 'adamw'"),
        ("sgd", 0.0, None, "learning rate 0.0"),
        ("sgd", -1, None, "learning rate -1"),
        ("sgd", math.nan, None, "learning rate nan"),
        ("sgd", math.inf, None, "learning rate inf"),
        ("sgd", True, None, "learning rate True"),
        ("sgd", 0.1, {"beta": 0.9}, "'beta'.*'sgd'"),
        ("adamw", 0.1, {"momentum": 0.9}, "'momentum'.*'adamw'"),
        ("sgd", 0.1, {"momentum": -0.1}, "momentum = -0.1"),
        ("sgd", 0.1, {"momentum": 0.0, "nesterov": True}, "nesterov"),
        ("adamw", 0.1, {"betas": [0.9]}, "'betas'"),
        ("adamw", 0.1, {"betas": [0.9, 1.0]}, "betas"),
        ("adamw", 0.1, {"eps": "small"}, "'eps'"),
    ],
)
def test_errors_name_the_value(name: str, lr: float, config: dict | None, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_optimizer(name, clone(make_params()), lr, config)
