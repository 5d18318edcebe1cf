"""The `gpt` model: a tiny nanoGPT-style decoder split into embedding, blocks and head.

Attention is written out by hand (no `scaled_dot_product_attention`) so every layer
traces under AOTAutograd on any device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipefb.configparse import parse_config, require

_INIT_STD = 0.02  # nanoGPT's std for every Linear and Embedding weight


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the `gpt` model (nanoGPT's GPTConfig, scaled down)."""

    vocab_size: int = 256  # byte-level tokens
    block_size: int = 32  # longest sequence (context length)
    n_layer: int = 2  # number of transformer blocks
    n_head: int = 2  # attention heads per block
    n_embd: int = 32  # embedding width C; must be divisible by n_head
    dropout: float = 0.0  # dropout probability in embedding, attention and MLP
    bias: bool = True  # biases in Linear and LayerNorm layers
    # the head's lm_head uses the token embedding's weight (GPT-2's tied embeddings): one
    # parameter on the first and the last layer ([Note: tied parameters])
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            require(getattr(self, key) > 0, f"gpt {key}", getattr(self, key), "positive")
        require(
            self.n_embd % self.n_head == 0,
            "gpt n_embd",
            self.n_embd,
            f"divisible by n_head = {self.n_head}",
        )
        require(0.0 <= self.dropout < 1.0, "gpt dropout", self.dropout, "in [0, 1)")


class Embedding(nn.Module):
    """Token plus learned position embedding: int64 (B, T) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape  # (B, T)
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, dtype=torch.long, device=idx.device)  # (T,)
        out: torch.Tensor = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        return out


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: (B, T, C) -> (B, T, C)."""

    mask: torch.Tensor  # (1, 1, block_size, block_size) bool, True where attending is allowed

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer(
            "mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        hs = c // self.n_head
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 x (B, T, C)
        q = q.view(b, t, self.n_head, hs).transpose(1, 2)  # (B, H, T, hs)
        k = k.view(b, t, self.n_head, hs).transpose(1, 2)  # (B, H, T, hs)
        v = v.view(b, t, self.n_head, hs).transpose(1, 2)  # (B, H, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, H, T, T)
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        out: torch.Tensor = self.resid_dropout(self.c_proj(y))
        return out


class MLP(nn.Module):
    """Position-wise feed-forward, 4x wide with GELU: (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block with residuals: (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class Head(nn.Module):
    """Final LayerNorm and lm_head (tied to the token embedding with `tie_embeddings`):
    (B, T, C) -> logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return out


def build(config: dict[str, Any]) -> list[nn.Module]:
    """Returns [Embedding, Block x n_layer, Head] with nanoGPT's initialisation (the head
    tied to the token embedding with `tie_embeddings`)."""
    cfg = parse_config(GPTConfig, config, "model 'gpt'")
    layers: list[nn.Module] = [Embedding(cfg), *(Block(cfg) for _ in range(cfg.n_layer)), Head(cfg)]
    for layer in layers:
        layer.apply(_init_weights)
        for name, param in layer.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled residual projections (GPT-2)
                nn.init.normal_(param, mean=0.0, std=_INIT_STD / math.sqrt(2 * cfg.n_layer))
    if cfg.tie_embeddings:
        embedding, head = layers[0], layers[-1]
        assert isinstance(embedding, Embedding) and isinstance(head, Head)
        head.lm_head.weight = embedding.wte.weight  # (vocab, C) both ways
    return layers


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
