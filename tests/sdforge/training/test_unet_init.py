"""Where a phase's UNet starts: unloadable files are one-line InputErrors that never suggest unpickling."""

from __future__ import annotations

import argparse

import pytest
import torch

from sdforge.io import UNPICKLE_REFUSED, InputError
from sdforge.training.unet_init import load_foreign_state_dict, load_init_unet


def test_a_pickled_object_in_init_path_is_refused_by_name(tmp_path):
    path = tmp_path / "foreign.pt"
    torch.save({"weight": torch.zeros(2), "extra": argparse.Namespace(a=1)}, path)  # an arbitrary Python object
    with pytest.raises(InputError) as err:
        load_foreign_state_dict(path)
    message = str(err.value)
    assert str(path) in message and UNPICKLE_REFUSED in message
    assert "weights_only" not in message and "\n" not in message


def test_a_truncated_safetensors_init_path_is_one_line(tmp_path):
    path = tmp_path / "foreign.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(InputError, match=r"foreign\.safetensors: cannot read a state dict") as err:
        load_foreign_state_dict(path)
    assert "\n" not in str(err.value)


def test_a_pickle_only_previous_phase_unet_is_never_loaded(tmp_path):
    unet = tmp_path / "phase1" / "unet_ema"
    unet.mkdir(parents=True)
    (unet / "config.json").write_text('{"_class_name": "UNet2DConditionModel"}')
    torch.save({"conv_in.weight": torch.zeros(1)}, unet / "diffusion_pytorch_model.bin")
    with pytest.raises(InputError) as err:
        load_init_unet(tmp_path / "phase1", "ema", {})
    message = str(err.value)
    assert message.startswith(f"{unet}: cannot load the UNet") and "weights_only" not in message
