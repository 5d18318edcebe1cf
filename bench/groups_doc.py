"""The group hybrid parallelism section of docs/benchmarks.md, from bench/groups.py's
results."""

from __future__ import annotations

import json
from typing import Any

from bench.stats import fmt
from pipefb.planner.groups import MODEL_SLACK, TOP_BY_MODEL


def doc_section(cmd: str, res: dict[str, Any], png: str) -> list[str]:
    """Markdown of the GHP bench: measured 2x1 vs 1x2, then the simulated sizes."""
    lines = ["## Group hybrid parallelism: pipeline groups against one pipeline", "",
             f"`{cmd}`", ""]
    if "measured" in res:
        lines += measured(res["measured"], res["args"])
    if "simulated" in res:
        lines += simulated(res["simulated"])
    return [*lines, f"![groups]({png})", ""]


def measured(meas: dict[str, Any], args: dict[str, Any]) -> list[str]:
    """Measured samples/s and the planner's prediction per model and system."""
    lines = [f"Measured on 2 local workers: `1x2` is one pipeline of 2 stages, `2x1` two "
             "groups of one stage each (data parallelism: the gloo all-reduce sums each "
             "step's gradients), `auto` lets the planner pick G. Every system is `plan: "
             "auto`, sync, with its G fixed, so it runs the planner's best plan for one group "
             f"and carries its prediction. Batch {args['batch']}, AdamW, {args['steps']} "
             f"timed steps after {args['warmup']} warm-up, {args['repeats']} repeats "
             f"interleaved, {args['threads']} torch thread per worker; samples/s per repeat "
             "(timed samples over their wall time), median [min-max].", ""]
    for model, r in meas["models"].items():
        cfg = json.dumps(r["job"]["model_config"])
        lines += [f"### {model} (`{cfg}`)", "",
                  "| system | plan that ran | samples/s measured | samples/s predicted |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {s} | {r['plans'][s]} | {fmt(v)} | "
                  f"{r['predicted_samples_per_second'][s]['median']:.0f} |"
                  for s, v in r["samples_per_second"].items()]
        lines += ["", "| ratio | measured, median [min-max] | predicted |", "| --- | --- | --- |"]
        lines += [f"| {name} | {fmt(v, digits=2)} | {r['predicted_ratios'][name]:.2f} |"
                  for name, v in r["ratios"].items()]
        lines.append("")
    return [*lines, *measured_reading(meas)]


def simulated(sim: dict[str, Any]) -> list[str]:
    """The simulated table: per cluster size, every G, and the three systems compared."""
    sc = sim["scenario"]
    lines = [f"Simulated (`bench/groups_sim.py`, [Note: GHP bench scenario]): N described "
             f"40 GiB GPUs, {sc['per_host']} per host; a `gpt` "
             f"`{json.dumps(sc['model_config'])}` ({sc['layers']} layers, "
             f"{sc['param_bytes'] / 1e9:.1f} GB of fp32 parameters), batch "
             f"{sc['batch_size']} sequences. For each G the planner's full search "
             "(schedule, micro-batches, partition, policy under the cap) for one group, "
             "simulated over all N with the ring all-reduce in each optimizer step. `GHP` is "
             f"the planner's choice (model ranks every G; the best {TOP_BY_MODEL} and any "
             f"within {MODEL_SLACK:.0%} of the best are simulated), `exhaustive` the best G "
             "with every G simulated.", "",
             "| GPUs | GHP G | exhaustive G | GHP samples/s | vs single pipeline (G=1) | "
             "vs pure DP (G=N) | GHP / exhaustive |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for n, r in sorted(sim["sizes"].items(), key=lambda x: int(x[0])):
        pick = r["rows"][str(r["ghp_groups"])]
        lines.append(f"| {n} | {r['ghp_groups']} | {r['exhaustive_groups']} | "
                     f"{pick['samples_per_second']:.0f} | {_x(r['ghp_vs_single_pipeline'])} | "
                     f"{_x(r['ghp_vs_pure_dp'])} | {r['ghp_over_exhaustive']:.3f} |")
    lines += ["", "Every G considered (simulated ms per step; model ms in brackets):", "",
              "| GPUs | " + " | ".join(f"G={g}" for g in _all_groups(sim)) + " |",
              "| --- |" + " --- |" * len(_all_groups(sim))]
    for n, r in sorted(sim["sizes"].items(), key=lambda x: int(x[0])):
        cells = [_cell(r["rows"].get(str(g))) for g in _all_groups(sim)]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return [*lines, "", *reading(sim), ""]


def reading(sim: dict[str, Any]) -> list[str]:
    """What the simulated figures say (checked against the timelines of this scenario)."""
    sizes = sorted(sim["sizes"], key=int)
    agree = sum(sim["sizes"][n]["ghp_over_exhaustive"] >= 0.95 for n in sizes)
    return [
        f"- The model's choice is within 5% of exhaustive search on {agree} of {len(sizes)} "
        "sizes (tests/test_groups_planner.py asserts it on random profiles for 4-64 workers).",
        _single_pipeline_note(sim),
        "- Many groups lose to the all-reduce: each step moves 2(G-1)/G of every stage's "
        "gradients over the slowest hop of its ring (12 GB/s between hosts), and pure data "
        "parallelism moves the whole model's 3.6 GB. At 8 and 16 GPUs that costs less than "
        "any pipeline's bubble, so pure data parallelism is the choice; from 32 GPUs 8-16 "
        "groups win.", ""]


def _single_pipeline_note(sim: dict[str, Any]) -> str:
    """Whether one pipeline over the most GPUs keeps head and loss on one stage (the
    logits, hundreds of MB per micro-batch, then never cross a boundary)."""
    n = max(sim["sizes"], key=int)
    row = sim["sizes"][n]["rows"]["1"]
    layers = sim["scenario"]["layers"]
    together = bool(row.get("partition")) and row["partition"][-2] <= layers - 2
    where = ("head and loss share it and the logits (4 bytes x tokens x 50257, hundreds of "
             "MB per micro-batch) never cross a boundary, since the partitioner charges each "
             "stage the bytes crossing its boundaries" if together else
             "the loss has it alone and the logits cross from the head's stage")
    return (f"- One pipeline over {n} GPUs spreads {layers} layers over {n} stages; its last "
            f"stage is layers {row['partition'][-2]}-{layers - 1} (`{row['plan']}`): {where}. "
            "What it loses to groups of 8-16 is its fill and drain over that many stages.")


def measured_reading(meas: dict[str, Any]) -> list[str]:
    """What the measured figures say, from the figures."""
    models = meas["models"]
    same = [m for m, r in models.items()
            if (r["ratios"]["2x1/1x2"]["median"] > 1) == (r["predicted_ratios"]["2x1/1x2"] > 1)]
    over = all(r["predicted_samples_per_second"][s]["median"] > v["median"]
               for r in models.values() for s, v in r["samples_per_second"].items())
    return [
        "The predictions come from the profile the workers measure when idle, before the "
        "in-situ fit (see the simulator accuracy section)"
        + (": they overestimate samples/s" if over else "")
        + f". The planner ranks 2x1 against 1x2 as the measurement does for "
        f"{len(same)} of {len(models)} models ({', '.join(same) or 'none'}). A step of the "
        "small `mlp` takes about 10 ms, little compute for the gradients an all-reduce "
        "must move; the `gpt` has more compute per parameter, which favours data-parallel "
        "groups.", ""]


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value else "does not fit"


def _all_groups(sim: dict[str, Any]) -> list[int]:
    return sorted({int(g) for r in sim["sizes"].values() for g in r["rows"]})


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if not row["step_seconds"]:
        return f"- ({row['model_seconds'] * 1e3:.0f})"
    return f"{row['step_seconds'] * 1e3:.0f} ({row['model_seconds'] * 1e3:.0f})"
