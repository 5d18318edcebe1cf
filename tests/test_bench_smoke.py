"""Smoke test of the bench suite at `--quick` size: `bench/run_all.py --quick` runs every
entry once (as `make bench` does at full size) and writes the page; each bench's outputs
are complete and sane. No timing assertions: the figures depend on the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# the suite runs once, in the first test that asks for it: its time counts there
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT of one `run_all.py --quick` run; the page is OUT/docs/benchmarks.md."""
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    subprocess.run([sys.executable, "bench/run_all.py", "--quick", "--out", str(out),
                    "--doc", str(out / "docs" / "benchmarks.md")],
                   cwd=ROOT, env=env, check=True, timeout=1400)
    return out


def load(out: Path, name: str) -> dict:
    return json.loads((out / name / "results.json").read_text())


def assert_summary(s: dict) -> None:
    assert set(s) == {"median", "min", "max", "n"}
    assert 0 < s["min"] <= s["median"] <= s["max"] and s["n"] >= 1


def test_pipeline_throughput_b64_quick(suite: Path) -> None:
    from bench.pipeline_throughput import RATIOS, SYSTEMS

    res = load(suite, "pipeline_throughput_b64")
    assert (suite / "pipeline_throughput_b64" / "throughput.png").stat().st_size > 0
    assert {"machine", "args", "command", "models", "targets"} <= set(res)
    for model in res["models"].values():
        assert set(model["samples_per_second"]) == set(SYSTEMS)
        for s in SYSTEMS:
            assert_summary(model["samples_per_second"][s])
            assert model["max_loss_diff_vs_single"][s] < 1e-3  # every system trains the same
        assert set(model["ratios"]) == {f"{a}/{b}" for a, b in RATIOS}
        assert all(r["median"] > 0 for r in model["ratios"].values())
        assert 0 < model["boundary"] < model["layers"]


def test_stream_vs_tcp_quick(suite: Path) -> None:
    res = load(suite, "stream_vs_tcp")
    assert res["tensor_bytes"] == 1 << 20
    assert set(res["mb_per_second"]) == {"grpc", "tcp", "grpc_call_per_transfer"}
    for s in (*res["mb_per_second"].values(), *res["seconds"].values(),
              *res["breakdown_seconds"].values()):
        assert_summary(s)
    assert res["ratio_grpc_over_tcp"]["median"] > 0
    assert res["ratio_grpc_call_per_transfer_over_tcp"]["median"] > 0
    for model, push in res["weight_push"].items():  # every parameter of the bench's model
        assert push["tensors"] == {"mlp": 10, "gpt": 53}[model]
        # packed: as many 1 MiB messages as the bytes need; else one (or more) per tensor
        assert push["messages"]["packed"] == -(-push["bytes"] // (1 << 20))
        assert push["messages"]["one_tensor_per_message"] >= push["tensors"]
        for s in (*push["seconds"].values(), push["speedup"]):
            assert_summary(s)


def test_schedules_quick(suite: Path) -> None:
    from bench.schedules import BASELINE, SYSTEMS

    res = load(suite, "schedules")
    assert (suite / "schedules" / "schedules.png").stat().st_size > 0
    assert set(res["workers"]) == {"4"}  # 2 workers: the matrix
    for n, r in res["workers"].items():
        assert set(r["step_seconds"]) == set(SYSTEMS)
        for s in SYSTEMS:
            assert_summary(r["step_seconds"][s])
            assert len(r["ranks"][s]) == int(n)
            assert all(rank["peak"] > 0 for rank in r["ranks"][s].values())
        assert r["speedup_vs_baseline"][BASELINE]["median"] == 1.0
        # offload moves PipeDream's stash out of the first worker: less activation memory
        assert (r["ranks"]["pipedream-offload"]["0"]["activation"]
                < r["ranks"]["pipedream-keep"]["0"]["activation"])


def test_planner_quick(suite: Path) -> None:
    import math

    from bench.planner import RATIOS, SYSTEMS
    from bench.planner_sim import KIND_MODES
    from bench.planner_sim import RATIOS as SIM_RATIOS

    res = load(suite, "planner")
    assert (suite / "planner" / "planner.png").stat().st_size > 0
    sim = res["simulated"]
    kinds = [name for name, _, _ in KIND_MODES]
    assert set(sim["systems"]) == {
        "gpipe", "1f1b", "pipedream-keep", "pipedream-offload", "pipefb-offload", "planner",
        "planner-free-m", *(f"planner-{k}" for k in kinds), *(f"even-{k}" for k in kinds)}
    for name, r in sim["systems"].items():
        assert math.isfinite(r["step_seconds"]) and r["step_seconds"] > 0, name
        assert r["max_peak_bytes"] > 0 and len(r["peak_bytes"]) == 8, name
    assert all(sim["systems"][s]["fits"] for s in sim["systems"] if s.startswith("planner"))
    assert sim["systems"]["pipedream-offload"]["policy"] == "offload 27"
    assert sim["systems"]["pipefb-offload"]["schedule"] == "pipefb"
    assert set(sim["ratios"]) == set(SIM_RATIOS)
    assert all(math.isfinite(r["value"]) and r["value"] > 0 for r in sim["ratios"].values())
    assert [r["ratio"] > 0 for r in sim["store_sweep"]] == [True, True]
    measured = res["measured"]["workers"]
    assert set(measured) == {"2"}
    r = measured["2"]
    assert set(r["samples_per_second"]) == set(SYSTEMS)
    for s in SYSTEMS:
        assert_summary(r["samples_per_second"][s])
        assert r["max_peak_bytes"][s] > 0
    for s in ("gpipe", "1f1b", "pipedream", "pipefb"):  # plan auto kept the fixed schedule
        assert r["plans"][f"auto-{s}"]["label"].startswith(s)
        assert r["plans"][f"even-{s}"]["label"].startswith(s)
    assert r["plans"]["even-pipefb"]["label"].startswith("pipefb sync 1F+1B")
    assert set(r["ratios"]) == set(RATIOS)
    assert all(v["median"] > 0 for v in r["ratios"].values())


def test_sim_accuracy_quick(suite: Path) -> None:
    from bench.sim_accuracy import SCHEDULES, doc_section

    res = load(suite, "sim_accuracy")
    assert (suite / "sim_accuracy" / "sim_accuracy.png").stat().st_size > 0
    assert [(r["model"], r["schedule"], r["workers"]) for r in res["runs"]] == [
        ("mlp", s, 2) for s in SCHEDULES]
    assert res["args"]["repeats"] == 2  # quick mode's cap
    # quick mode plans both rounds on the cached calibration, and the page says so
    first, second = res["clusters"]
    assert first == second and first["network"]["latency"] > 0
    assert f"Predicted on the local cluster calibrated at {first['measured']}" in "\n".join(
        doc_section("cmd", res, "x.png"))
    for r in res["runs"]:
        m = r["measured"]
        assert_summary({k: m[k] for k in ("median", "min", "max", "n")})
        assert m["min"] <= m["mean"] <= m["max"]  # the timed steps' wall time over their count
        assert m["n"] == r["steps"] == 2  # quick mode's `--steps 2` overrides the model's
        assert r["predicted"] > 0 and r["in_situ"]["step_seconds"] > 0
        assert r["error"] == pytest.approx(r["predicted"] / m["mean"] - 1)
        # two runs, one per round: the row is the one of lower error (the median-low),
        # with its own step time and prediction
        trials = r["trials"]
        assert [t["round"] for t in trials] == [0, 1]
        row = min(trials, key=lambda t: t["error"])
        assert (row["measured"], row["predicted"], row["error"]) == (
            m["mean"], r["predicted"], r["error"])
        assert all(t["error"] == pytest.approx(t["predicted"] / t["measured"] - 1)
                   for t in trials)
        assert all(f > 0 for f in r["in_situ"]["factors"].values())
    assert res["in_situ_abs_error"]["n"] == len(SCHEDULES)
    assert len(doc_section("cmd", res, "x.png")) > len(SCHEDULES) + 4


def test_groups_quick(suite: Path) -> None:
    from bench.groups import RATIOS, SYSTEMS
    from bench.groups_doc import doc_section

    res = load(suite, "groups")
    assert (suite / "groups" / "groups.png").stat().st_size > 0
    models = res["measured"]["models"]
    assert set(models) == {"mlp", "gpt"}
    for r in models.values():
        assert set(r["samples_per_second"]) == set(SYSTEMS)
        for s in SYSTEMS:
            assert_summary(r["samples_per_second"][s])
            assert_summary(r["predicted_samples_per_second"][s])
        assert r["groups"]["1x2"] == 1 and r["groups"]["2x1"] == 2
        assert r["groups"]["auto"] in (1, 2)
        assert set(r["ratios"]) == set(RATIOS) and all(
            v > 0 for v in r["predicted_ratios"].values())
        for fixed in ("1x2", "2x1"):  # the same plan trains the same: auto's loss is its pick's
            if r["plans"]["auto"] == r["plans"][fixed]:
                assert r["final_loss"]["auto"] == r["final_loss"][fixed]
    sizes = res["simulated"]["sizes"]
    assert set(sizes) == {"8", "16"}
    for n, r in sizes.items():
        assert set(r["rows"]) >= {"1", n}  # the single pipeline and pure DP were searched
        assert r["ghp_over_exhaustive"] >= 0.95
        assert r["rows"][str(r["ghp_groups"])]["samples_per_second"] > 0
    assert len(doc_section("cmd", res, "x.png")) > 10


def test_replan_quick(suite: Path) -> None:
    from bench.replan import SYSTEMS, doc_section

    res = load(suite, "replan")
    assert (suite / "replan" / "replan.png").stat().st_size > 0
    meas = res["measured"]
    assert set(meas["curves"]) == set(SYSTEMS)
    assert all(len(c) == res["args"]["steps"] for c in meas["curves"].values())
    for r in meas["recovery"].values():
        assert_summary(r)
    assert "## Online re-planning" in "\n".join(doc_section("cmd", res, "replan.png"))


def test_store_quick(suite: Path) -> None:
    from bench.store import PATHS, ROUND_TRIP, doc_section

    res = load(suite, "store")
    assert (suite / "store" / "store.png").stat().st_size > 0
    meas = res["measured"]
    assert meas["bytes"] == 56 * 4 * (65536 + 131072) // 2 // 8 and meas["rounds"] == 3
    for p in PATHS:
        assert_summary(meas["mb_per_second"][p])
    for r in meas["ratios"].values():
        assert_summary(r)
    bw = res["bandwidth"]
    assert bw["sizes_mib"] == [1] and bw["repeats"] == 2
    for r in bw["sizes"].values():
        assert set(r["round_trip_mib_per_second"]) == set(ROUND_TRIP)
        for p in ROUND_TRIP:
            assert_summary(r["round_trip_mib_per_second"][p])
        assert set(r["vs_memcpy"]) == set(ROUND_TRIP) - {"memcpy"}
    page = "\n".join(doc_section("cmd", res, "store.png"))
    assert "## Offload store against plain redis-py" in page
    assert "| 1 MiB |" in page


def test_the_store_page_renders_results_saved_before_newer_paths() -> None:
    """`run_all.py --doc-only` renders the store's saved results, whose bandwidth part
    predates some of `ROUND_TRIP`'s paths: the table shows the paths they measured."""
    from bench.store import ROUND_TRIP, bandwidth_lines

    res = json.loads((ROOT / "bench" / "results" / "store" / "results.json").read_text())
    bw = res["bandwidth"]
    for r in bw["sizes"].values():  # as saved by the bench before the newest path
        r["round_trip_mib_per_second"].pop(ROUND_TRIP[-1], None)
        r["vs_memcpy"].pop(ROUND_TRIP[-1], None)
    measured = list(next(iter(bw["sizes"].values()))["round_trip_mib_per_second"])
    lines = bandwidth_lines(bw)
    header = next(line for line in lines if line.startswith("| stash |"))
    assert header == ("| stash | " + " | ".join(p for p in ROUND_TRIP if p in measured)
                      + " | " + " | ".join(f"{p} / memcpy" for p in ROUND_TRIP[1:]
                                           if p in measured) + " |")
    assert sum(line.startswith("| 64 MiB |") for line in lines) == 1


def test_scaling_quick(suite: Path) -> None:
    from bench.scaling import doc_section

    res = load(suite, "scaling")
    assert (suite / "scaling" / "scaling.png").stat().st_size > 0
    meas = res["measured"]
    assert set(meas["step_seconds"]) == {"1f1b x1", "1f1b x2", "1f1b x4", "pipefb x2",
                                         "pipefb x4", "depth 2", "depth 4", "depth 8"}
    for s in meas["step_seconds"].values():
        assert_summary(s)
        assert s["n"] == 2  # 2 timed steps, 1 repeat
    assert meas["speedup_over_1"]["1f1b x1"] == 1.0
    assert "## Scaling" in "\n".join(doc_section("cmd", res, "scaling.png"))


def test_matrix_quick(suite: Path) -> None:
    from bench.matrix import ASYNC, PIPEFB, RATIOS, SYSTEMS, TORCH

    res = load(suite, "matrix")
    assert (suite / "matrix" / "matrix.png").stat().st_size > 0
    assert res["systems"] == list(SYSTEMS) and res["skipped"] == {}  # cpu: every system
    assert set(res["models"]) == {"mlp", "convnet", "gpt"}
    for name, m in res["models"].items():
        assert set(m["samples_per_second"]) == set(SYSTEMS) == set(m["efficiency"])
        for s in SYSTEMS:
            assert_summary(m["samples_per_second"][s])
            assert_summary(m["efficiency"][s])
            assert 0.0 <= m["bubble"][s] < 1.0
            ranks = m["ranks"][s]
            assert len(ranks) == (1 if s == "single" else 2), (name, s)
            # every rank holds parameters at least, and activations no more than its peak
            assert all(0 < r["activation"] <= r["peak"] for r in ranks.values()), (name, s)
        assert m["efficiency"]["single"]["median"] == pytest.approx(1.0)
        assert m["bubble"]["single"] == 0.0
        assert m["bubble"]["torch-1f1b"] == m["bubble"]["1f1b"]  # the same split and schedule
        # 2 stages of 1F1B/GPipe leave a bubble; the sync systems train as one process does
        assert m["bubble"]["1f1b"] > 0 and m["bubble"]["gpipe"] > 0
        for s in SYSTEMS:
            if s not in ASYNC and s != "auto":
                bound = 1e-4 if s in TORCH else 0.0  # torch scales gradients its own way
                assert m["max_loss_diff_vs_single"][s] <= bound, (name, s)
        assert set(m["plans"]) == set(PIPEFB) == set(m["store_blocked_share"])
        # a system that never stashes never waits on the store
        assert m["store_blocked_share"]["pipedream-keep"]["max"] == 0.0
        assert m["store_blocked_share"]["pipefb-sync"]["min"] > 0.0
        assert set(m["ratios"]) == {f"{a}/{b}" for a, b in RATIOS}
        assert all(r["median"] > 0 for r in m["ratios"].values())


def test_backward_worker_quick(suite: Path) -> None:
    res = load(suite, "backward_worker")
    for side in ("worker_backward", "eager_backward"):
        ms = res[side]
        assert 0 < ms["min_ms"] <= ms["median_ms"] <= ms["max_ms"] and ms["n"] >= 2, side
    assert res["ratio_min"] <= res["ratio_median"] <= res["ratio_max"]
    assert res["args"]["rounds"] == 2


def test_replan_layer_quick(suite: Path) -> None:
    from bench.replan import SYSTEMS

    res = load(suite, "replan_layer")
    assert res["args"]["scenario"] == "layer" and res["args"]["repeats"] == 1
    assert set(res["measured"]["curves"]) == set(SYSTEMS)


def test_the_page_has_every_section_and_says_where_the_gpu_tables_are(suite: Path) -> None:
    import torch

    page = (suite / "docs" / "benchmarks.md").read_text()
    for heading in ("## Every system on every model (CPU", "### mlp", "### convnet", "### gpt",
                    "## Pipeline throughput, 16 samples per micro-batch",
                    "## gRPC tensor stream vs raw TCP", "## Same-host hop latency",
                    "## Offload store against plain",
                    "## Backward-only worker", "## Schedules and activation policies",
                    "## Scaling", "## Planner", "## Online re-planning"):
        assert heading in page, heading
    run = json.loads((suite / "run.json").read_text())
    assert run["total_seconds"] == pytest.approx(sum(run["seconds"].values()), abs=1)
    assert f"- duration: {run['total_seconds'] / 60:.1f} minutes in all" in page
    if not torch.cuda.is_available():
        assert "this run had no CUDA device, so the GPU suite did not run" in page or \
            "this run had no CUDA device, and no GPU run has been recorded yet" in page
        assert not (suite / "docs" / "benchmarks-gpu.md").exists()
    for png in ("matrix/matrix.png", "scaling/scaling.png"):  # the page's links resolve
        assert f"../{png}" in page and (suite / png).exists()


def test_a_partial_rerun_dates_its_entries_and_a_whole_run_clears_them(tmp_path: Path) -> None:
    from bench.run_all import provenance, record_run

    whole = record_run(tmp_path, {"matrix": 10.0, "store": 2.0}, complete=True)
    assert whole["total_seconds"] == 12.0 and provenance(whole).startswith("every figure")
    partial = record_run(tmp_path, {"store": 3.0}, complete=False)
    assert "total_seconds" not in partial and set(partial["rerun"]) == {"store"}
    assert partial["seconds"] == {"matrix": 10.0, "store": 3.0}
    text = provenance(partial)
    assert f"store ({partial['rerun']['store']})" in text and "matrix" not in text
    again = record_run(tmp_path, {"matrix": 11.0}, complete=False)
    assert set(again["rerun"]) == {"store", "matrix"}  # reruns add up until a whole run
    assert "rerun" not in record_run(tmp_path, {"matrix": 9.0, "store": 1.0}, complete=True)


def test_a_whole_run_records_the_cluster_it_measured_and_its_page_says_so(tmp_path: Path
                                                                          ) -> None:
    from bench.run_all import cluster_lines, record_run
    from pipefb.sim.cluster import Cluster, Link, WorkerSpec

    cluster = Cluster((WorkerSpec("w0", host="local"),), network=Link(2e9, 3e-4, cpu=1.5),
                      store=Link(1e9, 4e-4), host_cores={"local": 2},
                      loopback_hosts=frozenset({"local"}), step_cpu=5e-4,
                      host_oversubscribed={"local": 0.9})
    extra = {"cluster": cluster.to_dict(), "cluster_measured": "2026-11-25 15:00 UTC"}
    run = record_run(tmp_path, {"matrix": 10.0}, complete=True, extra=extra)
    (line,) = cluster_lines(run)
    assert "measured at 2026-11-25 15:00 UTC" in line
    assert "loopback gRPC 0.30 ms + bytes at 2.00 GB/s (1.50 cores busy)" in line
    assert "step call 0.50 ms of CPU, 2 cores at 0.90" in line
    assert record_run(tmp_path, {"store": 1.0}, complete=False)["cluster"] == extra["cluster"]
    assert cluster_lines({}) == []  # a quick run measures nothing


def test_the_matrix_page_drops_the_torch_column_where_torch_did_not_run() -> None:
    """The GPU run (committed results) skips torch's systems: its tables have no
    `vs torch-1f1b` column, and every row has as many cells as the header."""
    from bench.matrix import TORCH, doc_section

    res = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results"
                      / "matrix_cuda" / "results.json").read_text())
    assert set(res["skipped"]) == set(TORCH)
    lines = doc_section("cmd", res, "m.png")
    table = [ln for ln in lines if ln.startswith("|")]
    header = table[0]
    assert "vs single" in header and "torch" not in header
    assert all(ln.count("|") == header.count("|") for ln in table)
    assert len(table) == len(res["models"]) * (2 + len(res["systems"]))


def test_the_offload_section_reports_each_gpu_target_with_both_peaks() -> None:
    """The GPU offload entry's table: one row per model and target, met or not by the
    median, with the system's and the baseline's peak per worker."""
    from bench.matrix import OFFLOAD_TARGETS, offload_section

    def ranks(mib: float) -> dict[str, dict[str, float]]:
        return {"0": {"peak": mib * 2**20}, "1": {"peak": 2 * mib * 2**20}}

    ratio = {"pipedream-offload/pipedream-keep": {"median": 0.81, "min": 0.7, "max": 0.9},
             "pipefb-async/pipedream-offload": {"median": 1.49, "min": 1.4, "max": 1.6}}
    res = {"args": {"batch": 16, "microbatches": 4, "steps": 6, "warmup": 2, "repeats": 2},
           "workers": 2,
           "models": {"gpt": {"ratios": ratio, "ranks": {
               "pipedream-offload": ranks(1.0), "pipedream-keep": ranks(3.0),
               "pipefb-async": ranks(1.5)}}}}
    rows = [ln for ln in offload_section("cmd", res) if ln.startswith("| gpt ")]
    assert rows == [
        "| gpt | pipedream-offload / pipedream-keep | 0.81 [0.70-0.90] | >= 0.8 | yes | "
        "1.00 / 2.00; 3.00 / 6.00 |",
        "| gpt | pipefb-async / pipedream-offload | 1.49 [1.40-1.60] | >= 1.5 | no | "
        "1.50 / 3.00; 1.00 / 2.00 |"]  # no sync PipeFB ran: no row for it
    assert len(OFFLOAD_TARGETS) == 3


def test_the_matrix_refuses_a_model_it_does_not_know() -> None:
    from bench.matrix import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--models", "gpt,gtp"])
    assert parse_args(["--models", "gpt-large", "--quick"]).models == "gpt-large"


def test_the_matrix_times_each_model_for_its_own_steps() -> None:
    """Without `--steps`/`--warmup` each model runs its `STEPS` (the small models' 5 ms
    steps 300 times); the flags override; the page names the steps of each model, and a
    result from before the per-model steps reads its flags."""
    from bench.matrix import parse_args, steps_of, steps_text

    default = parse_args([])
    assert (steps_of("mlp", default), steps_of("gpt", default)) == ((20, 300), (2, 10))
    assert steps_of("mlp", parse_args(["--steps", "5"])) == (20, 5)
    assert steps_of("convnet", parse_args(["--warmup", "3"])) == (3, 300)
    assert steps_of("gpt", parse_args(["--quick"])) == (1, 2)
    res = {"args": {"steps": 0, "warmup": -1}, "models": {"mlp": {}, "gpt": {}},
           "steps": {"mlp": [20, 300], "gpt": [2, 10]}}
    assert steps_text(res) == ("mlp: 300 timed steps after 20 warm-up; "
                               "gpt: 10 timed steps after 2 warm-up")
    assert steps_text({**res, "steps": {"gpt": [2, 10]}}) == "10 timed steps after 2 warm-up"
    older = {"args": {"steps": 6, "warmup": 2}, "models": {"gpt": {}}}
    assert steps_text(older) == "6 timed steps after 2 warm-up"


def test_a_device_run_s_models_merge_into_the_offload_entry(tmp_path: Path) -> None:
    """bench/merge_device.py: device_run.sh's per-model results become offload_cuda's one
    results.json (and chart); runs of other settings are refused, a model's partial run
    (stopped after a repeat) keeps its count."""
    from bench.matrix import offload_section, repeats_done
    from bench.merge_device import main as merge_main

    def part(model: str, **args: object) -> dict:
        summary = {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}
        return {"bench": "matrix", "workers": 2, "systems": ["single"], "wall_seconds": 10.0,
                "args": {"batch": 16, "microbatches": 4, "steps": 6, "warmup": 2,
                         "repeats": 2, "models": model, "out": f"x/{model}", **args},
                "models": {model: {"samples_per_second": {"single": summary},
                                   "efficiency": {"single": summary}, "ratios": {},
                                   "ranks": {"single": {"0": {"peak": 2**20}}}}}}

    device = tmp_path / "device"
    for model, extra in (("gpt", {}), ("gpt-large", {"repeats_done": 1})):
        (device / model).mkdir(parents=True)
        (device / model / "results.json").write_text(json.dumps({**part(model), **extra}))
    merge_main([str(device), "--out", str(tmp_path / "results")])
    merged = load(tmp_path / "results", "offload_cuda")
    assert list(merged["models"]) == ["gpt", "gpt-large"]
    assert merged["args"]["models"] == "gpt,gpt-large" and merged["wall_seconds"] == 20.0
    assert (tmp_path / "results" / "offload_cuda" / "matrix.png").stat().st_size > 0
    assert repeats_done(merged) == 1  # gpt-large's run stopped after its first repeat
    assert "1 repeat(s)" in "\n".join(offload_section("cmd", merged))
    (device / "gpt-large" / "results.json").write_text(json.dumps(part("gpt-large", steps=4)))
    with pytest.raises(SystemExit, match="steps"):
        merge_main([str(device), "--out", str(tmp_path / "results")])


def test_the_stash_path_probe_times_every_cpu_part(tmp_path: Path) -> None:
    """bench/stash_path.py on the CPU (device_run.sh runs it on CUDA): every part, idle and
    busy, with positive times and the stash's bytes."""
    from bench.stash_path import LAYERS, TENSORS
    from bench.stash_path import main as stash_main

    res = stash_main(["--rounds", "2", "--mib", "1", "--out", str(tmp_path)])
    tensors = LAYERS * TENSORS  # float32 tensors of equal size, 1 MiB in all (rounded down)
    nbytes = tensors * 4 * ((1 << 20) // 4 // tensors)
    assert res["bytes"] == nbytes and res["tensors"] == tensors
    for kind in ("idle", "busy"):
        assert set(res["seconds"][kind]) == {"tier put", "tier take", "one copy"}
        for s in res["seconds"][kind].values():
            assert_summary(s)
            assert s["n"] == 2
    assert json.loads((tmp_path / "results.json").read_text())["bytes"] == nbytes
