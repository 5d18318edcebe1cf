"""Writes a token-shard corpus for the byte-level gpt: the bytes of this Python's standard
library's sources as little-endian uint16 tokens (vocabulary 256), nanoGPT's layout.

Run: `python scripts/token_corpus.py [OUT_DIR] [--max-bytes N]` (default OUT_DIR
data/stdlib-tokens, under `./data`, the default data root of `pipefb local`). It writes
OUT_DIR/train.bin and OUT_DIR/val.bin (the last tenth of the bytes), for
`--dataset tokens --dataset-config '{"path": "stdlib-tokens/train.bin", "eval_path":
"stdlib-tokens/val.bin"}'`.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np


def corpus(max_bytes: int) -> bytes:
    """The standard library's .py files, in sorted path order, up to `max_bytes` bytes."""
    parts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts or total >= max_bytes:
            continue
        data = path.read_bytes()[: max_bytes - total]
        parts.append(data)
        total += len(data)
    return b"".join(parts)


def main() -> None:
    """Writes train.bin and val.bin; prints their token counts."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", nargs="?", type=Path, default=Path("data/stdlib-tokens"))
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="bytes of source taken")
    args = p.parse_args()
    tokens = np.frombuffer(corpus(args.max_bytes), dtype=np.uint8).astype("<u2")
    split = len(tokens) * 9 // 10
    args.out.mkdir(parents=True, exist_ok=True)
    tokens[:split].tofile(args.out / "train.bin")
    tokens[split:].tofile(args.out / "val.bin")
    print(f"{args.out}/train.bin: {split} tokens, {args.out}/val.bin: "
          f"{len(tokens) - split} tokens")


if __name__ == "__main__":
    main()
