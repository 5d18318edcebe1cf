"""A 500-step soak on the shared local cluster: PipeFB with every saved tensor going
through the offload store. Each worker's resident memory and the store's key count stay
flat (no trend): nothing a step makes outlives the steps that need it."""

from __future__ import annotations

import statistics
from typing import Any

from offload_store import job_pattern
from tests.conftest import rss, store_client
from tests.test_transparency import make_job

SOAK_STEPS = 500
SETTLED = 100  # memory is compared from this step on (first steps warm caches up)
RSS_RISE_BYTES = 16 << 20  # per worker, from step SETTLED to the end
MAX_KEY_SLOPE = 0.02  # keys per step: the trend of the store's key count over the run



def test_500_steps_keep_worker_memory_and_the_store_flat(client: Any, cluster: Any) -> None:
    job = make_job("mlp", "pipefb", 4, "adamw", steps=SOAK_STEPS, job_id="soak")
    store, pattern = store_client(cluster), job_pattern("soak")
    pids = [w.pid for w in cluster.workers()]
    client.submit(job)
    keys: list[int] = []  # the job's keys in the store after each reported step
    settled: list[int] = []
    for report in client.train("soak"):
        keys.append(sum(1 for _ in store.scan_iter(match=pattern, count=1000)))
        if report.step == SETTLED:
            settled = [rss(pid) for pid in pids]
        stashed = sum(w.bytes_stashed for w in report.workers)
        assert stashed > 0, f"step {report.step} stashed nothing"
    final = [rss(pid) for pid in pids]
    assert len(keys) == SOAK_STEPS
    # flat: the count is a snapshot of steps in flight (no barrier between steps), so it
    # jumps around, but it has no trend; one leaked key a step would make the slope >= 1
    slope = statistics.linear_regression(range(SOAK_STEPS), keys).slope
    assert abs(slope) < MAX_KEY_SLOPE, (slope, max(keys))
    assert not list(store.scan_iter(match=pattern))  # and none once the job is done
    rises = [(after - before) / 2**20 for before, after in zip(settled, final, strict=True)]
    print(f"keys in the store after each step: max {max(keys)}, trend {slope:+.4f} per "
          f"step; worker RSS from step {SETTLED} to the end: "
          + ", ".join(f"{r:+.1f}" for r in rises) + " MiB")
    assert all(rise < RSS_RISE_BYTES / 2**20 for rise in rises), f"MiB per worker: {rises}"
