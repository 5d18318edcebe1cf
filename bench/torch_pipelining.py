"""The torch.distributed.pipelining baseline: the same job, 2 gloo processes on 127.0.0.1.

Each rank builds its stage from a slice of `build_layers(job)` at the boundary the balanced
plan chooses; the loss layer (last) becomes the schedule's `loss_fn`. Same data (the step's
micro-batches concatenated in order), same optimizer, same micro-batching; torch's
`scale_grads` averages over micro-batches like the single-process reference. Each rank
also reports its peak memory counted as pipefb's ranks count theirs (`bench.saved_memory`).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from bench.saved_memory import SavedTensorMeter
from pipefb.allocator import keep_freed_memory
from pipefb.cpus import pin, share_out
from pipefb.job.config import JobConfig, build_layers
from pipefb.job.data import build_dataset
from pipefb.job.optim import build_optimizer, optimizer_state_bytes
from pipefb.memory import tensor_bytes

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
WORLD = 2  # two stages, one process each


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _batch(dataset: Any, job: JobConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's micro-batches, concatenated in order: what the schedule splits again."""
    parts = [dataset.microbatch(step, m, job.microbatch_size) for m in range(job.microbatches)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _stage_module(job: JobConfig, boundary: int, rank: int) -> tuple[nn.Module, nn.Module]:
    """(this rank's layers as one Sequential, the loss layer)."""
    layers = build_layers(job)
    body = layers[:boundary] if rank == 0 else layers[boundary:-1]
    return nn.Sequential(*body), layers[-1]


def _rank_main(rank: int, job_dict: dict[str, Any], boundary: int, schedule: str,
               port: int, threads: int, out_dir: str, cores: list[set[int]] | None) -> None:
    """One rank: trains `job.steps` steps, writes its step times (and losses) as JSON."""
    if cores:  # as a local cluster pins its workers ([Note: pinned workers]): like for like
        pin(cores[rank])
    if threads:
        torch.set_num_threads(threads)
    keep_freed_memory()  # as every pipefb worker does: like for like
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        job = JobConfig.from_dict(job_dict)
        module, loss_layer = _stage_module(job, boundary, rank)
        stage = PipelineStage(module, rank, WORLD, torch.device("cpu"))
        sched = SCHEDULES[schedule](stage, job.microbatches, loss_fn=loss_layer)
        params = list(module.parameters())
        opt = build_optimizer(job.optimizer, params, job.lr, job.optimizer_config)
        dataset = build_dataset(job.dataset, job.dataset_config, job.seed)
        meter = SavedTensorMeter(exclude=params)
        times, losses, peaks, saved = [], [], [], []
        for step in range(job.steps):
            dist.barrier()
            started = time.perf_counter()
            meter.reset_peak()
            x, y = _batch(dataset, job, step)
            step_losses: list[torch.Tensor] = []
            with meter:
                if rank == 0:
                    sched.step(x)
                else:
                    sched.step(target=y, losses=step_losses)
            held = tensor_bytes(params) + tensor_bytes(p.grad for p in params
                                                       if p.grad is not None)
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            times.append(time.perf_counter() - started)
            losses.append(float(torch.stack(step_losses).detach().mean()) if step_losses else 0.0)
            peaks.append(held + optimizer_state_bytes(opt) + meter.peak)
            saved.append(meter.peak)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
            "seconds": times, "losses": losses, "peak_memory_bytes": max(peaks),
            "activation_peak_bytes": max(saved)}))
    finally:
        dist.destroy_process_group()


def run(job: JobConfig, boundary: int, schedule: str = "1f1b", threads: int = 1,
        pin_cpus: bool = True) -> dict[str, Any]:
    """Runs the job on 2 spawned gloo ranks.

    Args:
        job: the job (its `steps`, `microbatches`, optimizer and data are used).
        boundary: first layer index of stage 1 (the balanced plan's cut).
        schedule: "1f1b" or "gpipe".
        threads: torch intra-op threads per rank (0: torch's default).
        pin_cpus: each rank runs on `threads` cores of its own where there are enough, as
            the workers of a local cluster do (not with torch's default thread count).

    Returns:
        `seconds`: per-step wall time (barrier to barrier, rank 0), `losses`: per-step mean
        loss over micro-batches (from the last stage), `ranks`: per rank, its peak of
        parameters + gradients + optimizer state + saved tensors (`peak`) and of saved
        tensors alone (`activation`), in bytes.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="torchpipe-") as out_dir:
        mp.start_processes(_rank_main, nprocs=WORLD, start_method="spawn",
                           args=(job.to_dict(), boundary, schedule, _free_port(), threads,
                                 out_dir, share_out(WORLD, threads) if pin_cpus else None))
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {"seconds": ranks[0]["seconds"], "losses": ranks[-1]["losses"],
            "ranks": {str(r): {"role": f"C{r}", "peak": d["peak_memory_bytes"],
                               "activation": d["activation_peak_bytes"]}
                      for r, d in enumerate(ranks)}}
