"""train stage, distill phases (latent consistency distillation, ``phases.<p>.distill``): a SIGKILLed run resumes
to bitwise-equal LoRA weights, the teacher's weights stay untouched, and the outputs say how to sample it."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import yaml

from sdforge.eval.sampling import few_step_settings, load_pipeline
from tests.fixtures.training import assert_equal_files, check_resumed, clone_workspace, straight_and_killed, weights

LORA = {"type": "lora", "rank": 2, "targets": ["self_attention", "cross_attention", "time_embedding"], "merge": False}
DISTILL = {"method": "lcm", "num_ddim_timesteps": 5, "w_min": 2.0, "w_max": 4.0, "sampling_steps": 2}
# phase2 as in test_train: 3 optimizer steps per epoch, checkpoints at steps 2, 3 (epoch end), 4, 6
RESUME_FROM = {3: 2, 4: 4, 5: 4}
KILL_SEED = int(os.environ.get("SDFORGE_KILL_SEED", random.SystemRandom().randrange(2**31)))
KILL_AT = random.Random(KILL_SEED).choice(sorted(RESUME_FROM))
LORA_FILE = "pytorch_lora_weights.safetensors"


def distill_workspace(straight_phase1, root):
    """The tiny workspace with phase 1 trained and phase 2 distilling it into a LoRA."""
    params_file = clone_workspace(straight_phase1, root)
    data = yaml.safe_load(params_file.read_text())
    data["phases"]["phase2"].update(
        adapter=LORA, distill=DISTILL, lr=5e-3, cfg_dropout=0.0, min_snr_gamma=None, timestep_sampling="uniform"
    )
    params_file.write_text(yaml.safe_dump(data))
    return params_file


@pytest.fixture(scope="module")
def runs(tmp_path_factory, straight_phase1):
    straight = distill_workspace(straight_phase1, tmp_path_factory.mktemp("straight"))
    killed = distill_workspace(straight_phase1, tmp_path_factory.mktemp("killed"))
    return straight_and_killed(straight, killed, "phase2", KILL_AT)


def test_sigkill_then_resume_gives_bitwise_equal_lora_weights(runs):
    straight, killed, died, resumed = runs
    why = check_resumed(died, resumed, KILL_AT, RESUME_FROM[KILL_AT], KILL_SEED)
    for sub in ("adapter", "adapter_ema"):
        a = assert_equal_files((straight, killed), f"checkpoints/phase2/{sub}/{LORA_FILE}", why)
        trained = [v for k, v in a.items() if "lora_B" in k]  # B starts at zero: the distillation moved it
        assert trained and all(float(v.abs().max()) > 0 for v in trained), sub


def test_the_teacher_is_untouched_and_the_state_says_how_to_sample(runs):
    straight, _, _, _ = runs
    teacher = weights(straight, "phase1", "unet_ema")
    for sub in ("unet", "unet_ema"):  # merge: false: the phase's UNet folders are the teacher, bit for bit
        kept = weights(straight, "phase2", sub)
        assert kept.keys() == teacher.keys() and all(torch.equal(teacher[k], kept[k]) for k in teacher)
    state = json.loads((straight / "checkpoints/phase2/state.json").read_text())
    assert state["distill"]["num_ddim_timesteps"] == 5 and state["adapter"]["merge"] is False
    pipe = load_pipeline(straight / "models", straight / "checkpoints/phase2", device="cpu")
    assert few_step_settings(pipe) == (2, 1.0) and pipe.unet.peft_config
    metrics = json.loads((straight / "metrics/train/phase2.json").read_text())
    assert metrics["steps"] == 6 and metrics["trainable_params"] < metrics["unet_params"] / 10
    assert not any(k.startswith("val_loss") for k in metrics)  # the student's output is no denoising target
