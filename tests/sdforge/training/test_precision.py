"""``train.mixed_precision`` / ``encode.mixed_precision``: where bf16 autocast runs (the switch, checked on CPU)."""

from __future__ import annotations

import pytest
import torch

from model import precision
from model.precision import cpu_has_native_bf16, uses_bf16_autocast

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cuda_uses_bf16_when_asked():
    assert uses_bf16_autocast(CUDA, "bf16") is True
    assert uses_bf16_autocast(CUDA, "no") is False


@pytest.mark.parametrize("native", [True, False])
def test_cpu_uses_bf16_only_with_native_support(monkeypatch, native):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    assert uses_bf16_autocast(CPU, "bf16") is native
    assert uses_bf16_autocast(CPU, "no") is False


def test_native_bf16_probe_matches_torch():
    assert cpu_has_native_bf16() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())

