"""User-style models, written the ordinary ways, for the any-model tests: parameter-free,
frozen, buffered, in-place, tied, stochastic and float64 layers (digits: (N, 64) -> 10
classes; text: (N, T) bytes -> 256 classes). Each `build` takes a config dict."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Standardize(nn.Module):
    """Input standardisation without parameters: (x - 0.5) / 0.25."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - 0.5) / 0.25


class ToDouble(nn.Module):
    """Casts the input to float64."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


class AddInPlace(nn.Module):
    """An in-place op on an intermediate and on its own input."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        y.mul_(0.5)
        return y.add_(x)


class Block(nn.Module):
    """A residual MLP block over the last dim."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def relus(config: dict[str, Any]) -> list[nn.Module]:
    """Parameter-free layers first, in the middle, in a row and last."""
    h = int(config.get("hidden", 16))
    return [Standardize(), nn.Flatten(), nn.Linear(64, h), nn.ReLU(), nn.Dropout(0.0),
            nn.Linear(h, h), nn.ReLU(inplace=True), nn.Linear(h, 10), nn.LogSoftmax(dim=-1)]


def frozen(config: dict[str, Any]) -> list[nn.Module]:
    """A frozen first layer, a layer with only its bias frozen, a frozen middle layer."""
    h = int(config.get("hidden", 16))
    first, partial, middle = nn.Linear(64, h), nn.Linear(h, h), nn.Linear(h, h)
    first.requires_grad_(False)
    partial.bias.requires_grad_(False)
    middle.requires_grad_(False)
    return [first, nn.Tanh(), partial, middle, nn.Tanh(), nn.Linear(h, 10)]


def batchnorm(config: dict[str, Any]) -> list[nn.Module]:
    """BatchNorm1d between linear layers (buffers the forward mutates)."""
    h = int(config.get("hidden", 16))
    return [nn.Linear(64, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, h),
            nn.BatchNorm1d(h), nn.Linear(h, 10)]


def batchnorm_cumulative(config: dict[str, Any]) -> list[nn.Module]:
    """BatchNorm1d with momentum None: its running statistics are the cumulative average
    over every micro-batch so far (the factor is 1 / num_batches_tracked)."""
    h = int(config.get("hidden", 16))
    return [nn.Linear(64, h), nn.BatchNorm1d(h, momentum=None), nn.ReLU(), nn.Linear(h, 10)]


def convbn(config: dict[str, Any]) -> list[nn.Module]:
    """Conv + BatchNorm2d + pooling on the 8x8 images."""
    c = int(config.get("channels", 4))
    return [nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c),
            nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(c * 16, 10)]


def inplace(config: dict[str, Any]) -> list[nn.Module]:
    """In-place ops on intermediates and on a layer's own input."""
    h = int(config.get("hidden", 16))
    return [nn.Linear(64, h), AddInPlace(h), nn.ReLU(inplace=True), nn.Linear(h, 10)]


def dropout(config: dict[str, Any]) -> list[nn.Module]:
    """Dropout as its own layer and inside a layer."""
    h = int(config.get("hidden", 16))
    return [nn.Linear(64, h), nn.Dropout(0.2), nn.Sequential(nn.Linear(h, h), nn.Dropout(0.1)),
            nn.Linear(h, 10)]


def double(config: dict[str, Any]) -> list[nn.Module]:
    """float64 parameters behind a cast."""
    h = int(config.get("hidden", 16))
    return [ToDouble(), nn.Linear(64, h).double(), nn.Tanh(), nn.Linear(h, 10).double()]


def embed(config: dict[str, Any]) -> list[nn.Module]:
    """Byte text: an embedding with padding_idx first, residual blocks, a head."""
    d = int(config.get("dim", 16))
    return [nn.Embedding(256, d, padding_idx=0), Block(d), Block(d), nn.Linear(d, 256)]


def tied(config: dict[str, Any]) -> list[nn.Module]:
    """Byte text, GPT-2 style: the output head shares the embedding's weight."""
    d = int(config.get("dim", 16))
    embedding = nn.Embedding(256, d)
    head = nn.Linear(d, 256, bias=False)
    head.weight = embedding.weight
    return [embedding, Block(d), Block(d), head]


def tied3(config: dict[str, Any]) -> list[nn.Module]:
    """Byte text through three linear layers (with their own biases) that share one
    weight, between an embedding and a head: a parameter used on three stages."""
    d = int(config.get("dim", 16))
    first, second, third = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
    second.weight = third.weight = first.weight
    return [nn.Embedding(256, d), first, nn.Tanh(), second, nn.Tanh(), third,
            nn.Linear(d, 256)]


def transformer(config: dict[str, Any]) -> list[nn.Module]:
    """torch's own TransformerEncoderLayer between an embedding and a head."""
    d = int(config.get("dim", 16))
    layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=2 * d, dropout=0.0,
                                       batch_first=True)
    return [nn.Embedding(256, d), layer, nn.Linear(d, 256)]


class ToBFloat16(nn.Module):
    """Casts the input to bfloat16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.bfloat16()


class GRUOutput(nn.Module):
    """A wrapped nn.GRU: its output sequence, without the hidden state."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gru = nn.GRU(features, features, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return out


class SelfAttention(nn.Module):
    """torch's nn.MultiheadAttention over a sequence, causal."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(features, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        out, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return x + out


def bfloat16(config: dict[str, Any]) -> list[nn.Module]:
    """bfloat16 parameters behind a cast."""
    h = int(config.get("hidden", 16))
    return [ToBFloat16(), nn.Linear(64, h).bfloat16(), nn.Tanh(), nn.Linear(h, 10).bfloat16()]


def recurrent(config: dict[str, Any]) -> list[nn.Module]:
    """Byte text through a wrapped GRU and torch's MultiheadAttention."""
    d = int(config.get("dim", 16))
    return [nn.Embedding(256, d), GRUOutput(d), SelfAttention(d), nn.Linear(d, 256)]


def max_norm(config: dict[str, Any]) -> list[nn.Module]:
    """An embedding that renormalises its rows in place (max_norm)."""
    d = int(config.get("dim", 16))
    return [nn.Embedding(256, d, max_norm=1.0), Block(d), nn.Linear(d, 256)]


class Pair(nn.Module):
    """Returns a tuple of two tensors."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(64, features)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), x


class Join(nn.Module):
    """Takes the tuple `Pair` returns."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features + 64, 10)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(pair, dim=-1))


def pair(config: dict[str, Any]) -> list[nn.Module]:
    """A layer that hands the next one a tuple of tensors."""
    h = int(config.get("hidden", 16))
    return [Pair(h), Join(h)]


class InfiniteGrad(nn.Module):
    """Passes its input on unchanged (adds sqrt(0)), but its input gradient is infinite:
    d sqrt(u) / du at u = 0. A finite loss with a non-finite gradient norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(x - x.detach())


def inf_grad(config: dict[str, Any]) -> list[nn.Module]:
    """Digits through a layer whose gradient below it is infinite: the first linear
    layer's gradients are not finite, the last one's are."""
    h = int(config.get("hidden", 16))
    return [nn.Flatten(), nn.Linear(64, h), nn.Tanh(), InfiniteGrad(), nn.Linear(h, 10)]


def max_norm_late(config: dict[str, Any]) -> list[nn.Module]:
    """A renormalising embedding that is not the first layer."""
    d = int(config.get("dim", 16))
    return [nn.Identity(), nn.Embedding(256, d, max_norm=1.0), nn.Linear(d, 256)]


def max_norm_tied(config: dict[str, Any]) -> list[nn.Module]:
    """A renormalising embedding whose weight the head shares."""
    d = int(config.get("dim", 16))
    embedding = nn.Embedding(256, d, max_norm=1.0)
    head = nn.Linear(d, 256, bias=False)
    head.weight = embedding.weight
    return [embedding, Block(d), head]


class Lookup(nn.Module):
    """A renormalising embedding inside a layer of its own making."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(256, dim, max_norm=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding(x)


def max_norm_nested(config: dict[str, Any]) -> list[nn.Module]:
    """A renormalising embedding wrapped in a user's module."""
    d = int(config.get("dim", 16))
    return [Lookup(d), nn.Linear(d, 256)]


class Named(nn.Module):
    """Returns a dict of tensors."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(64, features)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": self.fc(x)}


class Unname(nn.Module):
    """Takes the dict `Named` returns."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, 10)

    def forward(self, named: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(named["h"])


def named(config: dict[str, Any]) -> list[nn.Module]:
    """A layer that hands the next one a dict of tensors."""
    h = int(config.get("hidden", 16))
    return [Named(h), Unname(h)]


class NoOutput(nn.Module):
    """Returns None (a forward that forgot its return)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> None:
        self.fc(x)


def no_output(config: dict[str, Any]) -> list[nn.Module]:
    """A layer that returns nothing."""
    return [NoOutput(), nn.Linear(16, 10)]


class WrongWidth(nn.Module):
    """A linear layer whose width does not fit the previous layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def wrong_width(config: dict[str, Any]) -> list[nn.Module]:
    """The second layer does not take the first one's output."""
    return [nn.Linear(64, 16), WrongWidth()]


class ScaleWeight(nn.Module):
    """Writes into its own parameter in its forward (not an embedding's renorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.mul_(0.5)
        return self.fc(x)


def scale_weight(config: dict[str, Any]) -> list[nn.Module]:
    """A layer whose forward writes into its parameter."""
    return [ScaleWeight()]


def max_norm_frozen(config: dict[str, Any]) -> list[nn.Module]:
    """A frozen embedding that renormalises its rows (pretrained, not trained here)."""
    d = int(config.get("dim", 16))
    embedding = nn.Embedding(256, d, max_norm=1.0)
    embedding.requires_grad_(False)
    return [embedding, Block(d), nn.Linear(d, 256)]


class _NormalisedGrad(torch.autograd.Function):
    """Identity forward; the backward scales a gradient whose largest entry exceeds 1 down
    to 1, deciding in Python on the gradient's values."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        largest = grad.abs().max()
        if largest > 1.0:
            return grad / largest
        return grad


class ClipGrad(nn.Module):
    """A custom autograd function whose backward branches on the gradient's values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NormalisedGrad.apply(x)


def value_backward(config: dict[str, Any]) -> list[nn.Module]:
    """Trains in one process; its second layer's backward cannot be traced on shapes."""
    return [nn.Linear(64, 16), ClipGrad(), nn.Linear(16, 10)]


class Detached(nn.Module):
    """Cuts the graph: its output carries no gradient back to its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x).detach()


def detached(config: dict[str, Any]) -> list[nn.Module]:
    """Trains in one process (the last layer learns); the middle layer has no backward."""
    return [nn.Linear(64, 16), Detached(), nn.Linear(16, 10)]
