"""``adapter.base_precision: bf16`` (model/quantization.py) without torchao: the frozen UNet's linear and convolution
weights held in bf16 compute exactly as fp32 layers with bf16-rounded weights, run under CPU autocast, halve the
held bytes, and a LoRA added on top trains in fp32 while the base stays frozen in bf16. (NF4 and int8 need torchao:
tests/stages/test_train_sdxl.py.)"""

from __future__ import annotations

import torch

from model.adapters import add_adapter, lora_config
from model.quantization import (
    Bf16HeldConv2d,
    Bf16HeldLinear,
    dequantised_state,
    held_bytes,
    is_quantised,
    quantisation_error,
    quantise_linears,
)
from tests.fixtures.eval_workspace import tiny_unet


def _rounded(layer: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``layer`` (fp32) whose weight is rounded through bf16."""
    copy = type(layer)(*_shape_args(layer))
    copy.load_state_dict(layer.state_dict())
    copy.weight.data = copy.weight.data.to(torch.bfloat16).float()
    return copy


def _shape_args(layer: torch.nn.Module) -> tuple:
    if isinstance(layer, torch.nn.Linear):
        return layer.in_features, layer.out_features
    return layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride, layer.padding


def test_a_bf16_held_layer_computes_with_its_rounded_weight_exactly():
    torch.manual_seed(0)
    for layer, x in ((torch.nn.Linear(24, 16), torch.randn(3, 24)),
                     (torch.nn.Conv2d(4, 8, 3, padding=1), torch.randn(2, 4, 8, 8))):  # fmt: skip
        reference = _rounded(layer)
        held = torch.nn.Sequential(layer)
        names = quantise_linears(held, "bf16")
        assert names == ["0"] and type(held[0]) in (Bf16HeldLinear, Bf16HeldConv2d)
        assert held[0].weight.dtype == torch.bfloat16 and held[0].bias.dtype == torch.float32
        out = held(x)
        assert out.dtype == torch.float32 and torch.equal(out, reference(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = held(x)
        assert cast.dtype == torch.bfloat16 and (cast.float() - out).abs().max() < 0.05 * out.abs().max()


def test_a_bf16_base_halves_its_layer_bytes_and_states_its_error():
    unet = tiny_unet(0)
    before = {k: v.detach().clone() for k, v in unet.state_dict().items()}
    fp32_bytes = sum(held_bytes(t) for t in unet.state_dict().values())
    names = quantise_linears(unet, "bf16")
    state = unet.state_dict()
    held = [k for k, v in state.items() if is_quantised(v)]
    assert len(held) == len(names) > 10 and all(k.endswith(".weight") for k in held)
    saved = sum(before[k].numel() * 2 for k in held)
    assert sum(held_bytes(t) for t in state.values()) == fp32_bytes - saved
    plain = dequantised_state(state)
    assert all(plain[k].dtype == torch.float32 and torch.equal(plain[k], before[k].to(torch.bfloat16).float())
               for k in held)  # fmt: skip
    error = quantisation_error(before, unet)
    assert 0 < error["rel_error"] < 2**-8 and error["max_abs_error"] > 0


def test_a_lora_on_a_bf16_base_trains_in_fp32_and_leaves_the_base_frozen():
    unet = tiny_unet(0)
    quantise_linears(unet, "bf16")
    trainable = add_adapter(unet, lora_config("lora", 2, None, 0.0, r".*attn1\.to_(q|k|v)"))
    assert trainable and all(p.dtype == torch.float32 for _, p in trainable)
    base = {n: p.detach().clone() for n, p in unet.named_parameters() if not p.requires_grad}
    for _, p in trainable:  # lora_B starts at zero: give it a value so lora_A's gradient is not zero too
        p.data.normal_(0, 0.1)
    sample, text = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16)
    loss = unet(sample, torch.tensor([10, 500]), encoder_hidden_states=text).sample.pow(2).mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0 for _, p in trainable)
    assert all(p.grad is None for n, p in unet.named_parameters() if not p.requires_grad)
    assert all(torch.equal(p, base[n]) for n, p in unet.named_parameters() if n in base)
    assert any(p.dtype == torch.bfloat16 for p in base.values())
