"""The planner bench's section of docs/benchmarks.md (bench/run_all.py writes the page)."""

from __future__ import annotations

import json
from typing import Any

from bench.stats import fmt

GIB = 2**30


def simulated(sim: dict[str, Any]) -> list[str]:
    """The simulated part: scenario, profile, systems, ratios, store sweep, reading."""
    return [*_scenario(sim), *_systems(sim), *_sweep(sim), *reading(sim), ""]


def _scenario(sim: dict[str, Any]) -> list[str]:
    sc, dev = sim["scenario"], sim["scenario"]["device"]
    cap = sc["cap_bytes"] / GIB
    lines = [
        "### Simulated: 8 GPUs described, GPT-2-medium shape", "",
        f"`gpt` `{json.dumps(sc['model_config'])}` ({sim['profile']['layers']} layers with "
        f"embedding, head and loss), analytic profile at {dev['flops_per_second'] / 1e12:.0f} "
        f"TFLOP/s and {dev['bytes_per_second'] / 1e12:.1f} TB/s per GPU (fp32 tensors at a "
        "TF32 rate; `bench/planner_sim.py` says why), on "
        f"`bench/clusters/{sc['cluster_file']}`: 8 GPUs of {cap:.0f} GiB on 2 hosts, PCIe "
        "(20 GB/s) within a host, 100 Gb/s (12 GB/s) between hosts, offload store in host "
        f"memory at {sc['cluster']['store']['bandwidth'] / 1e9:.0f} GB/s per GPU. Batch "
        f"{sc['batch_size']} sequences in {sc['microbatches']} micro-batches of "
        f"{sc['microbatch_size']} for every system but `planner-free-m`. A system fits when "
        f"every GPU's simulated peak is within {sc['margin']:.0%} of {cap:.0f} GiB (the "
        "planner's own margin). Baselines as published: `gpipe` re-materialises (recompute) "
        "on the even split, `1f1b` keeps on the even split, PipeDream and PipeFB balance "
        "stages by time under their policy (PipeFB: the best of 1-7 forward workers, async, "
        "staleness 1). `planner` is the better of the planner's sync and async searches over "
        "every schedule; `planner-<kind>` is the planner asked for that schedule only; "
        "`even-<kind>` is that same plan with its stages balanced by parameter count "
        "(`plan: \"\"`), so the ratio of the two is what the partition alone is worth. "
        f"Profiling and simulating took {sim['wall_seconds']:.0f} s.", "",
        f"Profile per micro-batch of {sim['profile']['microbatch_size']} sequences:", "",
        "| layer | forward ms | backward ms | stash MiB | output MiB | parameters MiB |",
        "| --- | --- | --- | --- | --- | --- |"]
    return lines + [f"| {k} | {v['forward_ms']:.2f} | {v['backward_ms']:.2f} | "
                    f"{v['saved_mib']:,.0f} | {v['output_mib']:,.0f} | {v['param_mib']:,.0f} |"
                    for k, v in sim["profile"]["kinds"].items()]


def _systems(sim: dict[str, Any]) -> list[str]:
    lines = ["", "| system | plan | stages (forward / backward) | policy | ms per step | "
             "samples/s | max peak GiB | fits |", "| --- " * 8 + "|"]
    for name, r in sim["systems"].items():
        stages = (f"{r['forward_partition']} / {r['backward_partition']}"
                  if r["schedule"] == "pipefb" else str(r["forward_partition"]))
        lines.append(f"| {name} | {r['label']} | {stages} | {r['policy']} | "
                     f"{r['step_seconds'] * 1e3:,.0f} | {r['samples_per_second']:.1f} | "
                     f"{r['max_peak_bytes'] / GIB:.1f} | {'yes' if r['fits'] else 'no'} |")
    lines += ["", "| speed ratio (samples/s) | simulated | published | both fit |",
              "| --- | --- | --- | --- |"]
    return lines + [f"| {k} | {r['value']:.2f}x | {r['published']} | "
                    f"{'yes' if r['same_cap'] else 'no'} |" for k, r in sim["ratios"].items()]


def _sweep(sim: dict[str, Any]) -> list[str]:
    lines = ["", "PipeDream and PipeFB, both offloading every layer, as the store gets faster:",
             "", "| store GB/s | pipedream-offload ms | pipefb-offload ms | PipeFB speed-up |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['store_bytes_per_second'] / 1e9:.0f} | "
              f"{r['pipedream_offload_seconds'] * 1e3:,.0f} | "
              f"{r['pipefb_offload_seconds'] * 1e3:,.0f} | {r['ratio']:.2f}x |"
              for r in sim["store_sweep"]]
    if "planning_time" in sim:
        t = sim["planning_time"]
        lines += ["", f"Planning {t['layers']} random layers for {t['workers']} workers "
                  f"(every schedule kind): {fmt(t['seconds'], digits=2)} s over "
                  f"{t['seconds']['n']} runs (target: under 2 s)."]
    return [*lines, ""]


def reading(sim: dict[str, Any]) -> list[str]:
    """Why the simulated ratios are what they are, from this run's figures."""
    return ["Reading the simulated figures:", "", _offload_note(sim), _vpipe_note(sim),
            _partition_note(sim), *_weakness_notes(sim)]


def _offload_note(sim: dict[str, Any]) -> str:
    ratio = {k: r["value"] for k, r in sim["ratios"].items()}
    rows, block = sim["systems"], sim["profile"]["kinds"]["Block"]
    mixed = ratio["planner-pipefb-async / pipedream-offload"]
    move = block["saved_mib"] * 2**20 / sim["scenario"]["cluster"]["store"]["bandwidth"] * 1e3
    work = block["forward_ms"] + block["backward_ms"]
    best = max(sim["store_sweep"], key=lambda r: r["ratio"])
    return (f"- PipeFB against PipeDream, both offloading every layer: "
            f"{ratio['pipefb-offload / pipedream-offload']:.2f}x, against the published "
            f"1.48-2.27x. A block stashes {block['saved_mib'] / 1024:.2f} GiB per micro-batch "
            f"(fp32, attention matrices included); the store moves that in {move:.0f} ms each "
            f"way, {move / work:.1f}x the block's {work:.1f} ms of forward and backward compute. "
            "Both systems wait on the store, and every GPU moves about the same bytes (a "
            "PipeDream stage puts and fetches its layers' stash; a PipeFB forward GPU puts and "
            "a backward GPU fetches, each for twice as many layers), so running forward and "
            "backward on different GPUs hides little. Across the store sweep the ratio peaks "
            f"at {best['ratio']:.2f}x ({best['store_bytes_per_second'] / 1e9:.0f} GB/s); with "
            "a fast store PipeFB's split, the backward's larger share of the work on its own "
            "GPUs, costs more than the overlap saves. The planner's PipeFB, recomputing where "
            f"that is cheaper than moving, is {mixed:.1f}x PipeDream with offload (peak "
            f"{rows['planner-pipefb-async']['max_peak_bytes'] / GIB:.1f} against "
            f"{rows['pipedream-offload']['max_peak_bytes'] / GIB:.1f} GiB).")


def _vpipe_note(sim: dict[str, Any]) -> str:
    rows, ratio = sim["systems"], {k: r["value"] for k, r in sim["ratios"].items()}
    keep, sc = rows["pipedream-keep"], sim["scenario"]
    allowed = sc["margin"] * sc["cap_bytes"] / GIB
    offload = rows["pipedream-offload"]["step_seconds"] / rows["planner"]["step_seconds"]
    return (f"- The planner against PipeDream with keep: {ratio['planner / pipedream-keep']:.2f}x,"
            " against vPipe's +61-463%. PipeDream with keep on its time-balanced stages needs "
            f"{keep['max_peak_bytes'] / GIB:.1f} GiB on its busiest GPU "
            f"({'within' if keep['fits'] else 'over'} the {allowed:.0f} GiB plans may use); "
            "the planner picks "
            f"`{rows['planner']['label']}` with `{rows['planner']['policy']}`. vPipe's gains "
            "are over PipeDream runs that swap or are badly balanced; over PipeDream with "
            f"offload the planner is {offload:.1f}x, "
            f"over GPipe's re-materialisation {ratio['planner / gpipe']:.2f}x (vPipe: "
            "1.25-3.91x).")


def _partition_note(sim: dict[str, Any]) -> str:
    ratio = {k: r["value"] for k, r in sim["ratios"].items()}
    kinds = sim["profile"]["kinds"]
    weight = sum(kinds["Head"][k] + kinds["CrossEntropy"][k] for k in ("forward_ms",
                                                                      "backward_ms"))
    block = kinds["Block"]["forward_ms"] + kinds["Block"]["backward_ms"]
    parts = {k.split(" / ")[0].removeprefix("planner-"): v for k, v in ratio.items()
             if k.startswith("planner-") and "/ even-" in k}
    top = max(parts, key=lambda k: parts[k])
    why = (", since its forward and backward stages balance different per-layer times"
           if top.startswith("pipefb") else "")
    return ("- The partition alone (the planner's stages against parameter-balanced ones, "
            "same schedule, roles and policy): "
            + ", ".join(f"{k} {v:.2f}x" for k, v in parts.items())
            + f". The blocks are identical and head plus loss weigh {weight / block:.1f} "
            "blocks of compute, so balancing parameters is close to balancing time on 8 GPUs; "
            f"{top} gains most{why}. BaPipe's up to 3.2x is over whole configurations "
            "(schedule and partition) on less uniform networks.")


def _weakness_notes(sim: dict[str, Any]) -> list[str]:
    rows = sim["systems"]
    mine, gpipe = rows["planner-gpipe"], rows["gpipe"]
    if mine["step_seconds"] <= gpipe["step_seconds"]:
        return []
    slower = mine["step_seconds"] / gpipe["step_seconds"] - 1
    head = (f"- `planner-gpipe` ({mine['step_seconds'] * 1e3:,.0f} ms, `{mine['policy']}`) is "
            f"no faster than GPipe recomputing every layer ({gpipe['step_seconds'] * 1e3:,.0f} "
            f"ms, {slower:.2%} slower). ")
    if "offload" not in mine["policy"]:
        return [head + "GPipe holds every micro-batch's stash until its backward, so under "
                "the cap nearly every layer must recompute, as GPipe's own "
                "re-materialisation does; the two plans differ only in partition and in the "
                "few layers kept."]
    return [head + "A planner weakness: to fit the cap it switches layers to whichever of "
            "offload or recompute frees more bytes per second of extra time, and here it "
            "sends stashes through the store where recomputing them is cheaper."]


def measured(meas: dict[str, Any], args: dict[str, Any]) -> list[str]:
    """The measured part: plan auto against the even split, per worker count."""
    job = meas["job"]
    lines = [
        "### Measured: plan auto against the even split, local processes", "",
        f"`gpt` `{json.dumps(job['model_config'])}` on synthetic tokens: head and loss over "
        "the vocabulary outweigh the blocks, and the embedding has many parameters and "
        f"little compute. Batch {job['batch_size']}, AdamW, {args['steps']} timed steps after "
        f"{args['warmup']} warm-up, {args['repeats']} repeat(s) of every system interleaved, "
        f"{args['threads']} torch thread per worker. `even-<kind>` runs `plan: \"\"` (stages "
        f"balanced by parameter count, {job['microbatches']} micro-batches, the schedule's "
        "default policy); `auto` and `auto-async` run `plan: auto, schedule: auto` in sync "
        "and async mode; `auto-<kind>` runs `plan: auto` with the schedule fixed. Under `plan: "
        "auto` the coordinator profiles the layers on its workers and the planner picks the "
        "micro-batch count, partition and policy for the calibrated local cluster, so a ratio "
        "holds all three. Samples/s: per repeat, the timed steps' samples over their wall "
        "time (steps overlap, so single step gaps come in bursts), median [min-max] over "
        "repeats; ratios: of per-repeat samples/s, median [min-max] over repeats.", ""]
    for n, r in meas["workers"].items():
        lines += _measured_table(n, r)
    return lines


def _measured_table(n: str, r: dict[str, Any]) -> list[str]:
    lines = [f"#### {n} workers", "", "| system | plan it ran | stages (forward / backward) | "
             "samples/s | max peak KiB |", "| --- | --- | --- | --- | --- |"]
    for name, sps in r["samples_per_second"].items():
        p = r["plans"][name]
        stages = (str(p["forward_partition"]) if p["forward_partition"] ==
                  p["backward_partition"] else
                  f"{p['forward_partition']} / {p['backward_partition']}")
        lines.append(f"| {name} | {p['label']}, {' + '.join(p['policy'])} | {stages} | "
                     f"{fmt(sps)} | {r['max_peak_bytes'][name] / 1024:,.0f} |")
    lines += ["", "| speed ratio | median [min-max] |", "| --- | --- |"]
    return lines + [f"| {k} | {fmt(v, digits=2)} |" for k, v in r["ratios"].items()] + [""]
