"""The workers' allocator settings (pipefb.allocator): in a fresh process, a training step
that allocates and frees the same large activations stops paying page faults for them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)

#: a fresh process: optionally keep_freed_memory, then steps of a 1-rank gpt whose logits
#: (8 x 64 x 4096 fp32: 8 MiB per micro-batch) are beyond glibc's default mmap threshold;
#: prints (settings applied, minor faults per step after warm-up)
STEPS = r"""
import json, resource, sys
import torch
from calibration.overheads import _NoPeers
from pipefb.allocator import keep_freed_memory
from pipefb.job.config import JobConfig
from pipefb.job.checks import check_job
from pipefb.plan.partition import balanced_plan
from pipefb.runtime.stage import StageRuntime

applied = keep_freed_memory() if sys.argv[1] == "tuned" else False
torch.set_num_threads(1)
job = JobConfig(model="gpt", dataset="synthetic", loss="cross_entropy", schedule="gpipe",
                workers=1, batch_size=16, microbatches=2, steps=8, optimizer="adamw",
                model_config={"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 64,
                              "vocab_size": 4096},
                dataset_config={"task": "tokens", "vocab_size": 4096, "block_size": 64})
runtime = StageRuntime(job, balanced_plan("gpipe", 1, check_job(job), 16, 2), 0, _NoPeers())
for step in range(3):
    runtime.run_step(step)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(3, 8):
    runtime.run_step(step)
print(json.dumps([applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5]))
"""


#: 4 KiB pages of one micro-batch's logits (8 x 64 x 4096 fp32)
LOGITS_PAGES = 8 * 64 * 4096 * 4 // 4096


def faults_per_step(mode: str, script: str = STEPS) -> tuple[bool, float]:
    """Runs `script` in a fresh process with or without the settings: (applied, faults)."""
    out = subprocess.run([sys.executable, "-c", script, mode], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": ROOT}).stdout
    applied, faults = json.loads(out.splitlines()[-1])
    return applied, faults


def test_kept_freed_memory_spares_a_step_its_page_faults() -> None:
    tuned_applied, tuned = faults_per_step("tuned")
    default_applied, default = faults_per_step("default")
    assert tuned_applied and not default_applied
    # 2 micro-batches x 8 MiB of logits (and their gradients) are 4 KiB pages by the
    # thousand when fresh each step; reused, a step touches only a few new ones (an
    # occasional fresh block). glibc's dynamic mmap threshold makes both counts vary from
    # step to step, so the bound is one micro-batch's logits (2,048 pages), between them
    assert default > LOGITS_PAGES, default
    assert tuned < LOGITS_PAGES, (tuned, default)


#: a fresh process: optionally keep_freed_memory, then threads that come and go, each
#: allocating 4 MiB tensors (gRPC's event engine starts and ends threads as a worker trains);
#: prints (settings applied, minor faults per thread after warm-up)
THREADS = r"""
import json, resource, sys, threading
import torch
from pipefb.allocator import keep_freed_memory

applied = keep_freed_memory() if sys.argv[1] == "tuned" else False


def work():
    for _ in range(5):
        block = torch.ones(1 << 20)
        del block


def threads(n):
    for _ in range(n):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()


threads(5)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
threads(40)
print(json.dumps([applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 40]))
"""


def test_threads_that_come_and_go_reuse_the_heap() -> None:
    tuned_applied, tuned = faults_per_step("tuned", THREADS)
    _, default = faults_per_step("default", THREADS)
    assert tuned_applied
    # with an arena per thread, each new thread's heap is fresh: 5 x 4 MiB of new pages
    # (1,024 faults each); in the one heap only the thread's own stack and bookkeeping are
    # new, plus now and then one thread's 4 MiB block taken fresh. A tenth of the default
    # leaves room for those, and the thresholds alone (no arena limit) do not meet it
    assert default > 2000, default
    assert tuned < default / 10, (tuned, default)


#: a fresh process with the workers' settings: 256 MiB in 1 MiB tensors (from the heap), a
#: small tensor made after them (so the heap's top cannot shrink), all but it freed; prints
#: (resident MiB after the free, after release_freed_memory)
RELEASE = r"""
import json
import torch
from pipefb.allocator import keep_freed_memory, release_freed_memory
from tests.conftest import rss

assert keep_freed_memory()
blocks = [torch.ones(1 << 18) for _ in range(256)]
pin = torch.ones(16)
del blocks
import os
freed = rss(os.getpid()) / 2**20
assert release_freed_memory()
print(json.dumps([freed, rss(os.getpid()) / 2**20]))
"""


def test_released_memory_goes_back_to_the_kernel() -> None:
    """What a Profile RPC frees stays resident under the workers' settings until
    `release_freed_memory`."""
    out = subprocess.run([sys.executable, "-c", RELEASE], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": ROOT}).stdout
    freed, released = json.loads(out.splitlines()[-1])
    assert freed - released > 200, (freed, released)  # of the 256 MiB freed
