"""[Note: back-to-back stash] in pipefb/runtime/exchange.py: a combined rank skips a STASH
whose FETCH comes right after it (its last stage's F then B) and trains as one process."""

from __future__ import annotations

from typing import Any

from tests.test_transparency import assert_same_training, make_job, run_on_cluster


def test_the_last_stage_keeps_what_it_would_fetch_right_back(client: Any) -> None:
    job = make_job("gpt", "1f1b", 2, "adamw", policy="offload")
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)
    stashed = {w.rank: 0 for w in reports[0].workers}
    for r in reports:
        for w in r.workers:
            stashed[w.rank] += w.bytes_stashed
    assert stashed[0] > 0  # stage 0 holds its stash through the store until its B
    assert stashed[1] == 0  # stage 1 runs B right after F: nothing to move
    # its saved tensors stayed in the worker, as `stashed` memory
    assert max(w.kind_peak_bytes["stashed"] for r in reports for w in r.workers
               if w.rank == 1) > 0
