"""Activation checkpointing by unit, and the activation memory a training forward keeps for the backward (pure torch).

A denoiser's **checkpoint units** are the modules whose ``gradient_checkpointing`` flag diffusers reads at the top
of the model: the UNet's down, mid and up blocks (each then recomputes its ResNet and attention blocks one by one
in the backward), or an MM-DiT as a whole (its forward loops over its joint blocks). :func:`set_checkpointing` turns
checkpointing on for some units (``selective``), all of them (``full``) or none (``off``), with non-reentrant
``torch.utils.checkpoint`` as diffusers' own ``enable_gradient_checkpointing`` does.

:func:`saved_activation_bytes` measures, per unit, what one forward keeps for its backward: the bytes of every
tensor autograd saves (``saved_tensors_hooks``; a storage counted once, if still saved when the forward returns)
plus, inside a checkpointed unit, the inputs each checkpoint keeps to recompute from. That is the part of a step's
peak memory that grows with the batch (:mod:`sdforge.training.memory_plan` turns it into a micro-batch and a
checkpointing choice; docs/MEMORY.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

OUTSIDE = "(outside units)"
"""The key of :func:`saved_activation_bytes` for what no unit holds (input/output layers, time embedding)."""


def checkpoint_units(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's checkpoint units by module name, in forward order: the outermost modules with diffusers'
    ``gradient_checkpointing`` flag below the root (the UNet's blocks), else the root itself (name ``""``)."""
    flagged = [name for name, m in model.named_modules() if name and hasattr(m, "gradient_checkpointing")]
    top = [n for n in flagged if not any(n.startswith(f"{o}.") for o in flagged if o != n)]
    if not top:
        return {"": model}
    modules = dict(model.named_modules())
    return {name: modules[name] for name in top}


class _Recorder:
    """Counts the bytes of the tensors a checkpoint keeps while :func:`saved_activation_bytes` measures."""

    active: list[Callable[[tuple], None]] = []


def _checkpointed_call(module: torch.nn.Module, *args):
    """diffusers' ``_gradient_checkpointing_func``: non-reentrant ``checkpoint`` of ``module``'s call."""
    for record in _Recorder.active:
        record(args)
    return checkpoint(module.__call__, *args, use_reentrant=False)


def set_checkpointing(model: torch.nn.Module, units: list[str] | str) -> list[str]:
    """Checkpoint the named units (``"full"``: every unit, ``"off"``/``[]``: none) and no other; the units now
    checkpointed. A KeyError names an unknown unit and the model's units."""
    all_units = checkpoint_units(model)
    chosen = list(all_units) if units == "full" else [] if units == "off" else list(units)
    unknown = [u for u in chosen if u not in all_units]
    if unknown:
        raise KeyError(f"no checkpoint unit {unknown}; the model's units: {list(all_units)}")
    for name, unit in all_units.items():
        for module in unit.modules():
            if hasattr(module, "gradient_checkpointing"):
                module._gradient_checkpointing_func = _checkpointed_call
                module.gradient_checkpointing = name in chosen
    return chosen


def _storage_id(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (views share it; meta tensors have one each, without an address)."""
    return tensor.untyped_storage()._cdata


@contextlib.contextmanager
def _unit_scope(units: dict[str, torch.nn.Module], stack: list[str]) -> Iterator[None]:
    """Keep ``stack`` holding the unit whose forward is running (outermost first)."""
    def leave(_module, _args, _output) -> None:  # returns None: the output stays as it is
        stack.pop()

    handles = []
    for name, unit in units.items():
        handles.append(unit.register_forward_pre_hook(lambda _m, _a, n=name: stack.append(n)))
        handles.append(unit.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def saved_activation_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Bytes one call of ``forward()`` (the model's training forward, loss included) keeps for the backward, per
    checkpoint unit (and :data:`OUTSIDE`), under the model's current checkpointing: the storages still saved when
    it returns, each counted once. Parameters (and views of them) are not activations and are left out; so is what
    the forward saved and freed again (a branch it dropped, e.g. DoRA's weight norm). No backward is run."""
    units = checkpoint_units(model)
    params = {_storage_id(p) for p in model.parameters()}
    saved: dict[int, tuple[str, torch.UntypedStorage]] = {}  # held, so no freed storage's address is taken again
    stack: list[str] = []

    def count(tensor: torch.Tensor) -> None:
        ptr = _storage_id(tensor)
        if ptr not in params and ptr not in saved:
            saved[ptr] = (stack[0] if stack else OUTSIDE, tensor.untyped_storage())

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        count(tensor)
        return tensor.detach()  # a saved output holding its own grad_fn would be a cycle: never freed

    def record(args: tuple) -> None:
        for arg in args:
            if isinstance(arg, torch.Tensor):
                count(arg)

    totals = dict.fromkeys([*units, OUTSIDE], 0)
    _Recorder.active.append(record)
    try:
        with _unit_scope(units, stack), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward()  # held while the storages are tallied: its graph keeps them
            for unit, storage in saved.values():
                if torch._C._storage_Use_Count(storage._cdata) > 1:  # someone besides `saved` still holds it
                    totals[unit] += storage.nbytes()
            del loss
    finally:
        _Recorder.active.remove(record)
    return totals


@dataclass(frozen=True)
class ActivationProfile:
    """What each checkpoint unit keeps for the backward, measured at batch 1 and 2 (so the batch-independent part —
    autocast's low-precision copies of the weights — is apart): per sample and fixed, with the unit run as it is
    (``kept_*``) and checkpointed (``checkpointed_*``); and its forward FLOPs per sample (what a checkpoint
    recomputes). Every dict is keyed by unit name, :data:`OUTSIDE` included (never checkpointed)."""

    kept_per_sample: dict[str, float]
    kept_fixed: dict[str, float]
    checkpointed_per_sample: dict[str, float]
    checkpointed_fixed: dict[str, float]
    forward_flops: dict[str, float]

    @property
    def units(self) -> list[str]:
        """The units that can be checkpointed, in forward order."""
        return [u for u in self.kept_per_sample if u != OUTSIDE]


def measure_profile(model: torch.nn.Module, forward_at: Callable[[int], torch.Tensor]) -> ActivationProfile:
    """The :class:`ActivationProfile` of ``model`` (its checkpointing is put back as it was). ``forward_at(b)``
    runs its training forward at batch ``b`` and returns the loss."""
    before = [n for n, u in checkpoint_units(model).items() if getattr(u, "gradient_checkpointing", False)]
    measured = {}
    for mode in ("off", "full"):
        set_checkpointing(model, mode)
        one = saved_activation_bytes(model, lambda: forward_at(1))
        two = saved_activation_bytes(model, lambda: forward_at(2))
        measured[mode] = ({u: float(two[u] - one[u]) for u in one}, {u: float(2 * one[u] - two[u]) for u in one})
    set_checkpointing(model, before)
    return ActivationProfile(*measured["off"], *measured["full"], _unit_flops(model, lambda: forward_at(1)))


def _unit_flops(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> dict[str, float]:
    """Forward FLOPs of each checkpoint unit (and :data:`OUTSIDE`: the rest) for one call of ``forward``."""
    from torch.utils.flop_counter import FlopCounterMode  # lazy: only a memory plan counts FLOPs

    units = checkpoint_units(model)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        forward()
    by_module = counter.get_flop_counts()
    root = type(model).__name__
    total = float(sum(by_module.get("Global", {}).values()))
    flops = {u: float(sum(by_module.get(f"{root}.{u}" if u else root, {}).values())) for u in units}
    flops[OUTSIDE] = max(0.0, total - sum(flops.values()))
    return flops


def as_fake_tensors(module: torch.nn.Module, mode, device: torch.device) -> torch.nn.Module:
    """Turn ``module``'s ``meta`` parameters and buffers into fake tensors of ``mode`` (a
    ``torch._subclasses.fake_tensor.FakeTensorMode``) on ``device``: shapes and dtypes without storage, so a
    full-size model's training forward runs under ``mode`` as it would on ``device`` (the same kernels chosen,
    e.g. the CPU's flash attention), and :func:`measure_profile` measures it without the memory. In place;
    ``requires_grad`` kept. (``module.to()`` cannot do this: it swaps fake parameters and fails.)"""
    converter = mode.fake_tensor_converter
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                fake = converter.from_meta_and_device(mode, param, device)
                sub._parameters[name] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = converter.from_meta_and_device(mode, buffer, device)
    return module
