"""Held-out evaluation of a job's weights (final, or a kept version): loss, and accuracy for
classification."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig, build_layers
from pipefb.job.data import job_dataset
from pipefb.job.precision import autocast
from pipefb.runtime.state import load_buffers

EVAL_SAMPLES = 1024  # held-out samples per evaluation: the same draws for every schedule
EVAL_BATCH = 128  # samples per forward


def load_weights(layers: list[torch.nn.Module], weights: Mapping[str, torch.Tensor]) -> None:
    """Copies `layers.{i}.{name}` tensors into the layers' parameters, and into their
    persistent buffers where `weights` has them.

    Raises:
        ConfigError: a parameter missing from `weights`, or one of another shape.
    """
    with torch.no_grad():
        for i, layer in enumerate(layers):
            for name, p in layer.named_parameters():
                key = f"layers.{i}.{name}"
                if key not in weights:
                    raise ConfigError(f"weights lack {key}")
                if weights[key].shape != p.shape:
                    raise ConfigError(f"weights {key} is {list(weights[key].shape)}, "
                                      f"the model's is {list(p.shape)}")
                p.copy_(weights[key])
            load_buffers(layer, i, weights)  # BatchNorm's statistics


def evaluate(job: JobConfig, weights: Mapping[str, torch.Tensor],
             samples: int = EVAL_SAMPLES) -> dict[str, float]:
    """Mean loss (and accuracy for `cross_entropy`) on the dataset's `eval` split: all of a
    finite held-out set, else `samples` fixed draws from it.

    Returns:
        {"loss": ..., "accuracy": ...}, or {} when the dataset has no eval split.
    """
    dataset = job_dataset(job)
    if "eval" not in dataset.splits:
        return {}
    layers = build_layers(job)
    load_weights(layers, weights)
    *model, loss_layer = layers
    total_loss, correct, count = 0.0, 0, 0
    whole = dataset.held_out()
    if whole is not None:  # a finite held-out set (digits): all of it, once
        samples = len(whole[0])
        batches = [(whole[0][i:i + EVAL_BATCH], whole[1][i:i + EVAL_BATCH])
                   for i in range(0, samples, EVAL_BATCH)]
    else:  # a corpus (text) or a generator (synthetic): `samples` fixed draws
        batches = [dataset.microbatch(0, b, min(EVAL_BATCH, samples - b * EVAL_BATCH), "eval")
                   for b in range(-(-samples // EVAL_BATCH))]
    with torch.no_grad(), autocast(job.precision, "cpu"):  # as the job trained
        for x, y in batches:
            size = len(x)
            for layer in model:
                layer.eval()
                x = layer(x)
            total_loss += float(loss_layer(x, y)) * size
            if job.loss == "cross_entropy":  # targets of ignore_index count for nothing
                kept = y != job.loss_config.get("ignore_index", -100)
                correct += int(((x.argmax(dim=-1) == y) & kept).sum())
                count += int(kept.sum())
    out = {"loss": total_loss / samples}
    if count:
        out["accuracy"] = correct / count
    return out
