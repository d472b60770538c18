"""Foreign state dicts: wrapper prefixes stripped in any order, nesting unwrapped, strict load names the keys."""

import pytest
import torch

from model.weights import (
    load_state_dict_strict,
    state_dict_mismatches,
    strip_wrapper_prefix,
    strip_wrapper_prefixes,
    unnest_state_dict,
)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


@pytest.mark.parametrize(
    ("key", "bare"),
    [
        ("0.weight", "0.weight"),
        ("module.0.weight", "0.weight"),
        ("_orig_mod.module.0.weight", "0.weight"),
        ("module._orig_mod.unet.0.bias", "0.bias"),
        ("_fsdp_wrapped_module.unet.module.module.2.weight", "2.weight"),
        ("down_blocks.0.module.weight", "down_blocks.0.module.weight"),  # only leading prefixes go
    ],
)
def test_strip_wrapper_prefix_repeatedly_in_any_order(key, bare):
    assert strip_wrapper_prefix(key) == bare


def test_strip_wrapper_prefixes_keeps_tensors_and_rejects_collisions():
    t = torch.ones(2)
    out = strip_wrapper_prefixes({"module._orig_mod.a": t, "unet.b": t})
    assert list(out) == ["a", "b"] and out["a"] is t
    with pytest.raises(ValueError, match="collide"):
        strip_wrapper_prefixes({"module.a": t, "a": t})


@pytest.mark.parametrize(
    "wrap",
    [
        lambda sd: sd,
        lambda sd: {"state_dict": sd, "epoch": 3},
        lambda sd: {"model": {"unet": sd}, "step": 10, "optimizer": {"lr": 1e-4}},
        lambda sd: {"ema": sd, "global_step": 7},
    ],
)
def test_unnest_state_dict(wrap):
    sd = {"w": torch.zeros(1), "b": torch.ones(1)}
    assert unnest_state_dict(wrap(sd)) == sd


def test_unnest_without_tensors_names_what_it_found():
    with pytest.raises(ValueError, match=r"no state dict of tensors.*'step': 'int'"):
        unnest_state_dict({"step": 3, "optim": [1]})


def test_strict_load_from_wrapped_checkpoint():
    src, dst = _net(), torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    wrapped = {"state_dict": {f"module._orig_mod.{k}": v for k, v in src.state_dict().items()}}
    load_state_dict_strict(dst, strip_wrapper_prefixes(unnest_state_dict(wrapped)))
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=True))


def test_mismatch_error_names_missing_unexpected_and_shapes():
    sd = dict(_net().state_dict())
    del sd["2.bias"]
    sd["extra.weight"] = torch.zeros(1)
    sd["0.weight"] = torch.zeros(5, 3)
    assert state_dict_mismatches(_net(), sd) == {
        "missing": ["2.bias"],
        "unexpected": ["extra.weight"],
        "shape": ["0.weight: [5, 3] vs model [4, 3]"],
    }
    with pytest.raises(ValueError) as err:
        load_state_dict_strict(_net(), sd)
    assert str(err.value) == (
        "state dict does not match the model: 1 missing (2.bias); 1 unexpected (extra.weight); "
        "1 shape mismatches (0.weight: [5, 3] vs model [4, 3])"
    )


def test_mismatch_error_shows_only_a_few_keys():
    with pytest.raises(ValueError, match=r"4 missing \(0\.bias, 0\.weight, 2\.bias, …\)"):
        load_state_dict_strict(_net(), {})
