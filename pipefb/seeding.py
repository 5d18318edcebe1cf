"""Stable seeds derived from integer tuples, identical in every process and Python version."""

from __future__ import annotations

import hashlib

from pipefb.errors import ConfigError

_PART_BYTES = 16  # fixed width per part (signed, little-endian) so tuples never collide
_SEED_BITS = 63  # fits a signed int64, so torch.Generator.manual_seed accepts any result


def derive_seed(*parts: int) -> int:
    """Hashes integers into a non-negative 63-bit seed with BLAKE2b (never Python's `hash`).

    Used as `derive_seed(seed, step, microbatch)` for data sampling and
    `derive_seed(seed, step, microbatch, layer)` for random ops.

    Args:
        *parts: integers in [-2**127, 2**127); the order matters.

    Returns:
        A seed in [0, 2**63).

    Raises:
        ConfigError: a part that is not an int, or one too large for 16 bytes.
    """
    digest = hashlib.blake2b(digest_size=8, person=b"pipefb-seed")
    digest.update(len(parts).to_bytes(4, "little"))
    for part in parts:
        if not isinstance(part, int) or isinstance(part, bool):
            raise ConfigError(f"seed part {part!r} is not an int")
        try:
            digest.update(part.to_bytes(_PART_BYTES, "little", signed=True))
        except OverflowError:
            raise ConfigError(f"seed part {part} does not fit in {_PART_BYTES} bytes") from None
    return int.from_bytes(digest.digest(), "little") >> (64 - _SEED_BITS)


def seed_random_ops(seed: int) -> None:
    """Seeds the generators random ops draw from: the CPU one, and CUDA's once initialised.

    Cheaper than `torch.manual_seed`, which on a build without a GPU records a Python
    traceback for a deferred CUDA call on every use; this runs once per micro-batch and
    layer.
    """
    import torch

    torch.default_generator.manual_seed(seed)
    # torch.cuda.is_initialized has no annotations in torch 2.13
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.manual_seed(seed)
