"""The baselines' memory meter (`bench.saved_memory`) counts what autograd saves, exactly."""

from __future__ import annotations

import torch

from bench.saved_memory import SavedTensorMeter


def test_counts_saved_activations_once_leaves_out_parameters_and_frees_after_backward() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4)
    meter = SavedTensorMeter(exclude=list(linear.parameters()))
    x = torch.randn(8, 4)
    with meter:
        y = torch.relu(linear(x))  # saves x (linear; its weight is left out) and y (relu)
        loss = (y * y).sum()  # saves y twice more: the same storage, counted once
    assert meter.current == meter.peak == 2 * 8 * 4 * 4
    loss.backward()
    del loss, y
    assert meter.current == 0 and meter.peak == 2 * 8 * 4 * 4
    meter.reset_peak()
    assert meter.peak == 0


def test_the_peak_spans_micro_batches_alive_together_and_gradients_match() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 16)
    reference = torch.nn.Linear(16, 16)
    reference.load_state_dict(linear.state_dict())
    meter = SavedTensorMeter(exclude=list(linear.parameters()))
    batches = [torch.randn(4, 16) for _ in range(3)]
    with meter:
        losses = [torch.tanh(linear(b)).sum() for b in batches]  # three forwards, then backwards
    one = 2 * 4 * 16 * 4  # the input and tanh's output, float32
    assert meter.peak == 3 * one
    for loss in losses:
        loss.backward()
    del losses
    assert meter.current == 0
    for b in batches:  # the hooks hand autograd back the very tensors: same gradients
        torch.tanh(reference(b)).sum().backward()
    torch.testing.assert_close(linear.weight.grad, reference.weight.grad, rtol=0, atol=0)
