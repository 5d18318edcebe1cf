"""Runs a rank's layer forwards as each layer's policy says: seeded and timed, keeping what
each layer's backward needs, and re-running a recomputed run's forwards before its backward."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from dataclasses import replace

import torch

from pipefb.plan.plan import Plan, recompute_runs
from pipefb.runtime.clock import LayerClock
from pipefb.runtime.execs import LayerExec, Params, Saved
from pipefb.runtime.inputs import MicroBatches
from pipefb.seeding import derive_seed, seed_random_ops


class LayerRunner:
    """The forwards of one rank's layers (any of the job's `n_layers`; the last computes
    the loss from its input and the targets)."""

    def __init__(self, plan: Plan, seed: int, execs: Mapping[int, LayerExec],
                 n_inputs: Mapping[int, int], n_layers: int, data: MicroBatches,
                 clock: LayerClock, fixed: Set[int] = frozenset()) -> None:
        """`fixed`: layers never re-run (their forward writes into their weights: [Note:
        renormalised rows] in pipefb.runtime.renorm); a `recompute` one keeps its saved
        tensors as `keep` does, and the run after it starts at the next layer."""
        self.policy = tuple("keep" if i in fixed and p == "recompute" else p
                            for i, p in enumerate(plan.policy))
        self.seed = seed
        self.execs, self.n_inputs, self.n_layers = execs, n_inputs, n_layers
        self.data, self.clock = data, clock
        # layer -> first layer of its recomputed run
        self.run_start = recompute_runs(replace(plan, policy=self.policy))

    def forward(self, i: int, step: int, m: int, inputs: list[torch.Tensor],
                params: Params, update_buffers: bool = True) -> tuple[torch.Tensor, Saved]:
        """Layer i's forward of micro-batch m of `step` with weight version `params` (None:
        the live one), its random ops seeded by (seed, step, global micro-batch, layer);
        `update_buffers` False when it is recomputed ([Note: mutated buffers] in
        pipefb.runtime.layersplit)."""
        if self.execs[i].has_random_ops:
            seed_random_ops(derive_seed(self.seed, step, self.data.offset + m, i))
        with self.clock.layer(step, i):
            return self.execs[i].forward(inputs, params, update_buffers)

    def kept(self, i: int, inputs: list[torch.Tensor], saved: Saved) -> Saved:
        """What layer i's forward keeps for its backward: keep and offload the layer's
        saved tensors; recompute only the inputs of the first layer of a run."""
        if self.policy[i] != "recompute":
            return saved
        return {f"input_{j}": t for j, t in enumerate(inputs)} if self.run_start[i] == i else {}

    def stash_names(self, layer: int) -> list[str]:
        """What layer `layer` keeps per micro-batch for its backward (see `kept`)."""
        if self.policy[layer] != "recompute":
            return self.execs[layer].stash_names
        if self.run_start[layer] != layer:
            return []
        return [f"input_{j}" for j in range(self.n_inputs[layer])]

    def recompute(self, step: int, m: int, end: int, saved: Saved,
                  params: Callable[[int], Params]) -> dict[int, Saved]:
        """Re-runs the forward of the recomputed run ending at layer `end` from what its
        first layer kept (`saved`), with the forward's weight version (`params` of a
        layer) and random seeds; returns each layer's saved tensors."""
        start = self.run_start[end]
        inputs = [saved[f"input_{j}"] for j in range(self.n_inputs[start])]
        out: dict[int, Saved] = {}
        for i in range(start, end + 1):
            x, out[i] = self.forward(i, step, m, inputs, params(i), update_buffers=False)
            inputs = [x]
            if i + 1 == self.n_layers - 1:  # the loss layer also takes the targets
                inputs.append(self.data.get(step, m)[1])
        return out
