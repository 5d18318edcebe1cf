"""`python -m calibration [--workers N] [--refresh] [--out FILE]`: prints (or writes) this
machine's local cluster YAML, measuring it first where the cache is missing or stale."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from calibration.cache import render
from calibration.cluster import calibrated
from calibration.links import echo


def main(argv: list[str] | None = None) -> int:
    """`python -m calibration`: prints (or writes) the local cluster's YAML."""
    p = argparse.ArgumentParser(prog="python -m calibration",
                                description="Measure this machine once; print its cluster YAML.")
    p.add_argument("--workers", type=int, default=1, help="workers of the cluster (default 1)")
    p.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
    p.add_argument("--out", type=Path, help="write the YAML here instead of stdout")
    p.add_argument("--echo-to", help="internal: be the gRPC probe's peer of this address")
    args = p.parse_args(argv)
    if args.echo_to:
        echo(args.echo_to)
        return 0
    if args.workers < 1:
        p.error(f"--workers {args.workers} must be >= 1")
    cluster, head = calibrated(args.workers, refresh=args.refresh)
    text = render(cluster, head)
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
