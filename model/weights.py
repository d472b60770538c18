"""Foreign state dicts: unwrap nesting, strip wrapper prefixes, load strictly with a readable diff.

Pure torch; the stage reads the file (``sdforge.training.trainer.load_foreign_state_dict``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "unet.", "_fsdp_wrapped_module.")
"""Added by DDP (``module.``), ``torch.compile`` (``_orig_mod.``), a pipeline/Lightning wrapper (``unet.``), FSDP."""

NESTING_KEYS = ("state_dict", "model", "unet", "ema")
"""Keys under which training scripts nest the weights, tried in this order."""


def unnest_state_dict(obj: Mapping) -> dict[str, torch.Tensor]:
    """The tensor dict in ``obj``: itself, or nested under ``state_dict``/``model``/``unet``/``ema`` (repeatedly)."""
    seen = 0
    while isinstance(obj, Mapping) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        inner = next((obj[k] for k in NESTING_KEYS if isinstance(obj.get(k), Mapping)), None)
        if inner is None or seen > 8:
            kinds = {k: type(v).__name__ for k, v in list(obj.items())[:6]}
            raise ValueError(f"no state dict of tensors found (looked under {list(NESTING_KEYS)}); got keys {kinds}")
        obj, seen = inner, seen + 1
    if not isinstance(obj, Mapping) or not obj:
        raise ValueError(f"expected a non-empty dict of tensors; got {type(obj).__name__}")
    return dict(obj)


def strip_wrapper_prefix(key: str) -> str:
    """``key`` without any leading :data:`WRAPPER_PREFIXES`, removed repeatedly and in any order."""
    while True:
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        else:
            return key


def strip_wrapper_prefixes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``state_dict`` with wrapper prefixes stripped from every key; two keys colliding raise."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        bare = strip_wrapper_prefix(key)
        if bare in out:
            raise ValueError(f"keys collide after stripping wrapper prefixes: {key!r} → {bare!r}")
        out[bare] = value
    return out


def state_dict_mismatches(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Missing keys, unexpected keys and shape mismatches (``key: file shape vs model shape``) against ``model``."""
    expected = model.state_dict()
    return {
        "missing": sorted(set(expected) - set(state_dict)),
        "unexpected": sorted(set(state_dict) - set(expected)),
        "shape": [
            f"{k}: {list(state_dict[k].shape)} vs model {list(v.shape)}"
            for k, v in expected.items()
            if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)
        ],
    }


def load_state_dict_strict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], show: int = 3) -> None:
    """Load ``state_dict`` (prefixes already stripped) into ``model``; any mismatch raises naming ``show`` keys each."""
    problems = state_dict_mismatches(model, state_dict)
    if any(problems.values()):
        parts = [
            f"{len(keys)} {kind} ({', '.join(keys[:show])}{', …' if len(keys) > show else ''})"
            for kind, keys in (
                ("missing", problems["missing"]),
                ("unexpected", problems["unexpected"]),
                ("shape mismatches", problems["shape"]),
            )
            if keys
        ]
        raise ValueError("state dict does not match the model: " + "; ".join(parts))
    model.load_state_dict(dict(state_dict), strict=True)
