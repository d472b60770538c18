"""``sdforge.eval.export``: a diffusers folder that ``StableDiffusionPipeline.from_pretrained`` loads and that
reproduces our sampler's images exactly; registration in the MLflow model registry (sqlite)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdforge.config import Tracking
from sdforge.eval.export import EXPORT_ENTRIES, EXPORT_MARKER, MODEL_ARTIFACT, export_pipeline, register
from sdforge.eval.sampling import generate, load_pipeline
from sdforge.io import InputError
from tests.fixtures.eval_workspace import make_workspace, write_adapter_phase, write_distilled_phase

PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    models, ckpt = make_workspace(root)
    metrics = export_pipeline(models, ckpt, root / "sd")
    return models, ckpt, root / "sd", metrics


def test_folder_layout_ema_unet_ddim_without_clamp_and_no_safety_checker(exported):
    _, ckpt, out, metrics = exported
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline" and index["requires_safety_checker"] is False
    assert index["safety_checker"] == [None, None] and index["scheduler"] == ["diffusers", "DDIMScheduler"]
    sched = json.loads((out / "scheduler/scheduler_config.json").read_text())
    assert sched["clip_sample"] is False and sched["prediction_type"] == "v_prediction"
    assert sched["rescale_betas_zero_snr"] is True and sched["timestep_spacing"] == "trailing"
    assert (sched["beta_start"], sched["beta_end"], sched["beta_schedule"]) == (0.00085, 0.012, "scaled_linear")
    assert not list(out.rglob("*.bin")) and len(list(out.rglob("*.safetensors"))) == 3
    exported_unet = load_file(out / "unet/diffusion_pytorch_model.safetensors")
    ema = load_file(ckpt / "unet_ema/diffusion_pytorch_model.safetensors")
    assert all(torch.equal(exported_unet[k], ema[k]) for k in ema)
    assert metrics["weights"] == "ema" and metrics["image_size"] == 16


def test_from_pretrained_reproduces_our_sampler_exactly(exported):
    from diffusers import StableDiffusionPipeline

    models, ckpt, out, _ = exported
    ours = np.stack(
        generate(load_pipeline(models, ckpt, device="cpu"), PROMPTS, negative_prompt="blurry", steps=4,
                 guidance_scale=3.0, seeds=[7, 8])
    )  # fmt: skip
    sd = StableDiffusionPipeline.from_pretrained(out)
    sd.set_progress_bar_config(disable=True)
    theirs = sd(
        PROMPTS,
        negative_prompt=["blurry"] * 2,
        num_inference_steps=4,
        guidance_scale=3.0,
        generator=[torch.Generator().manual_seed(s) for s in (7, 8)],  # CPU generators, one per image, like ours
        output_type="np",
    ).images
    theirs = (theirs * 255).round().astype(np.uint8)
    assert ours.std() > 10  # not a blank image
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() == 0  # measured: identical pixels


def test_register_creates_a_model_version_pointing_at_the_folder(exported, tmp_path, monkeypatch):
    import mlflow

    _, _, out, metrics = exported
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    got = register(out, "sdforge-demo", Tracking(mlflow_uri=uri), metrics)
    assert got["model_version"] == 1
    client = mlflow.MlflowClient(tracking_uri=uri)
    version = client.get_model_version("sdforge-demo", "1")
    assert version.run_id == got["run_id"] and version.source.endswith(f"/{MODEL_ARTIFACT}")
    assert version.tags["checkpoint_hash"] == metrics["checkpoint_hash"]
    names = {a.path for a in client.list_artifacts(got["run_id"], MODEL_ARTIFACT)}
    assert f"{MODEL_ARTIFACT}/model_index.json" in names and f"{MODEL_ARTIFACT}/unet" in names


def test_a_non_square_image_from_our_sampler_equals_the_exported_pipelines(exported):
    from diffusers import StableDiffusionPipeline

    models, ckpt, out, _ = exported
    width, height = 24, 16  # latents 12×8; the export's pipeline checks sides only against 8
    ours = np.stack(
        generate(load_pipeline(models, ckpt, device="cpu"), PROMPTS[:1], steps=3, guidance_scale=3.0, seeds=[5],
                 width=width, height=height)
    )  # fmt: skip
    sd = StableDiffusionPipeline.from_pretrained(out)
    sd.set_progress_bar_config(disable=True)
    theirs = sd(PROMPTS[:1], negative_prompt=[""], num_inference_steps=3, guidance_scale=3.0, width=width,
                height=height, generator=[torch.Generator().manual_seed(5)], output_type="np").images  # fmt: skip
    theirs = (theirs * 255).round().astype(np.uint8)
    assert ours.shape == theirs.shape == (1, height, width, 3)
    assert ours.std() > 10 and np.abs(ours.astype(int) - theirs.astype(int)).max() == 0


def test_a_side_that_is_not_a_multiple_of_the_models_is_refused(exported):
    models, ckpt, _, _ = exported
    pipe = load_pipeline(models, ckpt, device="cpu")
    with pytest.raises(ValueError, match="multiples of 4 px"):
        generate(pipe, PROMPTS[:1], steps=1, guidance_scale=1.0, seeds=[0], width=18, height=16)


def _ours_and_theirs(
    models, ckpt, sd, prompts=PROMPTS, steps=4, guidance=3.0, fuse=False
) -> tuple[np.ndarray, np.ndarray]:
    """Our sampler on ``ckpt`` (``fuse``: its unmerged adapter fused) and the diffusers pipeline ``sd``, same
    prompts, seeds (CPU generators, one per image), steps and guidance."""
    pipe = load_pipeline(models, ckpt, device="cpu", fuse_adapter=fuse)
    ours = np.stack(generate(pipe, prompts, negative_prompt="", steps=steps, guidance_scale=guidance,
                             seeds=[7, 8][: len(prompts)]))  # fmt: skip
    sd.set_progress_bar_config(disable=True)
    theirs = sd(
        prompts,
        negative_prompt=[""] * len(prompts),
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=[torch.Generator().manual_seed(s) for s in (7, 8)[: len(prompts)]],
        output_type="np",
    ).images
    return ours, (theirs * 255).round().astype(np.uint8)


@pytest.mark.parametrize(("kind", "merge", "max_diff"), [("lora", True, 1), ("lora", False, 0), ("dora", False, 0)])
def test_the_adapter_file_on_the_base_pipeline_draws_what_our_sampler_draws(exported, tmp_path, kind, merge, max_diff):
    """``StableDiffusionPipeline.load_lora_weights(adapter_ema/)`` on the base phase's export vs our sampler on the
    adapter phase: merged weights round differently from base + unfused LoRA (measured ≤ 1/255 per pixel), the
    unmerged adapter is applied the way diffusers applies it (identical pixels)."""
    from diffusers import StableDiffusionPipeline

    models, ckpt, out, _ = exported
    phase2 = tmp_path / "phase2"
    write_adapter_phase(ckpt, phase2, kind, merge)
    sd = StableDiffusionPipeline.from_pretrained(out)
    sd.load_lora_weights(phase2 / "adapter_ema")
    ours, theirs = _ours_and_theirs(models, phase2, sd)
    base = np.stack(generate(load_pipeline(models, ckpt, device="cpu"), PROMPTS, negative_prompt="", steps=4,
                             guidance_scale=3.0, seeds=[7, 8]))  # fmt: skip
    assert np.abs(ours.astype(int) - base.astype(int)).max() > 20  # the adapter changes the images
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= max_diff
    # the export of the adapter phase is one plain pipeline (unmerged adapters fused in)
    export_pipeline(models, phase2, tmp_path / "sd2")
    fused = StableDiffusionPipeline.from_pretrained(tmp_path / "sd2")
    assert not getattr(fused.unet, "peft_config", None)
    assert np.abs(_ours_and_theirs(models, phase2, fused)[1].astype(int) - ours.astype(int)).max() <= 1


def test_learned_words_reach_the_exported_text_encoder_and_it_reproduces_ours(exported, tmp_path):
    """A phase with a learned word ("red", adapter_ema/learned_embeds.safetensors): our sampler writes it into the
    text encoder's row, so does the export; the exported pipeline draws our pixels exactly."""
    import shutil

    from diffusers import StableDiffusionPipeline
    from transformers import CLIPTextModel

    from sdforge.io import write_json
    from sdforge.training.adapter_files import write_learned_words

    models, ckpt, _, _ = exported
    phase = tmp_path / "words"
    for sub in ("unet", "unet_ema"):
        shutil.copytree(ckpt / sub, phase / sub)
    (phase / "adapter_ema").mkdir()
    red = CLIPTextModel.from_pretrained(models / "text_encoder").get_input_embeddings().weight[523].detach()
    moved = red + torch.randn(red.shape, generator=torch.Generator().manual_seed(5)) * 3 * red.std()
    write_learned_words({"red": moved}, phase / "adapter_ema")
    write_json(phase / "state.json", {"phase": "words", "objective": "diffusion", "flow_shift": 1.0})
    export_pipeline(models, phase, tmp_path / "sd-words")
    exported_row = CLIPTextModel.from_pretrained(tmp_path / "sd-words/text_encoder").get_input_embeddings().weight
    assert torch.equal(exported_row[523], moved)  # "red" is token 523 of the demo tokenizer
    ours, theirs = _ours_and_theirs(models, phase, StableDiffusionPipeline.from_pretrained(tmp_path / "sd-words"))
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() == 0
    base, _ = _ours_and_theirs(models, ckpt, StableDiffusionPipeline.from_pretrained(tmp_path / "sd-words"))
    assert np.abs(ours[0].astype(int) - base[0].astype(int)).max() > 0  # the "red" prompt moved
    assert np.array_equal(ours[1], base[1])  # the prompt without the word did not


def test_a_flow_matching_checkpoint_exports_the_euler_sampler_and_reproduces_ours(exported, tmp_path):
    from diffusers import StableDiffusionPipeline

    from sdforge.io import write_json

    models, ckpt, _, _ = exported
    fm = tmp_path / "fm"
    for sub in ("unet", "unet_ema"):
        (fm / sub).parent.mkdir(parents=True, exist_ok=True)
        import shutil

        shutil.copytree(ckpt / sub, fm / sub)
    write_json(fm / "state.json", {"phase": "fm", "objective": "flow_matching", "flow_shift": 2.0})
    export_pipeline(models, fm, tmp_path / "sd-fm")
    sched = json.loads((tmp_path / "sd-fm/scheduler/scheduler_config.json").read_text())
    assert sched["_class_name"] == "DPMSolverMultistepScheduler" and sched["use_flow_sigmas"] is True
    assert (sched["prediction_type"], sched["flow_shift"], sched["solver_order"]) == ("flow_prediction", 2.0, 1)
    ours, theirs = _ours_and_theirs(models, fm, StableDiffusionPipeline.from_pretrained(tmp_path / "sd-fm"))
    assert ours.std() > 10 and np.abs(ours.astype(int) - theirs.astype(int)).max() == 0
    ddim = np.stack(generate(load_pipeline(models, ckpt, device="cpu"), PROMPTS, negative_prompt="", steps=4,
                             guidance_scale=3.0, seeds=[7, 8]))  # fmt: skip
    assert np.abs(ours.astype(int) - ddim.astype(int)).max() > 20  # another sampler: other images


def _max_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.mark.parametrize("objective", ["diffusion", "flow_matching"])
def test_a_distilled_phase_exports_fused_or_as_a_lora_file_and_both_draw_our_pixels(exported, tmp_path, objective):
    """An LCM-LoRA phase (unmerged adapter, state.json ``distill``), 4 steps, guidance 1: the fused export draws
    what our sampler draws with the adapter fused, the ``keep_lora`` export + ``load_lora_weights(folder)`` what it
    draws with the adapter unfused — identical pixels both (measured: max |diff| 0 for both objectives)."""
    from diffusers import StableDiffusionPipeline

    models, ckpt, _, _ = exported
    phase = tmp_path / "lcm"
    distill = write_distilled_phase(ckpt, phase, objective)
    metrics = export_pipeline(models, phase, tmp_path / "fused")
    assert (metrics["adapter"], metrics["sampling_steps"], metrics["guidance_scale"]) == ("fused", 4, 1.0)
    fused = StableDiffusionPipeline.from_pretrained(tmp_path / "fused")
    assert not getattr(fused.unet, "peft_config", None)
    ours_fused, theirs = _ours_and_theirs(models, phase, fused, guidance=1.0, fuse=True)
    assert ours_fused.std() > 10 and _max_diff(ours_fused, theirs) == 0

    lora_metrics = export_pipeline(models, phase, tmp_path / "lora", keep_lora=True)
    assert lora_metrics["adapter"] == "lora_file"
    lora = tmp_path / "lora" / "pytorch_lora_weights.safetensors"
    assert lora.read_bytes() == (phase / "adapter_ema/pytorch_lora_weights.safetensors").read_bytes()
    base_unet = load_file(tmp_path / "lora/unet/diffusion_pytorch_model.safetensors")
    ema = load_file(phase / "unet_ema/diffusion_pytorch_model.safetensors")
    assert base_unet.keys() == ema.keys() and all(torch.equal(base_unet[k], ema[k]) for k in ema)
    sd = StableDiffusionPipeline.from_pretrained(tmp_path / "lora")
    sd.load_lora_weights(tmp_path / "lora")
    ours, theirs = _ours_and_theirs(models, phase, sd, guidance=1.0)
    assert _max_diff(ours, theirs) == 0

    pipe = load_pipeline(models, phase, device="cpu")
    base = dataclasses.replace(load_pipeline(models, ckpt, device="cpu"), objective=objective, distill=distill,
                               flow_shift=pipe.flow_shift)  # fmt: skip
    without_lora = np.stack(generate(base, PROMPTS, steps=4, guidance_scale=1.0, seeds=[7, 8]))
    assert _max_diff(ours, without_lora) > 20  # the LoRA matters
    undistilled = np.stack(
        generate(dataclasses.replace(pipe, distill=None), PROMPTS, steps=4, guidance_scale=1.0, seeds=[7, 8])
    )
    index = json.loads((tmp_path / "fused/model_index.json").read_text())
    sched = json.loads((tmp_path / "fused/scheduler/scheduler_config.json").read_text())
    if objective == "diffusion":
        assert index["scheduler"] == ["diffusers", "LCMScheduler"] == ["diffusers", metrics["scheduler"]]
        assert (sched["original_inference_steps"], sched["timestep_scaling"], sched["clip_sample"]) == (50, 10.0, False)
        assert (sched["prediction_type"], sched["rescale_betas_zero_snr"]) == ("v_prediction", True)
        assert _max_diff(ours, undistilled) > 20  # LCM's consistency steps and re-noising, not DDIM
    else:  # the flow sampler's stochastic variant: SDE-DPM-Solver++ on flow sigmas (model.sampler's docstring)
        assert index["scheduler"] == ["diffusers", "DPMSolverMultistepScheduler"]
        assert (sched["use_flow_sigmas"], sched["flow_shift"]) == (True, 2.0)
        assert sched["algorithm_type"] == "sde-dpmsolver++"
        assert _max_diff(ours, undistilled) > 20  # fresh noise between steps, not the deterministic Euler step


def test_keep_lora_without_an_unmerged_adapter_is_one_clear_error(exported, tmp_path):
    models, ckpt, _, _ = exported
    with pytest.raises(InputError, match="no unmerged adapter to keep as a LoRA file"):
        export_pipeline(models, ckpt, tmp_path / "sd", keep_lora=True)
    assert not (tmp_path / "sd").exists()


# -- what --out may be (issue 55: `export --out DIR` deleted DIR whatever it held) ---------------------------


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file and folder under ``folder`` (relative path → its bytes; a folder → b"<dir>")."""
    return {p.relative_to(folder).as_posix(): b"<dir>" if p.is_dir() else p.read_bytes() for p in folder.rglob("*")}


def test_the_export_holds_only_what_an_export_may_hold_and_its_marker(exported):
    _, _, out, metrics = exported
    assert {p.name for p in out.iterdir()} <= EXPORT_ENTRIES
    assert json.loads((out / EXPORT_MARKER).read_text()) == metrics  # written into the folder before its rename


def test_a_folder_with_a_users_file_is_refused_and_left_byte_identical(exported, tmp_path):
    models, ckpt, _, _ = exported
    out = tmp_path / "mine"
    (out / "photos").mkdir(parents=True)
    (out / "photos/cat.jpg").write_bytes(b"\xff\xd8 a user's photo")
    (out / "notes.txt").write_text("keep me")
    before = _tree(tmp_path)
    with pytest.raises(InputError, match=r"--out .*mine: a folder with files that are not a previous export"):
        export_pipeline(models, ckpt, out)
    with pytest.raises(InputError, match="not a previous export"):
        export_pipeline(models, ckpt, out, overwrite=True)  # --overwrite replaces only a previous export
    assert _tree(tmp_path) == before  # nothing deleted, nothing left beside it


def test_a_file_as_out_is_refused(exported, tmp_path):
    models, ckpt, _, _ = exported
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(InputError, match="exists and is not a folder"):
        export_pipeline(models, ckpt, tmp_path / "model.safetensors")
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights"


def test_an_empty_folder_takes_the_export(exported, tmp_path):
    models, ckpt, _, _ = exported
    (tmp_path / "empty").mkdir()
    export_pipeline(models, ckpt, tmp_path / "empty")
    assert (tmp_path / "empty" / EXPORT_MARKER).is_file() and [p.name for p in tmp_path.iterdir()] == ["empty"]


@pytest.mark.parametrize("where", ["the checkpoint", "inside the checkpoint", "the models folder", "their parent"])
def test_out_overlapping_what_the_export_reads_is_refused(exported, tmp_path, where):
    models, ckpt, _, _ = exported
    out = {"the checkpoint": ckpt, "inside the checkpoint": ckpt / "export", "the models folder": models / "x/..",
           "their parent": ckpt.parent.parent}[where]  # fmt: skip
    before = _tree(ckpt.parent.parent)
    with pytest.raises(InputError, match="--out .*: overlaps the (checkpoint|models folder) "):
        export_pipeline(models, ckpt, out)
    assert _tree(ckpt.parent.parent) == before


def test_a_sibling_tmp_folder_of_the_user_survives(exported, tmp_path):
    models, ckpt, _, _ = exported
    (tmp_path / "sd.tmp").mkdir()
    (tmp_path / "sd.tmp/draft.txt").write_text("the user's")
    export_pipeline(models, ckpt, tmp_path / "sd")
    assert (tmp_path / "sd.tmp/draft.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sd", "sd.tmp"]  # no temp folder of ours left


def test_overwrite_replaces_a_previous_export_and_refuses_without_the_flag(exported, tmp_path):
    models, ckpt, _, _ = exported
    out = tmp_path / "sd"
    export_pipeline(models, ckpt, out)
    ema = _tree(out)
    with pytest.raises(InputError, match="holds a previous export; pass --overwrite to replace it"):
        export_pipeline(models, ckpt, out, use_ema=False)
    assert _tree(out) == ema
    metrics = export_pipeline(models, ckpt, out, use_ema=False, overwrite=True)
    assert metrics["weights"] == "live" and json.loads((out / EXPORT_MARKER).read_text())["weights"] == "live"
    live = load_file(ckpt / "unet/diffusion_pytorch_model.safetensors")
    exported_unet = load_file(out / "unet/diffusion_pytorch_model.safetensors")
    assert all(torch.equal(exported_unet[k], live[k]) for k in live)
    assert [p.name for p in tmp_path.iterdir()] == ["sd"]  # the previous export moved aside, then removed


def test_overwrite_refuses_a_previous_export_that_also_holds_a_users_file(exported, tmp_path):
    models, ckpt, _, _ = exported
    out = tmp_path / "sd"
    export_pipeline(models, ckpt, out)
    (out / "README.md").write_text("my notes on this model")
    before = _tree(tmp_path)
    with pytest.raises(InputError, match="also holds README.md, which an export does not write"):
        export_pipeline(models, ckpt, out, overwrite=True)
    assert _tree(tmp_path) == before


def test_a_failure_mid_export_leaves_the_previous_export_and_no_temp_folder(exported, tmp_path, monkeypatch):
    from diffusers import StableDiffusionPipeline

    models, ckpt, _, _ = exported
    out = tmp_path / "sd"
    export_pipeline(models, ckpt, out)
    before = _tree(tmp_path)

    def half_written(self, folder, **kwargs):
        (Path(folder) / "unet").mkdir(parents=True)
        (Path(folder) / "unet/diffusion_pytorch_model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StableDiffusionPipeline, "save_pretrained", half_written)
    with pytest.raises(OSError, match="No space left"):
        export_pipeline(models, ckpt, out, use_ema=False, overwrite=True)
    assert _tree(tmp_path) == before  # the previous export as it was; the temp folder gone


def test_a_failed_rename_puts_the_previous_export_back(exported, tmp_path, monkeypatch):
    models, ckpt, _, _ = exported
    out = tmp_path / "sd"
    export_pipeline(models, ckpt, out)
    before = _tree(tmp_path)
    rename = Path.rename

    def refuse_the_new_one(self, target):
        if self.name.startswith(".sd.export-"):
            raise OSError(30, "Read-only file system")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", refuse_the_new_one)
    with pytest.raises(OSError, match="Read-only"):
        export_pipeline(models, ckpt, out, use_ema=False, overwrite=True)
    assert _tree(tmp_path) == before


def test_leftovers_of_a_killed_export_are_named_and_kept(exported, tmp_path, caplog):
    models, ckpt, _, _ = exported
    (tmp_path / ".sd.export-0badc0de").mkdir()
    (tmp_path / ".sd.export-0badc0de/model_index.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="sdforge.output_dirs"):
        export_pipeline(models, ckpt, tmp_path / "sd")
    assert ".sd.export-0badc0de" in caplog.text and "left by a killed run" in caplog.text
    assert (tmp_path / ".sd.export-0badc0de/model_index.json").read_text() == "{}"
