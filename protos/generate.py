"""Regenerates the Python stubs of protos/*.proto (run: python -m protos.generate)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def main(out: Path = ROOT) -> int:
    """Compiles every .proto under protos/ into `out`/protos (imports stay `protos.*`)."""
    include = Path(protoc.__file__).parent / "_proto"
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").glob("*.proto"))
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *sources]
    return protoc.main(args)


if __name__ == "__main__":
    sys.exit(main())
