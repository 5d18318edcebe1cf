"""[Note: coalesced copies] (offload_store/coalesce.py): a stash laid out in one flat
buffer per layer and dtype and handed back as views, bit for bit, on the CPU (the CUDA
staging and local tier use the same calls with pinned buffers and a copy stream)."""

from __future__ import annotations

import pytest
import torch

from offload_store.coalesce import copy_into, layout_of, pack_into, unpack
from offload_store.local import LocalTier
from offload_store.staging import HostStaging

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine")


def stash() -> dict[int, dict[str, torch.Tensor]]:
    """What users' layers save: float, half, bf16, bool and int tensors interleaved, a
    transposed (non-contiguous) one, an empty one, a scalar and one that requires grad."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 4, generator=g, requires_grad=True)
    return {0: {"x": torch.randn(5, 7, generator=g), "m": torch.rand(11, generator=g) > 0.5,
                "t": torch.randn(4, 6, generator=g).t(), "w": weight * 2,
                "s": torch.tensor(3.5)},
            3: {"h": torch.randn(3, generator=g).half(), "i": torch.arange(5),
                "b": torch.randn(9, generator=g).bfloat16(), "e": torch.empty(0, 3),
                "h2": torch.randn(2, 2, generator=g).half()}}


def assert_same(got: dict[int, dict[str, torch.Tensor]],
                want: dict[int, dict[str, torch.Tensor]]) -> None:
    assert {i: list(named) for i, named in got.items()} == \
        {i: list(named) for i, named in want.items()}  # the stash's order, layer by layer
    for layer, named in want.items():
        for name, tensor in named.items():
            out = got[layer][name]
            assert out.dtype == tensor.dtype and out.shape == tensor.shape
            assert out.is_contiguous() and not out.requires_grad
            assert torch.equal(out, tensor.detach())


def test_a_stash_is_laid_out_per_layer_and_dtype() -> None:
    layout = layout_of(stash())
    assert list(layout.groups) == [(0, torch.float32), (0, torch.bool), (3, torch.float16),
                                   (3, torch.int64), (3, torch.bfloat16), (3, torch.float32)]
    assert layout.numel((0, torch.float32)) == 35 + 24 + 24 + 1
    assert [name for name, _ in layout.groups[(3, torch.float16)]] == ["h", "h2"]
    assert layout.numel((3, torch.float16)) == 3 + 4 and layout.numel((3, torch.float32)) == 0


def test_copy_into_and_unpack_give_back_each_tensor_as_a_view_of_its_buffer() -> None:
    want = stash()
    layout = layout_of(want)
    flats = {group: torch.full((layout.numel(group),), 1, dtype=group[1])
             for group in layout.groups}
    got = copy_into(want, layout, flats)
    assert_same(got, want)
    assert_same(unpack(flats, layout), want)  # the buffers hold them, in layout order
    for layer, named in got.items():
        for t in named.values():
            if t.numel():
                assert t.untyped_storage().data_ptr() == \
                    flats[(layer, t.dtype)].untyped_storage().data_ptr()
    got[0]["x"].zero_()  # views of disjoint places: a write to one leaves the others
    assert_same({3: got[3]}, {3: want[3]})
    assert torch.equal(got[0]["t"], want[0]["t"])


def test_pack_into_fills_given_buffers_that_unpack_reads_back() -> None:
    want = stash()
    layout = layout_of(want)
    flats = {group: torch.empty(layout.numel(group), dtype=group[1])
             for group in layout.groups}
    pointers = {group: flat.data_ptr() for group, flat in flats.items()}
    pack_into(want, layout, flats)
    assert {group: flat.data_ptr() for group, flat in flats.items()} == pointers  # in place
    assert_same(unpack(flats, layout), want)
    # a copy of the buffers (as a device copy of them would be) unpacks the same
    assert_same(unpack({g: f.clone() for g, f in flats.items()}, layout), want)


def test_an_empty_stash_has_no_buffers() -> None:
    layout = layout_of({})
    assert layout.groups == {} and unpack({}, layout) == {} and copy_into({}, layout, {}) == {}


def on(device: torch.device, tensors: dict[int, dict[str, torch.Tensor]]
       ) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {n: t.to(device) for n, t in named.items()} for i, named in tensors.items()}


def own_storages(tensors: dict[int, dict[str, torch.Tensor]]) -> bool:
    """Whether every non-empty tensor has a storage of its own."""
    kept = [t for named in tensors.values() for t in named.values() if t.numel()]
    return len({t.untyped_storage().data_ptr() for t in kept}) == len(kept)


@needs_cuda
def test_cuda_local_tier_and_staging_give_back_the_stash_bit_for_bit() -> None:
    """The CUDA paths that use the layout: a combined rank's local tier (put into pinned
    buffers, take back to the device, a subset of names too) and PipeFB's staging (to host
    for the writer, to the device for the prefetch); each tensor comes back on the device
    with a storage of its own."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    want = on(cuda, stash())
    names = {i: list(named) for i, named in want.items()}
    tier = LocalTier(cuda, 1 << 30)
    for m in range(2):
        assert tier.put(0, m, want) == sum(t.nbytes for named in want.values()
                                           for t in named.values())
    got = tier.take(0, 0, names)
    part = tier.take(0, 1, {3: ["b", "e"]})
    torch.cuda.synchronize()
    assert got is not None and part is not None
    assert_same(on(cpu, got), on(cpu, want))
    assert own_storages(got)
    assert all(t.device.type == "cuda" for named in got.values() for t in named.values())
    assert_same(on(cpu, part), {3: {"b": want[3]["b"].cpu(), "e": want[3]["e"].cpu()}})
    assert tier.held_bytes == 0

    staging = HostStaging(cuda)
    host, wait, give_back = staging.to_host(want)
    wait()
    assert_same(host, on(cpu, want))
    back, arrival = staging.to_device(on(cpu, host))  # as the store's take hands them over
    give_back()
    back = arrival.wait(back)
    torch.cuda.synchronize()
    assert_same(on(cpu, back), on(cpu, want))
    assert own_storages(back)
