"""What :func:`model.activation_memory.saved_activation_bytes` counts: the storages still saved when the forward
returns, once each — not what a dropped branch saved and freed, whose address a later tensor may take again."""

from __future__ import annotations

import torch

from model.activation_memory import OUTSIDE, saved_activation_bytes


class _DropsABranch(torch.nn.Module):
    """Saves ``exp``'s output in a branch it drops, then keeps ``x`` (for ``w``'s gradient) and ``x·w`` (``pow``'s
    input) for the backward: 2 × 64 fp32 values."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(8):  # freed at once: each address free for the next one to take
            (x * self.w).exp()
        return ((x * self.w) ** 2).sum()


def test_only_the_storages_kept_for_the_backward_count():
    model, x = _DropsABranch(), torch.randn(64)
    counted = saved_activation_bytes(model, lambda: model(x))
    assert counted == {"": 2 * 64 * 4, OUTSIDE: 0}
    loss = model(x)  # and those are what the backward reads: it runs
    loss.backward()
    assert torch.allclose(model.w.grad, 2 * x * x)


def test_a_storage_saved_twice_counts_once():
    model, x = _DropsABranch(), torch.randn(64)
    twice = lambda: model(x) + (x * model.w).sum()  # noqa: E731 - x saved again by the second product
    assert saved_activation_bytes(model, twice) == {"": 2 * 64 * 4, OUTSIDE: 0}
