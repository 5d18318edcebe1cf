"""Times LayerSplit.backward from a stash against eager backward of the same layers alone.

Target: backward-only worker compute within 15% of the same layers' backward alone
(ratio split / eager <= 1.15). Run: `python bench/backward_split.py [--threads 1]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipefb.job.shapes import TensorSpec, infer_input_specs
from pipefb.models.gpt import Block, GPTConfig
from pipefb.runtime.layersplit import LayerSplit

TARGET = 1.15  # backward-only worker compute within 15% of the same layers' backward alone


def gpt_stage(args: argparse.Namespace) -> tuple[list[nn.Module], TensorSpec]:
    """Two transformer blocks on (B, T, C) activations."""
    cfg = GPTConfig(block_size=args.seq, n_embd=args.channels, n_head=args.heads)
    layers: list[nn.Module] = [Block(cfg) for _ in range(2)]
    return layers, TensorSpec((args.batch, args.seq, args.channels), torch.float32)


def mlp_stage(args: argparse.Namespace) -> tuple[list[nn.Module], TensorSpec]:
    """Three Linear+ReLU layers on (B*T, 4C) activations."""
    width = 4 * args.channels
    layers: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(3)]
    return layers, TensorSpec((args.batch * args.seq, width), torch.float32)


def eager_backward(
    layers: list[nn.Module], x: torch.Tensor, grad: torch.Tensor
) -> Callable[[], float]:
    """A timer of `torch.autograd.backward` alone; the graph is built before the clock."""

    def run() -> float:
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        out = x.detach().requires_grad_()
        for layer in layers:
            out = layer(out)
        start = time.perf_counter()
        torch.autograd.backward(out, grad)
        return time.perf_counter() - start

    return run


def split_backward(
    layers: list[nn.Module], x: torch.Tensor, grad: torch.Tensor, new_version: bool
) -> Callable[[], float]:
    """A timer of the backward worker: LayerSplit.backward from stashes, last layer first."""
    specs = infer_input_specs(layers, TensorSpec(tuple(x.shape), x.dtype), None)
    splits = [LayerSplit(layer, s) for layer, s in zip(layers, specs, strict=True)]

    def run() -> float:
        if new_version:  # an in-place update: weight-derived tensors are derived again
            with torch.no_grad():
                for layer in layers:
                    for p in layer.parameters():
                        p.add_(0.0)
        out, stashes = x, []
        for split in splits:
            out, stash = split.forward([out])
            stashes.append(stash)
        start = time.perf_counter()
        g = grad
        for split, stash in zip(reversed(splits), reversed(stashes), strict=True):
            input_grads, _ = split.backward(stash, g)
            g = input_grads[0]
        return time.perf_counter() - start

    return run


def measure(name: str, stage: tuple[list[nn.Module], TensorSpec], args: argparse.Namespace) -> None:
    """Interleaves eager and split runs and prints medians, ranges and the ratio."""
    layers, spec = stage
    x = torch.randn(spec.shape)
    grad = torch.randn(spec.shape)
    timers = {
        "eager backward": eager_backward(layers, x, grad),
        "split backward": split_backward(layers, x, grad, new_version=False),
        "split, new weight version": split_backward(layers, x, grad, new_version=True),
    }
    times: dict[str, list[float]] = {k: [] for k in timers}
    for i in range(args.warmup + args.runs):
        for key, timer in timers.items():
            seconds = timer()
            if i >= args.warmup:
                times[key].append(seconds)
    base = times["eager backward"]
    print(f"\n{name}: input {list(spec.shape)}, {args.runs} runs after {args.warmup} warm-up")
    for key, values in times.items():
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        print(
            f"  {key:27s} median {1e3 * statistics.median(values):8.3f} ms "
            f"[{1e3 * min(values):.3f}-{1e3 * max(values):.3f}]  ratio median "
            f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
        )
    verdict = (
        "meets"
        if statistics.median(times["split backward"]) <= TARGET * statistics.median(base)
        else "MISSES"
    )
    print(f"  target split/eager <= {TARGET:.2f}: {verdict}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the bench's flags."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    parser.add_argument("--channels", type=int, default=128, help="C, the model width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--batch", type=int, default=8, help="B, micro-batch size")
    parser.add_argument("--seq", type=int, default=64, help="T, sequence length")
    parser.add_argument("--runs", type=int, default=30, help="timed runs (>= 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Runs the bench for a GPT stage and an MLP stage."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); target: "
        f"backward-only worker compute within 15% of the same layers' backward alone"
    )
    measure(f"gpt stage (2 blocks, C={args.channels})", gpt_stage(args), args)
    measure("mlp stage (3 x Linear+ReLU)", mlp_stage(args), args)


if __name__ == "__main__":
    main()
