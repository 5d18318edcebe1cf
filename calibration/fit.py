"""Fits a link (latency and bandwidth) through the probe times of two transfer sizes.

A link's time at each size is the mean of its probes, not their median, as the profile's
times are means: a step's time is the sum of its actions' ([Note: timed as a pipeline
runs] in pipefb.profile.measure), and a link's probes have a slow tail that a median
would hide. With few probes one slow small probe can put the small size's mean above the
large size's; the line then goes through the two sizes' medians instead (`fit_probes`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from calibration.settings import CalibrationError
from pipefb.sim.cluster import Link


def fit_probes(what: str, small_bytes: int, small: Sequence[float], large_bytes: int,
               large: Sequence[float]) -> Link:
    """The link through the means of two sizes' probes (see the module docstring), or
    through their medians where a slow small probe put its mean above the large's.

    Raises:
        CalibrationError: the large probes were not slower, by medians either.
    """
    mean_small, mean_large = statistics.fmean(small), statistics.fmean(large)
    if mean_large > mean_small:
        return fit_link(what, small_bytes, mean_small, large_bytes, mean_large)
    return fit_link(what, small_bytes, statistics.median(small), large_bytes,
                    statistics.median(large))


def fit_link(what: str, small_bytes: int, small_s: float, large_bytes: int,
             large_s: float) -> Link:
    """The link through two (bytes, seconds) points: bandwidth from the slope, latency
    from the small point.

    Raises:
        CalibrationError: the large probe was not slower than the small one.
    """
    if not large_bytes > small_bytes or not large_s > small_s:
        raise CalibrationError(f"{what}: {large_bytes} bytes took {large_s:.6f} s, not more "
                               f"than {small_bytes} bytes ({small_s:.6f} s)")
    bandwidth = (large_bytes - small_bytes) / (large_s - small_s)
    return Link(bandwidth, max(0.0, small_s - small_bytes / bandwidth))
