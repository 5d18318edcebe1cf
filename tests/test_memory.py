"""Counting a rank's memory: storages counted once, parameters left out, noted once."""

from __future__ import annotations

import torch

from pipefb.memory import KINDS, MemoryAccount, storage_bytes, storages, tensor_bytes


def test_views_of_one_storage_count_once_and_excluded_or_seen_storages_not_at_all() -> None:
    base = torch.zeros(64, dtype=torch.float32)  # 256 bytes
    other = torch.zeros(10, dtype=torch.float64)  # 80 bytes
    views = [base, base[:8], base.view(8, 8)[2], other, other[::2]]
    assert tensor_bytes(views) == 256 + 80
    assert tensor_bytes(views, exclude=[base.untyped_storage().data_ptr()]) == 80
    seen: set[int] = set()
    assert tensor_bytes([base], seen=seen) == 256
    assert tensor_bytes(views, seen=seen) == 80  # base was counted by the first call
    assert tensor_bytes([torch.empty(0), torch.empty(0)]) == 0


def test_storages_noted_once_count_as_the_tensors_do() -> None:
    base, other = torch.ones(3, 5), torch.ones(7, dtype=torch.int64)
    tensors = [base, base.t(), other[1:], torch.ones(2, dtype=torch.bool)]
    found = storages(tensors)
    assert [n for _, n in found] == [60, 60, 56, 2]
    assert storage_bytes(found) == tensor_bytes(tensors) == 60 + 56 + 2
    keep = [other.untyped_storage().data_ptr()]
    assert storage_bytes(found, exclude=keep) == tensor_bytes(tensors, exclude=keep) == 62


def test_the_node_tier_is_reported_beside_the_total_not_in_it() -> None:
    account = MemoryAccount()
    account.set({"parameters": 100, "node_tier": 5000})
    account.set({"parameters": 100, "stashed": 40, "node_tier": 1000})
    assert account.peak_total == 140  # the rank's own bytes only
    assert account.peak == {**dict.fromkeys(KINDS, 0), "parameters": 100, "stashed": 40,
                            "node_tier": 1000}  # every kind at the total's peak
    assert account.peak_each["node_tier"] == 5000
    account.reset_peak()
    assert account.peak_total == 140 and account.peak_each["node_tier"] == 1000


def test_the_total_besides_some_kinds_leaves_them_and_the_node_tier_out() -> None:
    """What a stash writer under a memory cap reads ([Note: background stash])."""
    account = MemoryAccount()
    account.set({"parameters": 100, "stashed": 40, "stash_in_flight": 30, "node_tier": 1000})
    assert account.total_besides() == 170
    assert account.total_besides("stash_in_flight") == 140
    assert account.total_besides("stash_in_flight", "node_tier") == 140
