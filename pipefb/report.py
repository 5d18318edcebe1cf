"""The run report: report.json, weights.safetensors and loss.png in the output directory."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def throughput(steps: Sequence[Mapping[str, Any]]) -> float:
    """Median samples/s over the steps, the first (warm-up) excluded when there are more."""
    rates = [s["samples_per_second"] for s in steps]
    rates = rates[1:] if len(rates) > 1 else rates
    return statistics.median(rates) if rates else 0.0


def write_report(out: Path, report: dict[str, Any], weights: Mapping[str, torch.Tensor]) -> Path:
    """Writes report.json (adding the headline throughput), the weights and the loss plot.

    Returns:
        The path of report.json.
    """
    out.mkdir(parents=True, exist_ok=True)
    report["samples_per_second"] = throughput(report["steps"])
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    save_file({k: v.detach().contiguous().clone() for k, v in weights.items()},
              str(out / "weights.safetensors"))
    plot_loss(report, out / "loss.png")
    return path


def plot_loss(report: Mapping[str, Any], path: Path) -> None:
    """Loss per step, titled with the schedule and throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s["step"] for s in report["steps"]]
    losses = [s["loss"] for s in report["steps"]]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, losses, marker="o", markersize=2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{report['job']['model']} on {report['job']['dataset']}: schedule "
                 f"{report['schedule']}, {report['workers']} workers, "
                 f"{report['samples_per_second']:.0f} samples/s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
