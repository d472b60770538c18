"""safetensors files this project writes are byte-identical for identical content: the metadata map is sorted
(safetensors writes it in hash order, which changes per process — an adapter phase's LoRA file differed between
an uninterrupted run and a resumed one, found by the kill harness)."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save

from sdforge.latents.store import sorted_header


def test_the_metadata_order_no_longer_changes_the_bytes(tmp_path):
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.int32)}
    one = save(tensors, metadata={"format": "pt", "lora_adapter_metadata": "{}"})
    two = save(tensors, metadata={"lora_adapter_metadata": "{}", "format": "pt"})
    assert sorted_header(one) == sorted_header(two)
    path = tmp_path / "x.safetensors"
    path.write_bytes(sorted_header(two))
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt", "lora_adapter_metadata": "{}"}
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())
