"""fp16 loss scaling ([Note: loss scaling]), checked on the cpu: one owner's scale follows
torch.amp.GradScaler step for step, and an overflow on one owner of a real gloo group is
seen by every owner; its checkpoint entry round-trips and a malformed one is refused.
Whole fp16 jobs are in tests/test_fp16.py."""

from __future__ import annotations

import math
import re
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig
from pipefb.job.optim import build_optimizer
from pipefb.runtime.allreduce import GroupAllReduce
from pipefb.runtime.clipping import GlobalNormClip
from pipefb.runtime.execs import AutogradExec
from pipefb.runtime.lossscale import METADATA_KEY, LossScale
from pipefb.runtime.state import RankState

# each step's true gradients of two parameters; None: the first one overflows
STEPS: list[list[float] | None] = [[1.0, -2.0], [0.5, 3.0], None, [0.25, 1e-3], [1.0, 1.0],
                                   None, None, [2.0, 7.0], [1.5, -0.5], [3.0, 4.0]]


def test_one_owner_follows_torchs_grad_scaler_step_for_step() -> None:
    mine = LossScale(torch.device("cpu"), None, init_scale=2.0**10, growth_interval=2)
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    optimizer = torch.optim.SGD(params, lr=0.1)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    mine_params = [p.detach().clone().requires_grad_() for p in params]
    scales = []
    for values in STEPS:
        assert mine.scale == float(torch_scaler.scale(torch.ones(())))  # torch's scale
        scales.append(mine.scale)
        for ps, scale in ((params, torch_scaler.get_scale()), (mine_params, mine.scale)):
            for k, p in enumerate(ps):
                value = math.inf if values is None and k == 0 else (values or [0, 0])[k]
                p.grad = torch.full_like(p, value * scale)
        torch_scaler.unscale_(optimizer)
        overflowed = mine.unscale_(mine_params)
        for p, q in zip(params, mine_params, strict=True):
            assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
        before = torch_scaler.get_scale()
        torch_scaler.step(optimizer)
        torch_scaler.update()
        mine.update(overflowed)
        assert overflowed == (values is None) == (torch_scaler.get_scale() < before)
        optimizer.zero_grad()
    # halved after each overflow, doubled after two finite steps in a row
    assert scales == [2.0**10, 2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11, 2.0**10,
                      2.0**9, 2.0**9, 2.0**10]


def test_an_overflow_on_one_owner_skips_the_step_on_every_owner() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True,  # type: ignore[attr-defined]
                          wait_for_workers=False)
    grads = [torch.tensor([4.0, 8.0]), torch.tensor([math.inf, 2.0])]
    out: list[Any] = [None, None]

    def owner(rank: int) -> None:
        group = GroupAllReduce(f"127.0.0.1:{store.port}", "s/", rank, 2, torch.device("cpu"),
                               timeout_seconds=20)
        scale = LossScale(torch.device("cpu"), group, init_scale=4.0)
        p = torch.zeros(2, requires_grad=True)
        p.grad = grads[rank].clone()
        overflowed = scale.unscale_([p])
        scale.update(overflowed)
        out[rank] = (overflowed, scale.scale, p.grad)
        group.close()

    threads = [threading.Thread(target=owner, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0][:2] == out[1][:2] == (True, 2.0)  # both skip and halve the scale
    assert torch.equal(out[0][2], torch.tensor([1.0, 2.0]))  # unscaled: 1 / 4


def test_an_owners_optimizer_step_unscales_clips_and_skips_as_torch_does() -> None:
    """`RankState.step` with a scale (what an fp16 owner runs at OPT) against one process
    with torch's GradScaler and clip_grad_norm_: the same weights after every step, the
    same steps skipped."""
    job = JobConfig(model="mlp", dataset="digits", schedule="1f1b", workers=2,
                    optimizer="adamw", lr=0.01, steps=len(STEPS), clip_grad_norm=0.5)
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    theirs = torch.nn.Linear(3, 2)
    theirs.load_state_dict(layer.state_dict())
    scale = LossScale(torch.device("cpu"), None, init_scale=2.0**10, growth_interval=2)
    state = RankState(job, 0, {0: layer}, {0: AutogradExec(layer, [False])}, range(1),
                      range(1), scale)
    params = list(layer.parameters())
    clip = GlobalNormClip(0.5, [0, 1], 2, torch.float32, torch.device("cpu"), None)
    optimizer = build_optimizer("adamw", list(theirs.parameters()), 0.01, {})  # the job's
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for step, values in enumerate(STEPS):
        grads = [torch.full_like(p, math.inf if values is None else values[0]) for p in params]
        if values is not None:
            grads[1] = torch.full_like(params[1], values[1])
        s = float(scaler.scale(torch.ones(())))
        for p, q, g in zip(params, theirs.parameters(), grads, strict=True):
            p.grad, q.grad = g * scale.scale, g * s
        done = state.step(step, set(), None, clip)
        scaler.unscale_(optimizer)
        norm = float(torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), 0.5))
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        assert done.skipped == (scaler.get_scale() < before) == (values is None)
        assert done.grad_norm == norm or not math.isfinite(norm)
        for p, q in zip(params, theirs.parameters(), strict=True):
            assert torch.equal(p, q)


def test_the_scale_round_trips_through_a_rank_files_metadata() -> None:
    saved = LossScale(torch.device("cpu"), None, init_scale=2.0**10, growth_interval=3)
    saved.update(True)
    saved.update(False)
    restored = LossScale(torch.device("cpu"), None, growth_interval=3)
    restored.load(saved.metadata(), "checkpoint of step 2")
    assert (restored.scale, restored.growth_tracker) == (2.0**9, 1)


@pytest.mark.parametrize(("metadata", "message"), [
    ({}, "checkpoint of step 2 holds no fp16 loss scale"),
    ({METADATA_KEY: "[1, 2]"}, "checkpoint of step 2 holds no fp16 loss scale"),
    ({METADATA_KEY: '{"scale": -1.0, "growth_tracker": 0}'}, "the loss scale -1.0"),
    ({METADATA_KEY: '{"scale": 8.0, "growth_tracker": 3}'}, "growth tracker 3, not an "
                                                            "integer in 0..2")])
def test_a_missing_or_malformed_saved_scale_is_refused(metadata: dict[str, str],
                                                       message: str) -> None:
    scale = LossScale(torch.device("cpu"), None, growth_interval=3)
    with pytest.raises(ConfigError, match=re.escape(message)):
        scale.load(metadata, "checkpoint of step 2")
