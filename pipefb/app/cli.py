"""The `pipefb` command: `local train`, `submit`, `status`, `stop`.

Bad arguments exit with status 2 and one line naming the bad value; a failed job exits 1
with the coordinator's message; Ctrl-C exits 130. Cluster commands import the gRPC client
lazily, so the core never imports grpc.

[Note: interrupt deadline]
Ctrl-C raises KeyboardInterrupt where the main thread is, often inside a gRPC call, and the
clean-up then closes the channel and stops the local cluster. gRPC Python's
`Channel.close` can deadlock after an exception a signal handler raised while calls were
in flight (grpc/grpc#19973, #20026), so an interrupted command might never exit. The first
Ctrl-C therefore also starts a timer: if the process is still running
`INTERRUPT_GRACE_SECONDS` later (the command's clean-up, or the interpreter's exit, which
joins thread pools), it SIGKILLs the local clusters' processes
(`pipefb.app.local.kill_running`), says so, and exits 130 at once. The deadline is well
above a clean stop, which gives each child process `Process.stop`'s grace before
SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from pipefb.errors import ConfigError, NonFiniteLoss
from pipefb.job.config import DEVICES, SCHEDULES, JobConfig, job_device, parse_json_object
from pipefb.runtime.splitcheck import check_submit

if TYPE_CHECKING:
    from pipefb.sim.costs import Profile

#: after a Ctrl-C, a command still running this long is cut short ([Note: interrupt deadline])
INTERRUPT_GRACE_SECONDS = 60.0


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2), as scripts and tests expect."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"pipefb: error: {message}\n")


def _job_flags(p: argparse.ArgumentParser) -> None:
    d = JobConfig()
    p.add_argument("--model", default=d.model, help="mlp, gpt, convnet or an entry point name")
    p.add_argument("--model-config", default="", help="JSON object for the model builder")
    p.add_argument("--dataset", default=d.dataset,
                   help="digits, text, synthetic, tokens (token shards), arrays (.npy or "
                        "safetensors samples) or an entry point name")
    p.add_argument("--dataset-config", default="",
                   help="JSON object for the dataset, e.g. '{\"path\": \"shakespeare\"}' "
                        "(paths relative to the services' data roots)")
    p.add_argument("--loss", default=d.loss, help="cross_entropy, mse or an entry point name")
    p.add_argument("--loss-config", default="",
                   help="JSON object of loss options, e.g. '{\"ignore_index\": 0, "
                        "\"label_smoothing\": 0.1}'")
    p.add_argument("--schedule", default=None,
                   help=f"one of {', '.join(SCHEDULES)} (default {d.schedule}; with --plan "
                        "auto: auto, the planner picks)")
    p.add_argument("--workers", type=int, default=d.workers, help="workers in the pipeline")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per step")
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="per step")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--optimizer", default=d.optimizer, help="sgd or adamw")
    p.add_argument("--optimizer-config", default="", help="JSON object of optimizer options")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate")
    p.add_argument("--lr-schedule", default=d.lr_schedule,
                   help="constant, cosine or linear: after --warmup-steps of linear warm-up, "
                        "keep --lr, or decay it to --min-lr over the job's steps (torch's "
                        "schedulers)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help="steps of linear learning-rate warm-up (0: none)")
    p.add_argument("--min-lr", type=float, default=d.min_lr,
                   help="the learning rate cosine and linear decay to")
    p.add_argument("--clip-grad-norm", type=float, default=d.clip_grad_norm,
                   help="clip the whole model's gradient norm (every stage) to this; 0: off")
    p.add_argument("--precision", default=d.precision,
                   help="fp32, bf16 (autocast per stage, float32 master weights and "
                        "optimizer state) or fp16 (autocast and loss scaling agreed across "
                        "stages); each on cpu and cuda")
    p.add_argument("--initial-loss-scale", type=float, default=d.initial_loss_scale,
                   help="fp16: the first step's loss scale (halved after a step whose "
                        "gradients overflow)")
    p.add_argument("--loss-scale-window", type=int, default=d.loss_scale_window,
                   help="fp16: finite steps in a row before the loss scale doubles")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds weights, data, dropout")
    p.add_argument("--mode", default="",
                   help="sync (equal to one process) or async (pipedream, pipefb); "
                        "default: the schedule's")
    p.add_argument("--staleness", type=int, default=d.staleness,
                   help="async pipefb: the forward of step k uses weight version k - S")
    p.add_argument("--staleness-microbatches", type=int, default=d.staleness_microbatches,
                   help="async pipefb: only the first K micro-batches of step k use version "
                        "k - S, the rest wait for k - S + 1 (K = --microbatches: all, "
                        "PipeDream-2BW's rule; 0: the default, 1 with one pipeline group, "
                        "all with several)")
    p.add_argument("--policy", default=d.policy,
                   help="activation policy: keep, offload, recompute, or a comma list with "
                        "one per layer (loss included); default keep, offload for pipefb")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="held-out evaluation every K steps (0: only at the end)")
    p.add_argument("--plan", default="", choices=("", "even", "auto"),
                   help="even (default): stages balanced by parameter count; auto: profile "
                        "the workers, search schedule, partition and policy, simulate")
    p.add_argument("--memory-cap", default="0",
                   help="with --plan auto: bytes each worker may hold, e.g. 200MB (0: none)")
    p.add_argument("--job-id", default="", help="job id (default: the coordinator picks)")
    p.add_argument("--device", default=d.device, choices=DEVICES,
                   help="where workers compute: cpu, or cuda (each worker's current CUDA "
                        "device; several workers may share one GPU)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="checkpoint every K steps and after the last (0: never)")
    p.add_argument("--check-groups-every", type=int, default=d.check_groups_every,
                   help="with several groups: compare each stage's weights across the groups "
                        "(a digest) every K steps and after the last (0: never); the "
                        "copies of a tied parameter likewise")
    p.add_argument("--checkpoint-dir", default=None,
                   help="checkpoint directory inside the services' checkpoint root (local "
                        "train: the --out directory); default: the job's own "
                        "checkpoints/JOB_ID")
    p.add_argument("--resume", action="store_true",
                   help="start from the newest intact checkpoint in the checkpoint "
                        "directory (a sync job with the same settings; --steps may grow); "
                        "needs --checkpoint-dir or the resumed job's --job-id")
    p.add_argument("--max-restarts", type=int, default=d.max_restarts,
                   help="replay a failed attempt this many times, from the newest "
                        "checkpoint (or step 0), on relaunched or spare workers; local "
                        "train relaunches dead processes (0: a failure ends the job)")
    p.add_argument("--slowdown", default=d.slowdown,
                   help="fault injection: RANK=FACTOR[@STEP],... makes that rank's compute "
                        "FACTOR times slower from STEP on; LLAYER=FACTOR[@STEP] that layer's "
                        "forward and backward, wherever it runs (benchmarks of re-planning)")
    p.add_argument("--replan", action="store_true",
                   help="move layers between workers while training when measured stage "
                        "times make another partition pay (sync; rank to rank over gRPC)")
    p.add_argument("--groups", type=_groups, default=None,
                   help="pipeline groups, data-parallel across groups: each runs the same "
                        "stages on workers/G workers and microbatches/G micro-batches, and "
                        "gradients are summed across groups before each optimizer step; "
                        "auto (the default with --plan auto; else 1): the planner picks G")


def _groups(text: str) -> int:
    """`--groups`: a count, or auto (0: the planner picks)."""
    if text == "auto":
        return 0
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a group count or auto") from None


def build_parser() -> argparse.ArgumentParser:
    """The full command-line grammar."""
    p = _Parser(prog="pipefb", description="Pipeline-parallel training over gRPC.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    local = sub.add_parser("local", help="run a local cluster on 127.0.0.1")
    local_sub = local.add_subparsers(dest="local_command", required=True, parser_class=_Parser)
    train = local_sub.add_parser("train", help="train a job on a fresh local cluster")
    _job_flags(train)
    train.add_argument("--out", type=Path, default=Path("runs/latest"), help="report directory")
    train.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")
    train.add_argument("--threads", type=int, default=0,
                       help="torch threads per process, workers and single alike "
                            "(default: cores / workers)")
    train.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=True,
                       help="run each worker on cores of its own where there are enough "
                            "(default on; [Note: pinned workers] in pipefb/cpus.py)")
    train.add_argument("--metrics", action="store_true",
                       help="the coordinator and workers serve Prometheus /metrics on free "
                            "ports; prints each URL and keeps them in OUT/logs/cluster.json")
    submit = sub.add_parser("submit", help="submit a job to a running coordinator")
    submit.add_argument("--coordinator", required=True, help="host:port")
    submit.add_argument("job_file", nargs="?", type=Path, help="JSON/YAML job (flags override)")
    submit.add_argument("--follow", action="store_true", help="stream step reports")
    _job_flags(submit)
    status = sub.add_parser("status", help="a job's status, or the workers")
    status.add_argument("--coordinator", required=True, help="host:port")
    status.add_argument("job_id", nargs="?", help="job id; omitted: list workers")
    plan = sub.add_parser("plan", help="search plans for a model on a cluster; print them")
    _job_flags(plan)
    plan.add_argument("--cluster", type=Path, default=None,
                      help="cluster YAML (default: this machine, measured once and cached, "
                           "with --workers workers)")
    plan.add_argument("--profile", choices=("measured", "analytic"), default="measured",
                      help="measure layers here, or derive them from FLOPs (--flops)")
    plan.add_argument("--flops", type=float, default=1e12,
                      help="analytic profile: FLOP/s of a speed-1.0 worker")
    plan.add_argument("--memory-bandwidth", type=float, default=0.0,
                      help="analytic profile: bytes/s a layer moves (0: ignore)")
    plan.add_argument("--json", action="store_true", help="print the result as JSON")
    plan.add_argument("--out", type=Path, default=Path("runs/plan"),
                      help="directory for timeline.png and plan.json")
    stop = sub.add_parser("stop", help="stop a job at the next step boundary")
    stop.add_argument("--coordinator", required=True, help="host:port")
    stop.add_argument("job_id", help="job id")
    save = sub.add_parser("checkpoint", help="checkpoint a running job at its next step "
                          "boundary and wait until it is committed")
    save.add_argument("--coordinator", required=True, help="host:port")
    save.add_argument("--timeout", type=float, default=600.0,
                      help="seconds to wait for the commit (default 600)")
    save.add_argument("job_id", help="job id")
    move = sub.add_parser("repartition", help="move a running sync job's layers between "
                          "its workers at the next step boundary")
    move.add_argument("--coordinator", required=True, help="host:port")
    move.add_argument("--forward", type=_bounds, default=[],
                      help="new stage boundaries, e.g. 0,3,5 (the same number of stages)")
    move.add_argument("--backward", type=_bounds, default=[],
                      help="new backward stage boundaries (pipefb; default: unchanged)")
    move.add_argument("job_id", help="job id")
    return p


def _bounds(text: str) -> list[int]:
    """`0,3,5` as stage boundaries."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of layer indices, "
                                         "e.g. 0,3,5") from None


def job_from_args(args: argparse.Namespace, base: dict[str, Any] | None = None) -> JobConfig:
    """Builds the JobConfig from flags (over an optional job file); ConfigError if bad."""
    from pipefb.sim.cluster import parse_quantity

    values = dict(base or {})
    for name in ("model", "dataset", "loss", "workers", "batch_size",
                 "microbatches", "steps", "optimizer", "lr", "seed", "mode", "staleness",
                 "policy", "eval_every", "plan", "job_id", "device", "checkpoint_every",
                 "resume", "max_restarts", "slowdown", "replan", "check_groups_every",
                 "lr_schedule", "warmup_steps", "min_lr", "clip_grad_norm",
                 "staleness_microbatches"):
        values.setdefault(name, getattr(args, name))
    values.setdefault("precision", args.precision)
    values.setdefault("initial_loss_scale", args.initial_loss_scale)
    values.setdefault("loss_scale_window", args.loss_scale_window)
    if args.checkpoint_dir is not None or "checkpoint_dir" not in values:
        values["checkpoint_dir"] = args.checkpoint_dir or ""  # "": the job's own directory
    if args.groups is not None or "groups" not in values:  # default: auto with --plan auto
        values["groups"] = (args.groups if args.groups is not None
                            else 0 if values.get("plan") == "auto" else 1)
    if args.schedule is not None or "schedule" not in values:
        auto = values.get("plan") == "auto" and args.schedule is None
        values["schedule"] = args.schedule or ("auto" if auto else JobConfig().schedule)
    if args.memory_cap != "0" or "memory_cap" not in values:
        values["memory_cap"] = int(parse_quantity(args.memory_cap, "--memory-cap", "bytes"))
    for name in ("model_config", "dataset_config", "optimizer_config", "loss_config"):
        text = getattr(args, name)
        if text or name not in values:
            values[name] = parse_json_object(text, f"--{name.replace('_', '-')}")
    return JobConfig.from_dict(values)


def _read_job_file(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read job file {str(path)!r}: {error.strerror}") from None
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ConfigError(f"job file {str(path)!r} must hold a mapping")
        return data
    return parse_json_object(text, f"job file {str(path)!r}")


def configure_local_data_roots() -> None:
    """The data roots of a command that reads the job's data in this process and in the
    local cluster it starts: PIPEFB_DATA_ROOT, else ./data of the working directory."""
    from pipefb.job.dataroots import DataRoots, configure, local_default

    configure(DataRoots.parse(local_default()))


def warn(lines: Sequence[str]) -> None:
    """Prints each of a submit's warnings as one `pipefb: warning:` line on stderr."""
    for line in lines:
        print(f"pipefb: warning: {line}", file=sys.stderr)


def cmd_local_train(args: argparse.Namespace) -> int:
    """`pipefb local train`: a fresh local cluster (or one process for `single`)."""
    from pipefb.app.train import run_local

    configure_local_data_roots()
    job = job_from_args(args)
    warn(check_submit(job).warnings)
    job_device(job)  # every process of a local run shares this machine's devices
    if args.threads < 0:
        raise ConfigError(f"--threads {args.threads} must be >= 0")
    return run_local(job, args.out, progress=not args.no_progress, threads=args.threads,
                     metrics=args.metrics, pin_cpus=args.pin_cpus)


def cmd_plan(args: argparse.Namespace) -> int:
    """`pipefb plan`: profile, search and simulate; print the candidates, write the timeline."""
    from pipefb.app.planview import candidates_table, groups_table, write_timeline
    from pipefb.planner.job import job_cluster, label, summary

    args.plan = "auto"  # schedule defaults to auto: every kind
    configure_local_data_roots()
    job = job_from_args(args)
    if args.cluster is not None:
        from pipefb.sim.cluster import Cluster

        cluster = Cluster.load(args.cluster)
    else:
        from calibration.cluster import local_cluster

        cluster = local_cluster(job.workers)
    warn(check_submit(replace(job, workers=cluster.size)).warnings)
    cluster = job_cluster(cluster, cluster.size, memory_cap=job.memory_cap, device=job.device)
    profile = _plan_profile(job, args, cluster.size)
    from pipefb.planner.job import plan_job

    result = plan_job(job, profile, cluster)
    data = summary(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.json").write_text(json.dumps(data, indent=2) + "\n")
    write_timeline(result, args.out / "timeline.png")
    if args.json:
        print(json.dumps({k: v for k, v in data.items() if k != "timeline"}, indent=2))
        return 0
    from rich.console import Console

    console = Console()
    console.print(groups_table(result, job.batch_size))
    console.print(candidates_table(result, job.batch_size // result.best.groups))
    p = result.plan
    console.print(f"chosen: {label(result)}, predicted {result.best.step_seconds * 1e3:.2f}"
                  f" ms/step, peak {data['predicted_peak_memory_bytes'] / 2**20:.1f} MiB, "
                  f"bubble {result.simulation.bubble_fraction:.0%}; forward partition "
                  f"{list(p.forward_partition)}, backward {list(p.backward_partition)}; "
                  f"timeline: {args.out / 'timeline.png'}")
    return 0


def _plan_profile(job: JobConfig, args: argparse.Namespace, workers: int) -> Profile:
    """The layer profile `pipefb plan` uses: measured in this process, or analytic."""
    from pipefb.profile.analytic import analytic_profile
    from pipefb.profile.measure import measure_profile

    if args.profile == "analytic":
        return analytic_profile(job, job.microbatch_size, args.flops, args.memory_bandwidth)
    import torch

    from pipefb.processes import default_threads

    torch.set_num_threads(args.threads if getattr(args, "threads", 0) else
                          default_threads(workers))
    return measure_profile(job, job.microbatch_size)


def cmd_submit(args: argparse.Namespace) -> int:
    """`pipefb submit`: queue a job on a running coordinator."""
    from coordinator.client import CoordinatorClient

    base = _read_job_file(args.job_file)
    job = job_from_args(args, base)
    with CoordinatorClient(args.coordinator) as client:
        status = client.submit(job)
        warn(status.warnings)
        print(status.job_id)
        if args.follow:
            for report in client.train(status.job_id):
                norm = (f" grad norm {report.grad_norm:.4g}{' (skipped)' * report.skipped}"
                        if report.HasField("grad_norm") else "")
                print(f"step {report.step} loss {report.loss:.4f} lr {report.lr:.3g}{norm} "
                      f"{report.samples_per_second_median:.1f} samples/s", flush=True)
            for why in client.status(status.job_id).refused_checkpoints:
                print(f"checkpoint refused: {why}", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """`pipefb status`: one job as JSON, or the worker table."""
    from google.protobuf.json_format import MessageToDict

    from coordinator.client import CoordinatorClient

    with CoordinatorClient(args.coordinator) as client:
        if args.job_id:
            print(json.dumps(MessageToDict(client.status(args.job_id)), indent=2))
        else:
            for w in client.workers():
                print(f"{w.worker_id:>3} {w.name:<16} {w.address:<22} "
                      f"{'alive' if w.alive else 'dead':<5} {w.job_id or '-'}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """`pipefb stop`: ask a job to stop."""
    from coordinator.client import CoordinatorClient

    with CoordinatorClient(args.coordinator) as client:
        status = client.stop(args.job_id)
        print(f"{status.job_id}: stop requested")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """`pipefb checkpoint`: checkpoint a running job now."""
    from coordinator.client import CoordinatorClient

    with CoordinatorClient(args.coordinator) as client:
        status = client.checkpoint(args.job_id, timeout=args.timeout)
        print(f"{status.job_id}: checkpoint committed; a resume starts at step "
              f"{status.checkpointed} (--resume with the job's checkpoint directory)")
    return 0


def cmd_repartition(args: argparse.Namespace) -> int:
    """`pipefb repartition`: move a running job's layers."""
    from coordinator.client import CoordinatorClient

    if not args.forward and not args.backward:
        raise ConfigError("give --forward, --backward or both")
    with CoordinatorClient(args.coordinator) as client:
        status = client.repartition(args.job_id, args.forward, args.backward)
        print(f"{status.job_id}: moves to forward {args.forward or 'unchanged'}, backward "
              f"{args.backward or 'unchanged'} at the next step boundary")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "local": cmd_local_train, "submit": cmd_submit, "status": cmd_status, "stop": cmd_stop,
    "plan": cmd_plan, "checkpoint": cmd_checkpoint, "repartition": cmd_repartition,
}


def _cut_short() -> None:
    """The interrupt's deadline passed: kill the local clusters' processes and exit 130."""
    from pipefb.app.local import kill_running

    killed = kill_running()
    print(f"pipefb: interrupted; the clean-up took over {INTERRUPT_GRACE_SECONDS:g} s, so "
          f"{killed} local process(es) were killed", file=sys.stderr, flush=True)
    os._exit(130)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """SIGINT: KeyboardInterrupt, as Python's default, with a deadline on what follows."""
    timer = threading.Timer(INTERRUPT_GRACE_SECONDS, _cut_short)
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


@contextmanager
def _interrupt_deadline() -> Iterator[None]:
    """Puts `_interrupted` on SIGINT for the command (main thread only; the previous
    handler is restored after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pipefb` script."""
    args = build_parser().parse_args(argv)
    try:
        with _interrupt_deadline():
            return COMMANDS[args.command](args)
    except ConfigError as error:
        print(f"pipefb: error: {error}", file=sys.stderr)
        return 2
    except NonFiniteLoss as error:  # the in-process `single` run
        print(f"pipefb: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pipefb: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if not type(error).__module__.startswith("grpc"):
            raise
        code, details = getattr(error, "code", None), getattr(error, "details", None)
        name = code().name if callable(code) else "error"
        print(f"pipefb: {name}: {details() if callable(details) else error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
