"""Files what `bench/device_run.sh` brought back from a GPU machine as the `offload_cuda`
entry of bench/run_all.py: the per-model matrix results become one results.json (and
its chart), from which `python bench/run_all.py --doc-only` writes the GPU page.

Run: `python bench/merge_device.py DIR [--out bench/results]` (DIR: device_run.sh's OUT).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.matrix import chart, repeats_done

MODELS = ("gpt", "gpt-large")  # the order device_run.sh runs them in


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One matrix result of several runs' models; refuses runs of differing settings. Its
    repeat count is the fewest any run finished (a time limit may stop one early)."""
    first = parts[0]
    for part in parts[1:]:
        differs = {k for k in first["args"] if k not in ("models", "out")
                   and part["args"].get(k) != first["args"][k]}
        if differs or part["systems"] != first["systems"]:
            raise SystemExit(f"the runs differ in {sorted(differs) or 'systems'}: not merged")
    models = {m: r for part in parts for m, r in part["models"].items()}
    return {**first, "args": {**first["args"], "models": ",".join(models), "out": None},
            "wall_seconds": sum(p["wall_seconds"] for p in parts), "models": models,
            "repeats_done": min(repeats_done(p) for p in parts)}  # the fewest any model ran


def main(argv: list[str] | None = None) -> None:
    """Merges DIR/<model>/results.json into OUT/offload_cuda/."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="device_run.sh's output folder")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    found = [args.dir / m / "results.json" for m in MODELS]
    parts = [json.loads(f.read_text()) for f in found if f.is_file()]
    if not parts:
        raise SystemExit(f"{args.dir}: no <model>/results.json for any of {', '.join(MODELS)}")
    merged = merge(parts)
    target = args.out / "offload_cuda"
    target.mkdir(parents=True, exist_ok=True)
    (target / "results.json").write_text(json.dumps(merged, indent=1) + "\n")
    chart(merged, target / "matrix.png")
    print(f"wrote {target}: models {merged['args']['models']}")


if __name__ == "__main__":
    main()
