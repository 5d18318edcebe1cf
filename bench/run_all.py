"""Runs every bench once and writes docs/benchmarks.md from that run's results alone.

Run: `make bench`, or `python bench/run_all.py [--quick] [--out bench/results]
[--doc docs/benchmarks.md]`. Each bench runs in its own process, one after the other, with
its torch threads pinned (`--threads`, 1 unless an entry says otherwise); their
results.json files land in OUT/<bench>/, and OUT/run.json records how long each took.
On a machine with a CUDA device the GPU entries run too and write their own page
(docs/benchmarks-gpu.md), so CPU and GPU tables never mix; without one the CPU page says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import (
    groups_doc,
    hop_latency,
    machine,
    matrix,
    planner_doc,
    replan,
    scaling,
    sim_accuracy,
    store,
)
from bench.pipeline_throughput import RATIOS, SYSTEMS
from bench.stats import fmt
from pipefb.processes import project_env

ROOT = Path(__file__).resolve().parents[1]
#: Entries that need a CUDA device: they run only where one is, into the GPU page.
NEEDS_CUDA = frozenset({"matrix_cuda", "schedules_cuda", "offload_cuda"})
GPU_DOC = "benchmarks-gpu.md"  # beside the CPU page
#: result folder -> (bench script, extra arguments). The matrix runs 4 samples per
#: micro-batch (latency-bound); the second throughput run 16, where compute dominates.
#: Sizes are chosen so that the whole run fits a small CPU machine in one sitting.
BENCHES: dict[str, tuple[str, list[str]]] = {
    "matrix": ("matrix", []),
    "pipeline_throughput_b64": ("pipeline_throughput", ["--batch", "64", "--models", "gpt",
                                                        "--steps", "12"]),
    "stream_vs_tcp": ("stream_vs_tcp", []),
    "hop_latency": ("hop_latency", []),
    "store": ("store", []),
    "backward_worker": ("backward_worker", []),
    "schedules": ("schedules", ["--workers", "4"]),
    "scaling": ("scaling", []),
    "planner": ("planner", []),
    "sim_accuracy": ("sim_accuracy", []),
    "groups": ("groups", []),
    "replan": ("replan", ["--steps", "80"]),
    "replan_layer": ("replan", ["--scenario", "layer", "--factor", "4", "--batch", "64",
                                "--steps", "80", "--repeats", "2"]),
    "matrix_cuda": ("matrix", ["--device", "cuda", "--threads", "2", "--repeats", "2"]),
    "schedules_cuda": ("schedules", ["--device", "cuda", "--threads", "2", "--repeats", "2",
                                     "--steps", "6"]),
    # issue 36's GPU targets, sized for a few minutes of one GPU: `PYTHONPATH=. python
    # bench/run_all.py --only offload_cuda`, or on a lent machine `bash bench/device_run.sh`
    # (one model at a time, with the CUDA tests) and here `bench/merge_device.py`
    "offload_cuda": ("matrix", ["--device", "cuda", "--threads", "2", "--repeats", "2",
                                "--steps", "6", "--models", "gpt,gpt-large", "--systems",
                                "pipedream-keep,pipedream-offload,pipefb-sync,pipefb-async"]),
}


def bench_argv(name: str, out: Path, quick: bool) -> list[str]:
    """The command line of one entry of BENCHES."""
    script, extra = BENCHES[name]
    return [f"bench/{script}.py", *extra, "--out", os.path.relpath(out / name, ROOT),
            *(["--quick"] if quick else [])]


def run_bench(name: str, out: Path, quick: bool, seconds: dict[str, float]
              ) -> tuple[str, dict[str, Any]]:
    """Runs one entry of BENCHES in a child; returns (command, results) and records its
    wall time in `seconds`."""
    argv = bench_argv(name, out, quick)
    env = project_env()
    print(f"== {name}: {' '.join(argv)}", flush=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, check=True)
    seconds[name] = time.perf_counter() - started
    print(f"== {name}: {seconds[name]:.0f} s", flush=True)
    return "PYTHONPATH=. python " + " ".join(argv), json.loads(
        (out / name / "results.json").read_text())


def saved_command(name: str, out: Path) -> str:
    """The command that produced OUT/<name>/results.json (as `run_bench` runs it)."""
    return "PYTHONPATH=. python " + " ".join(bench_argv(name, out, False))


def pipeline_section(cmd: str, res: dict[str, Any], png: str) -> list[str]:
    """Markdown of the pipeline throughput bench."""
    a = res["args"]
    per_mb = a["batch"] // a["microbatches"]
    lines = [f"## Pipeline throughput, {per_mb} samples per micro-batch (samples/s)", "",
             f"`{cmd}`", "",
             f"Batch {a['batch']} in {a['microbatches']} micro-batches, AdamW, "
             f"{a['steps']} timed steps after {a['warmup']} warm-up steps, {a['repeats']} "
             f"repeat(s) of every system, interleaved; {a['threads']} torch thread(s) in every "
             "process (single, each worker, each torch rank). Medians and [min-max] over all "
             "timed steps of all repeats; ratios are ratios of per-repeat medians, median "
             "[min-max] over repeats. Both pipelines split the layers at the same boundary "
             "(the coordinator's balanced 2-worker plan); `pipefb-pipefb` is 1 forward + 1 "
             "backward worker.", ""]
    for name, m in res["models"].items():
        cfg = json.dumps(m["job"]["model_config"])
        lines += [f"### {name} (`{cfg}`, {m['layers']} layers incl. loss, "
                  f"stage 1 starts at layer {m['boundary']})", "",
                  "| system | samples/s | max loss diff vs single |", "| --- | --- | --- |"]
        lines += [f"| {s} | {fmt(m['samples_per_second'][s])} | "
                  f"{m['max_loss_diff_vs_single'][s]:.1e} |" for s in SYSTEMS]
        lines += ["", "| ratio | median [min-max] |", "| --- | --- |"]
        lines += [f"| {a_}/{b} | {fmt(m['ratios'][f'{a_}/{b}'], digits=2)} |" for a_, b in RATIOS]
        lines.append("")
    lines += [f"![throughput]({png})", ""]
    return lines


def stream_section(cmd: str, res: dict[str, Any]) -> list[str]:
    """Markdown of the gRPC stream vs raw TCP bench."""
    a = res["args"]
    lines = ["## gRPC tensor stream vs raw TCP (loopback)", "", f"`{cmd}`", "",
             f"{res['tensor_bytes'] / 2**20:.0f} MiB float32 tensor, {a['repeats']} timed "
             "transfers per path (interleaved, after one warm-up), receiver in another process; "
             "each clock stops at the receiver's ack, after it materialised the tensor.", "",
             "| path | MB/s | ms per transfer |", "| --- | --- | --- |"]
    lines += [f"| {k} | {fmt(v)} | {fmt(res['seconds'][k], 1e3)} |"
              for k, v in res["mb_per_second"].items()]
    lines += ["", f"gRPC/TCP: **{fmt(res['ratio_grpc_over_tcp'], digits=2)}** "
              f"(target >= {res['target']}) on the workers' long-lived stream; with a new "
              f"call per transfer: {fmt(res['ratio_grpc_call_per_transfer_over_tcp'], digits=2)}.",
              "",
              "Where gRPC time goes (same tensor, one process, no network), ms:", "",
              "| piece | ms |", "| --- | --- |"]
    lines += [f"| {k} | {fmt(v, 1e3, 2)} |" for k, v in res["breakdown_seconds"].items()]
    return [*lines, "", *push_section(res.get("weight_push", {}))]


def push_section(pushes: dict[str, Any]) -> list[str]:
    """Markdown of the weight pushes, packed against one tensor per message."""
    if not pushes:
        return []
    lines = ["Weight push: every parameter of the bench's model on the same stream, packed "
             "(`wire.encode_stream`: small tensors share a message, [Note: packed messages] "
             "in protos/wire.py) against one tensor per message (the earlier layout), "
             "interleaved; ms per push to the receiver's materialised tensors.", "",
             "| model | tensors | MB | packed: messages, ms | one tensor per message: "
             "messages, ms | speedup |", "| --- | --- | --- | --- | --- | --- |"]
    for model, w in pushes.items():
        sec, msgs = w["seconds"], w["messages"]
        lines.append(f"| {model} | {w['tensors']} | {w['bytes'] / 1e6:.1f} | "
                     f"{msgs['packed']}, {fmt(sec['packed'], 1e3)} | "
                     f"{msgs['one_tensor_per_message']}, "
                     f"{fmt(sec['one_tensor_per_message'], 1e3)} | "
                     f"**{fmt(w['speedup'], digits=2)}** |")
    return [*lines, ""]


def backward_section(cmd: str, res: dict[str, Any]) -> list[str]:
    """Markdown of the backward-only worker vs eager backward bench."""
    w, e = res["worker_backward"], res["eager_backward"]
    cfg = json.dumps(res["job"]["model_config"])
    return ["## Backward-only worker vs the same layers' backward alone", "", f"`{cmd}`", "",
            f"PipeFB with 1 forward + 1 backward worker on gpt `{cfg}`, "
            f"{res['job']['batch_size'] // res['job']['microbatches']} samples per micro-batch, "
            f"{res['args']['rounds']} rounds of a {res['args']['steps']}-step job "
            f"({res['args']['warmup']} warm-up) alternating with the baseline; the backward "
            "worker's `B` seconds per micro-batch from its step reports, against "
            "`loss.backward()` of the same layers in one process (forward untimed). "
            "One torch thread everywhere.", "",
            "| measure | ms per micro-batch, median [min-max] |", "| --- | --- |",
            f"| backward-only worker (`B` action) | {w['median_ms']:.2f} "
            f"[{w['min_ms']:.2f}-{w['max_ms']:.2f}] |",
            f"| eager backward, one process | {e['median_ms']:.2f} "
            f"[{e['min_ms']:.2f}-{e['max_ms']:.2f}] |", "",
            f"Ratio of medians, median [min-max] over rounds: **{res['ratio_median']:.3f}** "
            f"[{res['ratio_min']:.3f}-{res['ratio_max']:.3f}] (target <= {res['target']}: "
            f"{'meets' if res['ratio_median'] <= res['target'] else 'MISSES'}). The backward "
            "worker runs only the captured backward graphs from the fetched stash; no "
            "forward is re-run (tests/test_split.py checks the graphs).", ""]


def schedules_section(cmd: str, res: dict[str, Any], png: str) -> list[str]:
    """Markdown of the schedules x policies bench (step time and peak memory), on the cpu
    or, with the CUDA allocator's peaks beside the accounted ones, on a GPU."""
    a, job, m = res["args"], res["job"], res["machine"]
    cfg = json.dumps(job["model_config"])
    cuda = a.get("device") == "cuda"
    where = (f"on a GPU: {m['gpu']}, {m['cores']} CPU cores, torch {m['torch']}, "
             f"{m['date']}; every worker process shares the one GPU" if cuda else "on the cpu")
    lines = [f"## Schedules and activation policies: step time and peak memory, "
             f"{'GPU' if cuda else 'CPU'}", "", f"`{cmd}`", "", f"Measured {where}.", "",
             f"gpt `{cfg}`, batch {job['batch_size']} in {job['microbatches']} micro-batches, "
             f"AdamW, {a['steps']} timed steps after {a['warmup']} warm-up, {a['repeats']} "
             f"repeat(s) of every system interleaved, {a['threads']} torch thread per worker; "
             "async PipeFB with staleness 1. Peak = each rank's highest accounted peak "
             "(parameters, gradients, optimizer state, weight versions, live and stashed "
             f"activations). Speed = step time of `{res['baseline']}` / step time of the "
             "system, per repeat, median [min-max].", ""]
    for n, r in res["workers"].items():
        lines += [f"### {n} workers", "",
                  "| system | ms per step | speed vs " + res["baseline"] +
                  " | peak per rank, KiB | activation peak per rank, KiB |" +
                  (" CUDA allocator peak per rank, KiB |" if cuda else ""),
                  "| --- | --- | --- | --- | --- |" + (" --- |" if cuda else "")]
        for name, step in r["step_seconds"].items():
            ranks = r["ranks"][name]
            peaks = " / ".join(f"{ranks[k]['role']} {ranks[k]['peak'] / 1024:,.0f}"
                               for k in sorted(ranks, key=int))
            acts = " / ".join(f"{ranks[k]['activation'] / 1024:,.0f}"
                              for k in sorted(ranks, key=int))
            row = (f"| {name} | {fmt(step, 1e3)} | "
                   f"{fmt(r['speedup_vs_baseline'][name], digits=2)} | {peaks} | {acts} |")
            if cuda:
                row += " " + " / ".join(f"{ranks[k]['device_peak'] / 1024:,.0f}"
                                        for k in sorted(ranks, key=int)) + " |"
            lines.append(row)
        lines.append("")
    lo, hi = res["published"]
    lines += [f"Published (PipeFB paper, GPUs): PipeFB is {lo}-{hi}x faster than PipeDream "
              "with activation offload at the same peak memory.", "", f"![schedules]({png})",
              ""]
    return lines


def planner_section(cmd: str, res: dict[str, Any], png: str) -> list[str]:
    """Markdown of the planner bench: simulated 8-GPU comparison, then measured plan auto."""
    lines = ["## Planner: its plans against fixed schedules and the even split", "",
             f"`{cmd}`", ""]
    if "simulated" in res:
        lines += planner_doc.simulated(res["simulated"])
    if "measured" in res:
        lines += planner_doc.measured(res["measured"], res["args"])
    return [*lines, f"![planner]({png})", ""]


GPU_READING = [
    "On the GPU the offload store decides the offloading rows: every stashed tensor is copied "
    "from the device, sent over a loopback socket into one Redis server and back, then copied "
    "to the device again, while the compute of a step takes tens of milliseconds; so "
    "`pipedream-offload` and both PipeFB rows are store-bound (compare `pipedream-keep`), "
    "and PipeFB's advantage in the paper, whose stash moves to host memory over PCIe at "
    "tens of GB/s with DMA overlapping compute, cannot show here. The CUDA allocator peak "
    "counts what the accounting leaves out (temporaries inside a layer, workspaces, block "
    "rounding), so it is at least the accounted peak (tests/test_device.py checks it).", ""]

# The figures behind the code's constants and notes: hand-written, copied to the page.
FINDINGS = Path(__file__).resolve().parent / "findings.md"

READING = [
    "## Reading these figures", "",
    "- The machine has 2 cores shared with other tenants (CPU steal is visible in `vmstat`); "
    "a pipeline of 2 workers plus a coordinator, Redis and the client shares those 2 cores, "
    "so a pipeline cannot beat one process by much here; what matters are the ratios "
    "between systems measured in the same run.",
    "- `pipefb-1f1b` vs `torch-1f1b`: both run the same 1F1B order on the same split. "
    "pipefb's later stage sends each input gradient before computing the weight gradients "
    "and runs up to one micro-batch's weight gradients later, in the drain ([Note: input "
    "grads first] in docs/architecture.md; ZB-H1's idea), so stage 0 waits less; the price "
    "is that stage's activation peak (two micro-batches, as stage 0's). The rest of the "
    "difference is transport: torch sends through gloo from C++ in the "
    "calling thread; pipefb sends over gRPC, where each transfer passes Python threads "
    "(the stream's sender, the receiver's handler, the compute thread). On the tiny `mlp` "
    "(steps of a few ms) that latency dominates; on `gpt` it is a small share.",
    "- `pipefb-pipefb` is the `sync` mode: the forward of step v+1 waits for the weights of "
    "step v, so forward and backward workers mostly alternate instead of overlapping, and "
    "every saved tensor goes through Redis. With 1 forward + 1 backward worker the backward "
    "worker also carries about two thirds of the compute, against half per rank in 1F1B.",
    "- PipeFB against PipeDream with offload (the schedules table): the published 1.48-2.27x "
    "comes from GPUs, where a PipeDream stage that offloads stalls on PCIe copies of its own "
    "activations while PipeFB's forward and backward devices keep computing and the stash "
    "travels beside them. Here every process (2 or 4 workers, Redis, the coordinator) shares "
    "2 CPU cores: moving a stash costs the same cores that compute, nothing overlaps for "
    "free, and PipeFB's split puts the backward (about 2/3 of the work) on half the workers. "
    "So both offloading systems pay for Redis in full and the ratio stays near 1; the "
    "comparison that this machine can make honestly is the memory column: offload keeps the "
    "first worker's activation peak at one micro-batch, `keep` grows with depth.",
    "- Efficiency (the matrix) sets each pipeline against the best its own schedule and "
    "partition allow: 2 workers each as fast as `single`, minus the bubble the simulator "
    "finds on ideal workers. With one torch thread per process the 2 workers can have a "
    "core each, but they share them with the coordinator, Redis and the client, and every "
    "hop costs both ends CPU; so 1 is out of reach here, and torch-1f1b's figure on the "
    "same row is the practical ceiling. On the small `mlp` and `convnet` a step lasts a few "
    "milliseconds and per-transfer latency decides; on `gpt` compute does.",
    "- gRPC vs TCP: the CPU pieces of the gRPC path (one copy into each chunk, protobuf "
    "serialise and parse, one copy into the tensor) add up to about a third of a transfer; "
    "the rest is gRPC Python's hand-offs between its threads.", ""]


def machine_lines(m: dict[str, Any]) -> list[str]:
    """The date, machine and software lines of a page's header."""
    return [f"- date: {m['date']}", f"- machine: {m['cpu']}, {m['cores']} cores "
            "(shared and noisy: read medians and ranges, not single figures)"
            + (f"; GPU: {m['gpu']}" if m.get("gpu") else ""),
            f"- software: Python {m['python']}, torch {m['torch']}, grpcio {m['grpcio']}, "
            f"{m['platform']}"]


def provenance(run: dict[str, Any]) -> str:
    """Which run the page's figures come from: one whole run, or, after `--only`, the
    entries rerun since (each with the date of its rerun) on top of the last whole run."""
    rerun = run.get("rerun", {})
    if not rerun:
        return "every figure below comes from that one run."
    each = ", ".join(f"{name} ({date})" for name, date in rerun.items())
    return (f"the figures of {each} come from partial reruns (`--only`); every other figure "
            "comes from the last whole run, dated below.")


def measure_cluster(run: dict[str, Any]) -> None:
    """Measures this machine's local cluster again (`calibration.cluster`, cached for
    the benches after it) and keeps what it found in the run's record: the planner's
    predictions on this page all start from it, and it drifts from one calibration to the
    next."""
    from calibration.cluster import local_cluster

    run["cluster"] = local_cluster(1, refresh=True).to_dict()
    run["cluster_measured"] = machine.now()


def cluster_lines(run: dict[str, Any]) -> list[str]:
    """The calibrated local cluster the run's plans and predictions used."""
    c = run.get("cluster")
    if not c:
        return []
    net, store, over = c["network"], c["store"], c["overheads"]
    host = (c.get("hosts") or [{}])[0]
    return [f"- local cluster (`python -m calibration`, measured at "
            f"{run['cluster_measured']} for this run): loopback gRPC "
            f"{net['latency'] * 1e3:.2f} ms + bytes at {net['bandwidth'] / 1e9:.2f} GB/s "
            f"({net.get('cpu', 1.0):.2f} cores busy), store {store['latency'] * 1e3:.2f} ms "
            f"+ bytes at {store['bandwidth'] / 1e9:.2f} GB/s, step call "
            f"{over.get('step_cpu', 0.0) * 1e3:.2f} ms of CPU, "
            f"{host.get('cores', 1)} cores at {host.get('oversubscribed', 1.0):.2f} of their "
            "speed when oversubscribed twice"]


def run_lines(run: dict[str, Any]) -> list[str]:
    """How long the run took, in all and per bench."""
    if not run.get("seconds"):
        return []
    each = ", ".join(f"{k} {v:.0f}" for k, v in run["seconds"].items())
    total = (f"{run['total_seconds'] / 60:.1f} minutes in all" if run.get("total_seconds")
             else "a partial run")
    return [f"- duration: {total} (seconds per bench: {each})"]


def gpu_lines(results: dict[str, tuple[str, dict[str, Any]]], ran_cuda: bool) -> list[str]:
    """Where the GPU tables are, and whether this run made them."""
    gpu = [results[n][1]["machine"] for n in sorted(NEEDS_CUDA) if n in results]
    if ran_cuda:
        return [f"- GPU: this run also ran the GPU suite on {gpu[0]['gpu']}: "
                f"[{GPU_DOC}]({GPU_DOC})"]
    if gpu:
        return [f"- GPU: this run had no CUDA device, so the GPU suite did not run; "
                f"[{GPU_DOC}]({GPU_DOC}) holds the tables of the last run that had one "
                f"({gpu[0]['date']}, {gpu[0]['gpu']})"]
    return ["- GPU: this run had no CUDA device, and no GPU run has been recorded yet"]


def rel(out: Path, doc: Path, name: str, png: str) -> str:
    """The path of OUT/<name>/<png> as the page links it."""
    return os.path.relpath(out / name / png, doc.parent)


def write_doc(doc: Path, out: Path, results: dict[str, tuple[str, dict[str, Any]]],
              run: dict[str, Any], ran_cuda: bool) -> None:
    """Writes the CPU page from one run's results."""
    lines = ["# Benchmarks", "", "Generated by `make bench` (`PYTHONPATH=. python "
             f"bench/run_all.py`); {provenance(run)}", "",
             *machine_lines(results["matrix"][1]["machine"]), *run_lines(run),
             *cluster_lines(run),
             *gpu_lines(results, ran_cuda), ""]
    lines += matrix.doc_section(*results["matrix"], rel(out, doc, "matrix", "matrix.png"))
    lines += pipeline_section(*results["pipeline_throughput_b64"], rel(
        out, doc, "pipeline_throughput_b64", "throughput.png"))
    lines += stream_section(*results["stream_vs_tcp"])
    lines += hop_latency.doc_section(*results["hop_latency"])
    lines += store.doc_section(*results["store"], rel(out, doc, "store", "store.png"))
    lines += backward_section(*results["backward_worker"])
    lines += schedules_section(*results["schedules"], rel(out, doc, "schedules",
                                                           "schedules.png"))
    lines += scaling.doc_section(*results["scaling"], rel(out, doc, "scaling", "scaling.png"))
    lines += planner_section(*results["planner"], rel(out, doc, "planner", "planner.png"))
    lines += sim_accuracy.doc_section(*results["sim_accuracy"], rel(
        out, doc, "sim_accuracy", "sim_accuracy.png"))
    lines += groups_doc.doc_section(*results["groups"], rel(out, doc, "groups", "groups.png"))
    for name in ("replan", "replan_layer"):
        lines += replan.doc_section(*results[name], rel(out, doc, name, "replan.png"))
    lines += READING
    lines += [FINDINGS.read_text().rstrip(), ""]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(lines))


def write_gpu_doc(doc: Path, out: Path, results: dict[str, tuple[str, dict[str, Any]]]
                  ) -> None:
    """Writes the GPU page from the GPU entries' results (one run on a CUDA machine)."""
    first = next(results[n][1] for n in BENCHES if n in NEEDS_CUDA and n in results)
    lines = ["# Benchmarks on a GPU", "", "The GPU entries of `bench/run_all.py`, which "
             "`make bench` runs on a machine with a CUDA device; each section gives its "
             "command, and the date below is the first entry's (CPU tables: "
             "[benchmarks.md](benchmarks.md)). They run pipefb's systems and `single` with "
             "CUDA tensors; the transport, store, scaling, planner, simulator and "
             "re-planning benches time CPU tensors wherever they run and are on the CPU "
             "page.", "", *machine_lines(first["machine"]), ""]
    missing = [n for n in sorted(NEEDS_CUDA) if n not in results]
    lines += [f"- not in this page yet: `{n}` (no GPU run of it recorded)" for n in missing]
    lines += [""] if missing else []
    if "matrix_cuda" in results:
        lines += matrix.doc_section(*results["matrix_cuda"], rel(out, doc, "matrix_cuda",
                                                                  "matrix.png"))
    if "schedules_cuda" in results:
        lines += schedules_section(*results["schedules_cuda"], rel(
            out, doc, "schedules_cuda", "schedules.png"))
    if "offload_cuda" in results:
        lines += matrix.offload_section(*results["offload_cuda"])
    lines += GPU_READING
    doc.write_text("\n".join(lines))


def saved(name: str, out: Path) -> tuple[str, dict[str, Any]] | None:
    """The saved results of entry `name` and their command; None if a GPU entry has none."""
    path = out / name / "results.json"
    if name in NEEDS_CUDA and not path.exists():
        return None
    return saved_command(name, out), json.loads(path.read_text())


def record_run(out: Path, seconds: dict[str, float], complete: bool,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """OUT/run.json, how long each bench took (and `extra`, what else a complete run
    records): a complete run replaces it (with its total);
    a partial one merges its benches in, drops the total and dates them under "rerun"; a
    run of nothing (`--doc-only`) reads it as it is."""
    path = out / "run.json"
    run = json.loads(path.read_text()) if path.exists() else {}
    if not seconds:
        return run
    if complete:
        run = {"total_seconds": sum(seconds.values()), "seconds": {}, **(extra or {})}
    else:
        run.pop("total_seconds", None)
        run["rerun"] = {**run.get("rerun", {}), **dict.fromkeys(seconds, machine.now())}
    run["seconds"] = {**run.get("seconds", {}), **{k: round(v, 1) for k, v in seconds.items()}}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=1))
    return run


def main(argv: list[str] | None = None) -> None:
    """Runs every bench this machine can (or those `--only` names) and writes the pages."""
    import torch

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="CI sizes")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--doc-only", action="store_true",
                   help="rewrite the pages from the results already in OUT, running nothing")
    p.add_argument("--only", nargs="+", choices=list(BENCHES), default=None,
                   help="run only these entries; the others come from OUT's saved results")
    args = p.parse_args(argv)
    out, doc = args.out.resolve(), args.doc.resolve()
    cuda = torch.cuda.is_available()
    if not cuda:
        print(f"no CUDA device here: the GPU entries ({', '.join(sorted(NEEDS_CUDA))}) do "
              "not run, and the CPU page says so", flush=True)
    seconds: dict[str, float] = {}
    results: dict[str, tuple[str, dict[str, Any]] | None] = {}
    complete = not args.doc_only and not args.only
    cluster: dict[str, Any] = {}
    if complete and not args.quick:
        measure_cluster(cluster)
    for name in BENCHES:
        here = cuda or name not in NEEDS_CUDA
        wanted = not args.doc_only and (not args.only or name in args.only)
        results[name] = (run_bench(name, out, args.quick, seconds) if here and wanted
                         else saved(name, out))
    found = {name: r for name, r in results.items() if r is not None}
    ran_cuda = any(name in NEEDS_CUDA for name in seconds)
    run = record_run(out, seconds, complete=complete, extra=cluster)
    write_doc(doc, out, found, run, ran_cuda)
    print(f"wrote {doc}")
    if (ran_cuda or args.doc_only) and any(name in found for name in NEEDS_CUDA):
        write_gpu_doc(doc.parent / GPU_DOC, out, found)
        print(f"wrote {doc.parent / GPU_DOC}")


if __name__ == "__main__":
    main()
