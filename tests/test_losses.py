"""pipefb.job.losses: loss layers against torch's functional losses."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pipefb.errors import ConfigError
from pipefb.job.losses import LOSSES, build_loss


def test_names() -> None:
    assert LOSSES == ("cross_entropy", "mse")


def test_cross_entropy_flattens_leading_dims() -> None:
    logits = torch.randn(3, 5, 7, requires_grad=True)  # (B, T, vocab)
    targets = torch.randint(7, (3, 5))  # (B, T)
    loss = build_loss("cross_entropy")(logits, targets)
    assert loss.shape == ()
    expected = F.cross_entropy(logits.permute(0, 2, 1), targets)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape


def test_cross_entropy_2d_matches_torch() -> None:
    logits, targets = torch.randn(6, 10), torch.randint(10, (6,))
    torch.testing.assert_close(
        build_loss("cross_entropy")(logits, targets), F.cross_entropy(logits, targets)
    )


def test_mse() -> None:
    x, y = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 0.0], [3.0, 8.0]])
    loss = build_loss("mse")(x, y)
    assert loss.shape == () and loss.item() == pytest.approx((4 + 16) / 4)


def test_fresh_module_per_call() -> None:
    assert build_loss("mse") is not build_loss("mse")


def test_unknown_loss() -> None:
    with pytest.raises(ConfigError, match=r"'nll'.*'cross_entropy', 'mse'"):
        build_loss("nll")
