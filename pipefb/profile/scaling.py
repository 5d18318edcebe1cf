"""How a measured time scales with samples: the second micro-batch size the profiler
times, and each time's fixed part, the line through the two sizes at 0 samples.

[Note: fixed part]
The planner tries micro-batch sizes other than the profiled one, and `Profile.at` rescales
each time as a fixed part plus a part in proportion to samples. The fixed part is the
line through the times at two sizes, the profiled one and a second (`second_size`),
taken at 0 samples. The second is four times the profiled size, within the job's batch
(the largest micro-batch a plan can have); at the whole batch, a quarter of it. The two
sizes are far apart, and the second above the profiled one where the batch allows: where
a layer's time is mostly per call (a small `mlp`), the slope is a small difference of two
noisy times, and an error in a slope taken from a smaller size is multiplied when the
line is followed up to larger sizes. A single sample is a poor point: a `gpt` block costs
more per call at 1 sample than the line through larger sizes gives, so a fixed part taken
from 1 sample overstates the times at small sizes.
"""

from __future__ import annotations

import math

#: the second micro-batch timed is this many times the profiled one's size, within the
#: job's batch, else this many times smaller (at least 1 sample); each time's fixed part
#: is the line through the two sizes, at 0 samples ([Note: fixed part])
SECOND_FACTOR = 4
MIN_SECOND_ROUNDS = 2  # timed rounds at a larger second size, at least


def second_size(microbatch_size: int, batch_size: int) -> int:
    """Samples of the second micro-batch the profiler times ([Note: fixed part]): up to
    `SECOND_FACTOR` times the profiled size within the batch; at the whole batch (or
    beyond), `SECOND_FACTOR` times smaller, at least 1."""
    larger = min(batch_size, SECOND_FACTOR * microbatch_size)
    return larger if larger > microbatch_size else max(1, microbatch_size // SECOND_FACTOR)


def second_rounds(warmup: int, repeats: int, microbatch_size: int, size: int
                  ) -> tuple[int, int]:
    """Warm-up and timed rounds at the second size: as many when it is smaller; when it
    is larger, the same warm-up (a new size first meets page faults and a growing
    allocator, which the untimed rounds absorb) and timed rounds of about as many samples
    as the profiled size's, at least `MIN_SECOND_ROUNDS` (each call starts by
    evicting the caches, which costs more than a small layer's compute)."""
    if size <= microbatch_size:
        return warmup, repeats
    return warmup, max(MIN_SECOND_ROUNDS, math.ceil(repeats * microbatch_size / size))


def fixed_part(other: float, full: float, sizes: tuple[int, int]) -> float:
    """The part of a time that does not scale with samples: the line through `other`
    seconds at `sizes[0]` samples and `full` (the profiled size's) at `sizes[1]`, at 0
    samples, within [0, full]; `full` itself when the sizes are the same (a one-sample
    micro-batch is all fixed part; [Note: fixed part])."""
    n, m = sizes
    if n == m:
        return full
    slope = (full - other) / (m - n)
    return min(max(other - slope * n, 0.0), full)
