"""A frozen base held below fp32 for an adapter phase (QLoRA, Dettmers et al. 2023): ``adapter.base_precision``.

Pure torch + torchao; no I/O. Every ``nn.Linear`` weight of the frozen denoiser is replaced by a torchao tensor —
``nf4``: 4-bit NormalFloat in blocks of 64 with double-quantised scales (the QLoRA paper's layout; torchao's
``NF4Tensor``), ``int8``: torchao's 8-bit per-row weight-only — and the LoRA trains on top in fp32 (peft wraps
the quantised layer like any ``nn.Linear``). Convolutions, norms and embeddings stay as loaded. ``bf16`` (plain
torch) holds every ``nn.Linear`` and ``nn.Conv2d`` weight in bf16 instead (:class:`Bf16HeldLinear`,
:class:`Bf16HeldConv2d`: the layer computes in its input's dtype, or autocast's), halving the frozen base with
bf16's rounding as its only error; norms, embeddings and biases stay fp32 (a few MiB).

Why torchao and not bitsandbytes: both run on the CPU here and on CUDA, deterministically; torchao's NF4 tensor is
plain PyTorch (its ``F.linear`` is the dequantised weight's, bit for bit), while bitsandbytes repacks its 4-bit
weights on some CPUs (machine-dependent numerics). Neither is installed by ``make venv``: installed, diffusers,
transformers and peft import either in every stage process (docs/SDXL.md "A quantised base").

The base is quantised afresh from the init's weights at every start (deterministic: the same bytes every time), so a
checkpoint holds only the adapter's tensors and a resume is bit-identical. :func:`dequantised_state` gives the base
back in fp32 — what the adapter trained on — for merging and export.
"""

from __future__ import annotations

import torch

NF4_BLOCK = 64
"""Weights per NF4 block (one absmax scale each): the QLoRA paper's."""
NF4_SCALER_BLOCK = 256
"""Scales per block of the second quantisation (8-bit scales, one fp32 factor each); smaller where a layer is."""
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)
"""What an NF4 weight holds per weight: its 4-bit code, its block's 8-bit scale, the scales' fp32 factor (0.516 B)."""
QUANTISED = ("bf16", "nf4", "int8")
"""The base precisions below fp32 (``adapter.base_precision``)."""


class Bf16HeldLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose frozen weight is held in bf16: it computes in its input's dtype (under autocast, in
    autocast's: a bf16 weight then needs no cast copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, _for_input(self.weight, x), self.bias)


class Bf16HeldConv2d(torch.nn.Conv2d):
    """An ``nn.Conv2d`` whose frozen weight is held in bf16, computing as :class:`Bf16HeldLinear` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, _for_input(self.weight, x), self.bias)


BF16_HELD = {torch.nn.Linear: Bf16HeldLinear, torch.nn.Conv2d: Bf16HeldConv2d}


def _for_input(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight`` as the op computing on ``x`` needs it: as it is under autocast (which casts), else in ``x``'s dtype
    (bf16 → fp32 is exact, so an fp32 forward computes with the bf16-rounded weight)."""
    return weight if torch.is_autocast_enabled(x.device.type) else weight.to(x.dtype)


def quantise_linears(model: torch.nn.Module, precision: str) -> list[str]:
    """Hold the weight of every ``nn.Linear`` of ``model`` in ``precision`` (``nf4``, ``int8``; ``bf16``: every
    ``nn.Conv2d`` too), frozen; the names of the layers held so (a layer whose size does not divide into NF4 blocks is
    left as it is)."""
    if precision not in QUANTISED:
        raise ValueError(f"base precision must be one of {QUANTISED}; got {precision!r}")
    model.requires_grad_(False)
    if precision == "bf16":
        return _bf16(model)
    linears = [name for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    if precision == "int8":
        return _int8(model, linears)
    done = []
    for name in linears:
        module = model.get_submodule(name)
        quantised = _nf4(module.weight.detach().float())
        if quantised is not None:
            module.weight = torch.nn.Parameter(quantised, requires_grad=False)
            done.append(name)
    return done


def _nf4(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` as torchao's ``NF4Tensor``; None when its size is not a multiple of :data:`NF4_BLOCK`."""
    from torchao.quantization import to_nf4  # lazy: torchao costs ~2 s to import; only a quantised phase needs it

    if weight.numel() % NF4_BLOCK:
        return None
    scaler_block = NF4_SCALER_BLOCK
    while (weight.numel() // NF4_BLOCK) % scaler_block:
        scaler_block //= 2
    return to_nf4(weight, NF4_BLOCK, scaler_block)


def _bf16(model: torch.nn.Module) -> list[str]:
    """Every plain ``nn.Linear`` / ``nn.Conv2d`` of ``model`` as its :data:`BF16_HELD` class with a bf16 weight (the
    module's class is swapped in place, so peft wraps it as the layer it was); their names."""
    done = []
    for name, module in model.named_modules():
        held = BF16_HELD.get(type(module))
        if held is not None:
            module.__class__ = held
            module.weight = torch.nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
            done.append(name)
    return done


def _int8(model: torch.nn.Module, names: list[str]) -> list[str]:
    """torchao's int8 weight-only quantisation (per output row) of the layers ``names``; their names."""
    # lazy: torchao costs ~2 s to import; only a quantised phase needs it
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    wanted = set(names)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, fqn: fqn in wanted)
    return names


def is_quantised(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one of :func:`quantise_linears`' weights: a torchao tensor subclass, or a bf16 tensor
    (the trainer holds every other denoiser weight in fp32)."""
    return _is_torchao(tensor) or tensor.dtype == torch.bfloat16


def _is_torchao(tensor: torch.Tensor) -> bool:
    return type(tensor).__module__.startswith("torchao.")


def dequantised(tensor: torch.Tensor) -> torch.Tensor:
    """A quantised weight as the fp32 tensor its layer computes with; any other tensor as it is."""
    if hasattr(tensor, "get_original_weight"):  # NF4Tensor
        return tensor.get_original_weight().float()
    if _is_torchao(tensor):
        return tensor.dequantize().float()
    if tensor.dtype == torch.bfloat16:
        return tensor.float()
    return tensor


def held_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` occupies (a quantised weight: its codes, scales and factors)."""
    if hasattr(tensor, "__tensor_flatten__") and is_quantised(tensor):
        names = tensor.__tensor_flatten__()[0]
        return sum(held_bytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()


def dequantised_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every quantised weight dequantised (fp32); the other tensors as they are."""
    return {k: dequantised(v) if is_quantised(v) else v for k, v in state.items()}


@torch.no_grad()
def quantisation_error(before: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, float]:
    """``max_abs_error`` and ``rel_error`` (Frobenius, over every quantised weight together) of ``model``'s
    quantised weights against their values ``before`` (its state dict then)."""
    state = model.state_dict()
    pairs = [(before[k].float(), dequantised(v)) for k, v in state.items() if is_quantised(v)]
    if not pairs:
        return {"max_abs_error": 0.0, "rel_error": 0.0}
    worst = max(float((b - a).abs().max()) for a, b in pairs)
    diff = sum(float((b - a).pow(2).sum()) for a, b in pairs) ** 0.5
    norm = sum(float(a.pow(2).sum()) for a, _ in pairs) ** 0.5
    return {"max_abs_error": worst, "rel_error": diff / max(norm, 1e-30)}

