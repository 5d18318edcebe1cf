"""The run report: report.json, weights.safetensors and loss.png in the output directory."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pipefb.schedule import Action


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
    simulated = report.get("planner", {}).get("timeline")
    if report.get("timeline") and simulated:
        predicted = report["planner"]["predicted_step_seconds"]
        measured = report["samples_per_second"]
        plot_timelines([(f"simulated ({predicted * 1e3:.1f} ms/step)", simulated),
                        (f"measured, step {report['timeline']['step']} "
                         f"({report['job']['batch_size'] / measured * 1e3:.1f} ms/step)"
                         if measured else "measured", report["timeline"])],
                       out / "timeline.png")
    elif report.get("timeline"):
        plot_timeline(report["timeline"], out / "timeline.png")
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


# Colour of each action kind in timelines: compute solid, communication light, waits grey.
KIND_COLOURS = {"F": "#4C72B0", "B": "#55A868", "OPT": "#8172B2", "STASH": "#DD8452",
                "FETCH": "#C0C0C0", "PUSH_W": "#DA8BC3", "SEND": "#E5C07B", "RECV": "#D9D9D9"}


def _kind(action: str) -> str:
    return str(Action.parse(action).kind)


def _kind_colour(action: str) -> str:
    kind = _kind(action)
    return KIND_COLOURS.get(kind, KIND_COLOURS.get(kind.split("_")[0], "#999999"))


def plot_timeline(timeline: Mapping[str, Any], path: Path) -> None:
    """One step's actions per rank as a Gantt chart (compute labelled by micro-batch)."""
    plot_timelines([(f"timeline of step {timeline['step']}", timeline)], path)


def plot_timelines(panels: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> None:
    """Timelines side by side on one time axis, same style (e.g. simulated and measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = max(len(t["ranks"]) for _, t in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(10 * len(panels), 0.6 * rows + 1.6),
                             dpi=120, squeeze=False, sharex=True)
    for ax, (title, timeline) in zip(axes[0], panels, strict=True):
        _draw_timeline(ax, timeline)
        ax.set_title(title)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLOURS.items()],
               ncol=8, fontsize=7, loc="lower center")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def _draw_timeline(ax: Any, timeline: Mapping[str, Any]) -> None:
    ranks = timeline["ranks"]
    for row, rank in enumerate(ranks):
        for action, start, end in rank["spans"]:
            ax.barh(row, max(end - start, 1e-5), left=start, color=_kind_colour(action),
                    edgecolor="white", linewidth=0.3)
            if _kind(action) in ("F", "B"):
                ax.text((start + end) / 2, row, action, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(ranks)),
                  [f"rank {r['rank']} {r['role']} {r['stage']}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the step's first action")
