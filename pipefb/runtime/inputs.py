"""A rank's micro-batches: the job's data, drawn by (step, global micro-batch), on its device."""

from __future__ import annotations

import torch

from pipefb.job.config import JobConfig
from pipefb.job.data import job_dataset, microbatch_specs
from pipefb.job.shapes import TensorSpec, infer_input_specs


class MicroBatches:
    """Inputs and targets of a rank's micro-batches; micro-batch m of its group is the
    step's micro-batch `offset + m` ([Note: groups] in pipefb.runtime.place)."""

    def __init__(self, job: JobConfig, size: int, offset: int, device: torch.device) -> None:
        self.dataset = job_dataset(job)
        self.size, self.offset, self.device = size, offset, device

    def get(self, step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch m of `step` (inputs, targets) on this rank's device."""
        x, y = self.dataset.microbatch(step, self.offset + m, self.size)
        return x.to(self.device), y.to(self.device)

    def layer_specs(self, layers: list[torch.nn.Module]) -> list[list[TensorSpec]]:
        """Each layer's input specs at this micro-batch size (the loss layer's: output and
        targets), propagated from the data's shapes (read from no sample where the dataset
        knows them: a rank that takes neither inputs nor targets reads no data)."""
        return infer_input_specs(layers, *microbatch_specs(self.dataset, self.size))
