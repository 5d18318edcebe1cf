"""The `pipefb` command line: one-line errors with status 2, and `local train` end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipefb.app.cli import main
from pipefb.job.config import JobConfig, build_layers

ROOT = Path(__file__).resolve().parent.parent
BASE = ["local", "train", "--model", "mlp", "--dataset", "digits", "--loss", "cross_entropy",
        "--schedule", "gpipe", "--workers", "2", "--batch-size", "8", "--microbatches", "4",
        "--steps", "1", "--optimizer", "sgd", "--lr", "0.1", "--seed", "0"]


def with_flag(flag: str, value: str) -> list[str]:
    args = list(BASE)
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    return args


BAD = [
    ("--model", "nosuchmodel", "nosuchmodel"),
    ("--dataset", "nosuchdata", "nosuchdata"),
    ("--loss", "hinge", "hinge"),
    ("--schedule", "zigzag", "zigzag"),
    ("--optimizer", "rmsprop", "rmsprop"),
    ("--model-config", "{not json", "{not json"),
    ("--dataset-config", "[1, 2]", "[1, 2]"),
    ("--microbatches", "3", "microbatches 3"),
    ("--workers", "9", "9 workers"),
    ("--lr", "-1", "-1"),
    ("--loss", "mse", "loss 'mse' do not fit: layer 4 (MSE) does not take [2, 10]"),
    ("--batch-size", str(1 << 20), "batch_size 1048576 is more than the 65536"),
    ("--max-restarts", "101", "max_restarts 101 must be an integer in 0..100"),
    ("--slowdown", "1=0.5", "slowdown entry '1=0.5' is not RANK=FACTOR[@STEP] or LLAYER"),
    ("--slowdown", "1=2@x", "'1=2@x'"),
    ("--slowdown", "5=2", "slowdown names rank 5; the job has ranks 0..1"),
    ("--slowdown", "L9=2@3", "slowdown names layer 9; model 'mlp' has layers 0..4"),
    ("--warmup-steps", "-1", "warmup_steps -1 must be an integer >= 0"),
    ("--min-lr", "5", "min_lr 5.0 must be a finite number in 0..lr"),
    ("--lr-schedule", "step", "unknown lr schedule 'step'"),
    ("--clip-grad-norm", "-2", "clip_grad_norm -2.0 must be a finite number > 0"),
    ("--clip-grad-norm", "nan", "clip_grad_norm nan"),
    ("--precision", "fp8", "unknown precision 'fp8'"),
    ("--initial-loss-scale", "0", "initial_loss_scale 0.0 must be a finite number > 0"),
    ("--loss-scale-window", "0", "loss_scale_window 0 must be an integer >= 1"),
    ("--initial-loss-scale", "128", "initial_loss_scale 128.0 applies to precision 'fp16' "
                                    "only; this job's is 'fp32'"),
    ("--staleness-microbatches", "5", "staleness_microbatches 5 must be an integer in 0..4"),
]


@pytest.mark.parametrize(("flag", "value", "named"), BAD)
def test_bad_argument_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], flag: str,
                                            value: str, named: str) -> None:
    assert main(with_flag(flag, value)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pipefb: error:"), err
    assert named in err


def test_unparsable_number_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(with_flag("--workers", "four"))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'four'" in err


def test_real_process_exit_status_for_bad_model() -> None:
    proc = subprocess.run([sys.executable, "-m", "pipefb.app.cli", *with_flag("--model", "nope")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "nope" in proc.stderr


def run_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipefb.app.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def assert_metrics_urls_shown(output: str, manifest: Path) -> None:
    """`--metrics`: a `metrics NAME -> URL` line per service, the URLs in cluster.json."""
    lines = [line.split() for line in output.splitlines() if line.startswith("metrics ")]
    shown = {name: url for _, name, arrow, url in lines if arrow == "->"}
    kept = {name: entry["metrics"] for name, entry in json.loads(manifest.read_text()).items()
            if "metrics" in entry}
    assert shown == kept
    assert sorted(shown) == ["coordinator", "worker-0", "worker-1", "worker-2", "worker-3"]
    assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url) for url in shown.values())


GPT = ["local", "train", "--model", "gpt", "--model-config",
       '{"n_layer": 2, "n_embd": 32, "block_size": 16}', "--dataset", "text",
       "--dataset-config", '{"block_size": 16, "max_bytes": 100000}', "--loss", "cross_entropy",
       "--workers", "4", "--batch-size", "8", "--microbatches", "4", "--steps", "3",
       "--optimizer", "adamw", "--lr", "0.01", "--seed", "3", "--no-progress"]


def test_local_train_writes_the_report_and_matches_single(tmp_path: Path) -> None:
    runs = {}
    for schedule in ("pipefb", "single"):
        out = tmp_path / schedule
        metrics = ["--metrics"] if schedule == "pipefb" else []  # must not change results
        proc = run_cli([*GPT, "--schedule", schedule, "--out", str(out), *metrics])
        assert proc.returncode == 0, proc.stderr[-2000:]
        if metrics:
            assert_metrics_urls_shown(proc.stderr, out / "logs" / "cluster.json")
        report = json.loads((out / "report.json").read_text())
        runs[schedule] = report, load_file(str(out / "weights.safetensors"))
        assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert {"schedule", "workers", "steps", "samples_per_second", "peak_memory_bytes",
                "plan"} <= set(report)
        assert [s["step"] for s in report["steps"]] == [0, 1, 2]
        assert all(s["samples_per_second"] > 0 and s["seconds"] > 0 for s in report["steps"])
    report, weights = runs["pipefb"]
    assert report["workers"] == 4 and sorted(report["peak_memory_bytes"]) == ["0", "1", "2", "3"]
    assert report["plan"]["schedule"] == "pipefb"
    assert (tmp_path / "pipefb" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    spans = {r["rank"]: [a for a, _, _ in r["spans"]] for r in report["timeline"]["ranks"]}
    assert spans[0][:3] == ["0RECV_W", "0F0", "0STASH0"] and spans[3][-2:] == ["1OPT", "1PUSH_W"]
    last = report["steps"][-1]["workers"]
    assert all(w["action_seconds"]["F"] > 0 for w in last if w["role"] == "forward")
    assert all(w["action_seconds"]["B"] > 0 for w in last if w["role"] == "backward")
    assert [a["role"] for a in report["plan"]["assignment"]] == ["forward"] * 2 + ["backward"] * 2
    job = JobConfig(model="gpt", model_config={"n_layer": 2, "n_embd": 32, "block_size": 16})
    names = {f"layers.{i}.{n}" for i, layer in enumerate(build_layers(job))
             for n, _ in layer.named_parameters()}
    assert set(weights) == names
    single_report, single_weights = runs["single"]
    torch.testing.assert_close(torch.tensor([s["loss"] for s in report["steps"]]),
                               torch.tensor([s["loss"] for s in single_report["steps"]]),
                               rtol=1e-5, atol=0)
    for name in names:
        torch.testing.assert_close(weights[name], single_weights[name], rtol=1e-5, atol=1e-7)


def test_plain_progress_lines_are_written_whole(capsys: pytest.CaptureFixture[str]) -> None:
    from pipefb.app.train import StepProgress

    held_out = {f"metric_{k}": k / 8 for k in range(8)}  # a line longer than a console
    StepProgress(None, None).update(
        {"step": 4, "loss": 0.5, "samples_per_second": 99.0, "eval": held_out,
         "samples_per_second_median": 1234.5, "seconds_left": 3725.4, "lr": 0.001,
         "grad_norm": 2.5}, 10)
    want = ", ".join(f"metric_{k} {k / 8:.4f}" for k in range(8))
    assert capsys.readouterr().err == (f"step 5/10 loss 0.5000 1234.5 samples/s, 1:02:05 left, "
                                       f"lr 0.001, grad norm 2.5\n"
                                       f"step 5: held-out {want}\n")
