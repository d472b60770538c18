"""train stage, ControlNet phases (``phases.<p>.controlnet``, docs/CONTROL.md): only the ControlNet trains on the
frozen init UNet, under each sample's conditioning image read beside its latent; a SIGKILLed run resumes to
bitwise-equal ControlNet weights (through the static-buffer step); the exports; the refusals."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from diffusers import AutoencoderKL, ControlNetModel
from PIL import Image
from safetensors.torch import load_file

from bench.gpu import workspace
from model.denoisers import family
from sdforge.config import load_params, parse_params
from sdforge.eval.control import condition_rgb
from sdforge.eval.grid import captioned_grid
from sdforge.io import InputError, conditions_path
from stages import mix_phase
from tests.fixtures.training import (
    SAMPLES,
    assert_equal_files,
    check_resumed,
    clone_workspace,
    controlnet_params,
    straight_and_killed,
    tiny_params,
    train,
    weights,
    write_conditions,
)

RESUME_FROM = {3: 2, 4: 4, 5: 4}
"""phase2 as in test_train: 3 optimizer steps per epoch, checkpoints at steps 2, 3 (epoch end), 4, 6."""
KILL_SEED = int(os.environ.get("SDFORGE_KILL_SEED", random.SystemRandom().randrange(2**31)))
KILL_AT = random.Random(KILL_SEED).choice(sorted(RESUME_FROM))
MISSING = (5, 17)
"""Rows condition_images skipped: they train under an empty map, counted."""
CN_FILE = "diffusion_pytorch_model.safetensors"


def controlnet_workspace(straight_phase1: Path, root: Path) -> Path:
    params_file = clone_workspace(straight_phase1, root)
    controlnet_params(params_file)
    write_conditions(params_file, missing_rows=MISSING)
    return params_file


@pytest.fixture(scope="module")
def runs(tmp_path_factory, straight_phase1):
    """Phase 2 as a ControlNet phase straight through (eager, with validation images every 3 steps), and SIGKILLed
    then resumed with ``train.cuda_graphs: step`` (the static-buffer step on a CPU) and no validation."""
    straight = controlnet_workspace(straight_phase1, tmp_path_factory.mktemp("straight"))
    data = yaml.safe_load(straight.read_text())
    data["train"].update(validation_every=3, validation_prompts=2)
    straight.write_text(yaml.safe_dump(data))
    decoding_vae(Path(data["paths"]["models"]))
    killed = controlnet_workspace(straight_phase1, tmp_path_factory.mktemp("killed"))
    data = yaml.safe_load(killed.read_text())
    data["train"]["cuda_graphs"] = "step"
    killed.write_text(yaml.safe_dump(data))
    return straight_and_killed(straight, killed, "phase2", KILL_AT)


def decoding_vae(models: Path) -> None:
    """A random VAE of the tiny store's factor (64-px buckets, 8x8 latents: 8) in place of the workspace's (factor 2;
    training never reads it): validation decodes what it samples, at its condition's size."""
    blocks = 4
    with torch.random.fork_rng():
        torch.manual_seed(0)
        vae = AutoencoderKL(block_out_channels=[8] * blocks, down_block_types=["DownEncoderBlock2D"] * blocks,
                            up_block_types=["UpDecoderBlock2D"] * blocks, latent_channels=4, norm_num_groups=4,
                            layers_per_block=1)  # fmt: skip
    shutil.rmtree(models / "vae")
    vae.save_pretrained(models / "vae")


def test_sigkill_then_resume_gives_bitwise_equal_controlnet_weights(runs):
    straight, killed, died, resumed = runs
    why = check_resumed(died, resumed, KILL_AT, RESUME_FROM[KILL_AT], KILL_SEED)
    for sub in ("controlnet", "controlnet_ema"):
        a = assert_equal_files((straight, killed), f"checkpoints/phase2/{sub}/{CN_FILE}", why)
        assert len(a) > 50, sub


def test_only_the_controlnet_trained_and_the_base_is_exported_unchanged(runs, straight_phase1):
    straight = runs[0]
    base = weights(straight_phase1, "phase1", "unet_ema")
    for sub in ("unet", "unet_ema"):
        exported = weights(straight, "phase2", sub)
        assert exported.keys() == base.keys() and all(torch.equal(exported[k], base[k]) for k in base), sub
    trained = load_file(straight / "checkpoints/phase2/controlnet_ema" / CN_FILE)
    zero_convs = [k for k in trained if k.startswith("controlnet_down_blocks") or k.startswith("controlnet_mid")]
    assert zero_convs and all(trained[k].abs().max() > 0 for k in zero_convs if k.endswith("weight"))
    copied = "down_blocks.0.resnets.0.conv1.weight"  # from_unet copied it from the base, then it trained
    assert not torch.equal(trained[copied], base[copied])
    metrics = json.loads((straight / "metrics/train/phase2.json").read_text())
    assert metrics["trainable_params"] == sum(t.numel() for t in trained.values())
    assert metrics["unet_params"] == sum(t.numel() for t in base.values())
    assert metrics["controlnet.missing_conditions"] == len(MISSING) * metrics["epochs"]
    state = json.loads((straight / "checkpoints/phase2/state.json").read_text())
    assert state["controlnet"] == {"condition": "canny", "conditioning_scale": 1.0, "embedding_channels": None}


def test_the_trained_controlnet_reads_its_condition_and_steers_the_unet(runs):
    out = runs[0] / "checkpoints/phase2"
    unet_family = family("unet")
    unet = unet_family.model_class().from_pretrained(out / "unet_ema")
    controlled = unet_family.load_controlled(unet, out / "controlnet_ema", scale=1.0)
    assert isinstance(controlled.controlnet, ControlNetModel)
    # the condition's encoder ends in a zero convolution: non-zero now, so the image reaches the ControlNet
    assert controlled.controlnet.controlnet_cond_embedding.conv_out.weight.abs().max() > 0
    gen = torch.Generator().manual_seed(0)
    x, cond = torch.randn(1, 4, 8, 8, generator=gen), torch.randn(1, 16, unet.config.cross_attention_dim, generator=gen)
    t = torch.tensor([500])
    image = (torch.rand(1, 1, 64, 64, generator=gen) < 0.3).float().expand(-1, 3, -1, -1)
    with torch.no_grad(), controlled.conditioned(image):
        steered = unet_family.predict(controlled, x, t, cond)
    with torch.no_grad():
        plain = unet_family.predict(unet, x, t, cond)
    assert (steered - plain).abs().max() > 1e-4  # its residuals change the UNet's prediction
    with pytest.raises(RuntimeError, match="without a conditioning image"):
        unet_family.predict(controlled, x, t, cond)


def test_validation_images_are_drawn_under_the_first_samples_conditions_without_changing_training(runs):
    """The straight run sampled validation images (it holds no samples out: its first training samples'
    conditions); its weights equal the resumed run's, which sampled none (the resume test)."""
    paths = load_params(runs[0] / "params.yaml").paths
    folder = Path(paths.runs) / "phase2/validation"
    grids = sorted(p.name for p in folder.glob("*.png"))
    assert grids == ["step-00000003.png", "step-00000006.png"]
    keys = pq.read_table(Path(paths.mixes) / "phase2.parquet", columns=["key"]).column("key").to_pylist()
    firsts = [int(k) for k in keys if int(k) not in MISSING][:2]
    w, h = workspace.BUCKET
    maps = np.random.default_rng(0).random((SAMPLES, h * w)) < 0.2  # write_conditions' maps (seed 0)
    conditions = [condition_rgb(maps[k].reshape(h, w)) for k in firsts]
    grid = np.asarray(Image.open(folder / grids[-1]).convert("RGB"))
    want = np.asarray(captioned_grid([*conditions, *conditions], ["condition"] * 2 + ["c", "c"], 2))
    assert grid.shape == want.shape
    top = grid.shape[0] // 2  # the conditions' row; the drawn images are the row below
    assert np.array_equal(grid[:top], want[:top])
    assert grid[top:].std() > 0


def test_a_controlnet_phase_without_its_conditions_names_the_stage_to_run(fresh_workspace):
    controlnet_params(fresh_workspace)
    phase1 = train(fresh_workspace, "phase1")
    assert phase1.returncode == 0, phase1.stderr[-2000:]
    done = train(fresh_workspace, "phase2")
    assert done.returncode != 0
    assert "run condition_images@laion with canny in conditions.kinds" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"adapter": {"rank": 2}}, "does not combine with adapter"),
        ({"init_from": "scratch"}, "controlnet needs a trained UNet"),
        ({"kinds": []}, "is not in conditions.kinds"),
        ({"family": "mmdit"}, "SD3ControlNetModel) is not built yet"),
    ],
)
def test_controlnet_settings_that_cannot_train_are_refused_by_key(tmp_path, change, message):
    data = tiny_params(tmp_path, family="mmdit" if "family" in change else "unet")
    data["conditions"] = {"kinds": change.get("kinds", ["canny"])}
    phase = data["phases"]["phase2"]
    phase["controlnet"] = {"condition": "canny"}
    phase.update({k: v for k, v in change.items() if k in ("adapter", "init_from")})
    with pytest.raises(ValueError, match=r"phases\.phase2") as err:
        parse_params(data)
    assert message in str(err.value)


def test_a_controlnet_phase_drops_half_the_prompts_unless_it_says(tmp_path):
    data = tiny_params(tmp_path)
    data["conditions"] = {"kinds": ["canny"]}
    data["phases"]["phase2"]["controlnet"] = {"condition": "canny"}
    data["phases"]["phase2"].pop("cfg_dropout")
    assert parse_params(data).phases["phase2"].cfg_dropout == 0.5
    data["phases"]["phase2"]["cfg_dropout"] = 0.1
    assert parse_params(data).phases["phase2"].cfg_dropout == 0.1


def test_mix_phase_records_the_condition_shards_a_controlnet_phase_reads(fresh_workspace):
    controlnet_params(fresh_workspace)
    params = load_params(fresh_workspace)
    index = Path(params.paths.mixes) / "phase2.parquet"
    args = ("phase2", params.phases["phase2"], Path(params.paths.latents), index, 0, "square", 0)
    with pytest.raises(InputError, match="run condition_images@laion with canny"):
        mix_phase.run(*args, conditions_dir=Path(params.paths.conditions))
    write_conditions(fresh_workspace)
    mix_phase.run(*args, conditions_dir=Path(params.paths.conditions))
    record = json.loads(conditions_path(index).read_text())
    marker = Path(params.paths.conditions) / "laion/square/canny/shard-00000.json"
    assert record == {"kind": "canny", "markers": {
        "laion/square/canny/shard-00000.json": hashlib.sha256(marker.read_bytes()).hexdigest()}}
    write_conditions(fresh_workspace, seed=1, missing_rows=(3,))  # new conditions: a new record, so train reruns
    mix_phase.run(*args, conditions_dir=Path(params.paths.conditions))
    assert json.loads(conditions_path(index).read_text())["markers"] != record["markers"]
    phase1 = Path(params.paths.mixes) / "phase1.parquet"
    mix_phase.run("phase1", params.phases["phase1"], Path(params.paths.latents), phase1, 0, "square", 0)
    assert json.loads(conditions_path(phase1).read_text()) == {"kind": None, "markers": {}}
