"""One busy process of the calibration's oversubscription probe (`calibration.crowding`).

Run as `python -m calibration.crowd SECONDS`: warms up one `gpt` block's forward and
backward (the bench's size, one torch thread), prints `ready`, waits for a line on stdin,
runs them for SECONDS and prints how many it ran. It imports torch and the model only (the
`calibration` package itself imports nothing), so the probe's processes start quickly.
"""

from __future__ import annotations

import sys
import time

import torch

from pipefb.models.gpt import Block, GPTConfig


def crowd(seconds: float) -> int:
    """Runs as the module docstring says; returns the runs it printed."""
    torch.set_num_threads(1)
    block = Block(GPTConfig(n_embd=128, n_head=4, block_size=64))
    x = torch.randn(8, 64, 128, requires_grad=True)
    for _ in range(3):
        block(x).sum().backward()
    print("ready", flush=True)
    sys.stdin.readline()
    end, runs = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        block(x).sum().backward()
        runs += 1
    print(runs, flush=True)
    return runs


if __name__ == "__main__":
    crowd(float(sys.argv[1]))
