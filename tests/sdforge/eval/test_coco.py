"""The COCO protocol: which captions and images it takes, the reference crop, and FID / CLIP score equal to the
stated computation redone by hand on the same images; the CLI and the phase-end option."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from sdforge.config import ConfigError, load_params
from sdforge.eval.coco import reference_image, run_protocol, select_prompts
from sdforge.eval.metrics import clip_scores, frechet_distance, inception_features
from sdforge.eval.sampling import generate, load_pipeline
from sdforge.io import InputError
from tests.fixtures.eval_workspace import (
    make_workspace,
    tiny_clip_parts,
    write_channel_means,
    write_coco_val,
    write_params,
)

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200), (200, 30, 200)]
SIZES = [(40, 20), (20, 40), (16, 16), (64, 48), (24, 24), (30, 50)]


@pytest.fixture(scope="module")
def coco_params(tmp_path_factory):
    """The tiny eval workspace with a 6-image COCO val, a tiny CLIP and a channel-means Inception."""
    root = tmp_path_factory.mktemp("coco")
    models, ckpt = make_workspace(root)
    captions = write_coco_val(root / "coco", [(w, h, c) for (w, h), c in zip(SIZES, COLOURS, strict=True)])
    model, processor = tiny_clip_parts(root / "clip")
    model.save_pretrained(root / "clip" / "model")
    processor.save_pretrained(root / "clip" / "model")
    inception = write_channel_means(root / "inception.pt")
    coco = {"captions": str(captions), "images": str(root / "coco" / "val2014"), "samples": 6, "seed": 7}
    params = write_params(root, models, ckpt.parent, clip_model_path=str(root / "clip" / "model"),
                          fid={"inception_path": str(inception)}, coco=coco)  # fmt: skip
    return params


def test_prompts_are_seeded_one_caption_each_and_a_prefix_of_a_larger_draw(tmp_path):
    captions = write_coco_val(tmp_path, [(8, 8, (0, 0, 0))] * 10, captions=3)
    data = json.loads(captions.read_text())
    data["images"] += [{"id": 99, "file_name": "../escape.jpg"}, {"id": 98, "file_name": "no_caption.jpg"}]
    data["annotations"].append({"id": 9900, "image_id": 99, "caption": "a red square"})
    captions.write_text(json.dumps(data))
    ten, four = select_prompts(captions, 10, seed=3), select_prompts(captions, 4, seed=3)
    assert four == ten[:4] and select_prompts(captions, 10, seed=3) == ten
    assert sorted(p.image_id for p in ten) == list(range(1, 11))  # not 98 (no caption) nor 99 (unsafe name)
    assert [p.image_id for p in select_prompts(captions, 10, seed=4)] != [p.image_id for p in ten]
    by_image = {}
    for ann in data["annotations"]:
        by_image.setdefault(ann["image_id"], []).append(ann["caption"])
    assert all(p.caption in by_image[p.image_id] for p in ten)
    assert len({p.caption for p in ten}) > 1 and all(p.file_name.endswith(f"{p.image_id:012d}.jpg") for p in ten)
    assert len(select_prompts(captions, 50, seed=3)) == 10  # fewer usable images than asked: all of them


def test_reference_images_are_centre_cropped_then_resized_bicubic(tmp_path):
    img = np.zeros((20, 40, 3), np.uint8)
    img[:, :10], img[:, 10:30], img[:, 30:] = (255, 0, 0), (0, 255, 0), (0, 0, 255)
    Image.fromarray(img).save(tmp_path / "x.png")
    out = reference_image(tmp_path / "x.png", 8)
    assert out.shape == (8, 8, 3) and (out == (0, 255, 0)).all()  # only the centre 20×20 (green) is kept


def test_fid_and_clip_score_are_the_stated_computation_on_the_same_images(coco_params, tmp_path):
    params = load_params(coco_params)
    ckpt = params.paths.checkpoints + "/phase1"
    metrics = run_protocol(params, ckpt, 6, tmp_path / "out", device="cpu")
    prompts = select_prompts(params.eval.coco.captions, 6, 7)
    pipe = load_pipeline(Path(params.paths.models), Path(ckpt), device="cpu")
    images = generate(pipe, [p.caption for p in prompts], steps=3, guidance_scale=3.0, seeds=[7 + i for i in range(6)])
    model = torch.jit.load(params.eval.fid.inception_path)
    refs = [reference_image(f"{params.eval.coco.images}/{p.file_name}", 16) for p in prompts]
    fid = frechet_distance(inception_features(model, images), inception_features(model, refs))
    clip = float(np.mean(clip_scores(images, [p.caption for p in prompts], params.eval.clip_model_path)))
    assert metrics["coco_fid"] == pytest.approx(fid, abs=1e-4) and metrics["coco_fid"] > 0
    assert metrics["coco_clip_score"] == pytest.approx(clip, abs=1e-4)
    assert (metrics["coco_samples"], metrics["coco_reference_images"], metrics["coco_reference_skipped"]) == (6, 6, 0)
    assert (metrics["coco_steps"], metrics["coco_guidance_scale"], metrics["coco_image_size"]) == (3, 3.0, 16)
    record = json.loads((tmp_path / "out" / "coco.json").read_text())
    assert record["metrics"] == metrics and record["protocol"]["seed"] == 7
    assert [p["image_id"] for p in record["first_prompts"]] == [p.image_id for p in prompts]
    assert Image.open(tmp_path / "out" / "coco_preview.png").size[0] > 0


def test_a_missing_reference_image_is_skipped_and_counted(coco_params, tmp_path):
    params = load_params(coco_params)
    prompts = select_prompts(params.eval.coco.captions, 6, 7)
    images_dir = tmp_path / "val2014"
    images_dir.mkdir()
    for p in prompts[1:]:
        (images_dir / p.file_name).write_bytes((Path(params.eval.coco.images) / p.file_name).read_bytes())
    data = yaml.safe_load(coco_params.read_text())
    data["eval"]["coco"]["images"] = str(images_dir)
    moved = tmp_path / "params.yaml"
    moved.write_text(yaml.safe_dump(data))
    metrics = run_protocol(load_params(moved), params.paths.checkpoints + "/phase1", 6, tmp_path / "out", "cpu")
    assert (metrics["coco_reference_images"], metrics["coco_reference_skipped"]) == (5, 1)


def test_the_protocol_without_files_or_with_phase_end_samples_but_no_files_is_refused(coco_params, tmp_path):
    data = yaml.safe_load(coco_params.read_text())
    data["eval"]["coco"].update(captions=None)
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(InputError, match="eval.coco.captions"):
        run_protocol(load_params(tmp_path / "a.yaml"), tmp_path, 2, tmp_path / "out")
    data["eval"]["coco"].update(phase_end_samples=5000)
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="phase_end_samples"):
        load_params(tmp_path / "b.yaml")


def test_sdforge_evaluate_writes_under_paths_evaluations(coco_params, tmp_path, monkeypatch, capsys):
    from tools import cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        cli.main(["evaluate", "--protocol", "coco", "--phase", "phase1", "--samples", "4", "--device", "cpu",
                  "--params", str(coco_params)])  # fmt: skip
    assert done.value.code == 0
    record = json.loads((tmp_path / "evaluations/phase1/coco-4/coco.json").read_text())
    assert record["metrics"]["coco_samples"] == 4 and record["metrics"]["coco_fid"] > 0
    assert capsys.readouterr().out.strip().endswith("evaluations/phase1/coco-4/coco.json")


def test_phase_end_samples_add_the_protocol_to_the_eval_grid_stage(coco_params, tmp_path, monkeypatch):
    from stages import eval_grid

    data = yaml.safe_load(coco_params.read_text())
    data["eval"]["coco"]["phase_end_samples"] = 3
    data["eval"]["prompts"] = {"shapes": ["a red square on a white background"]}
    data["eval"]["extra_sizes"] = []
    data["paths"].update(eval=str(tmp_path / "eval"), metrics=str(tmp_path / "metrics"))
    data["tracking"]["mlflow_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    eval_grid.main(["--params", str(params), "--item", "phase1"])
    metrics = json.loads((tmp_path / "metrics/eval_grid/phase1.json").read_text())
    assert metrics["coco_samples"] == 3 and metrics["coco_fid"] > 0 and metrics["coco_clip_score"] is not None
    assert metrics["clip_score"] is not None  # the grid's own CLIP score uses the same scorer
    assert json.loads((tmp_path / "eval/phase1/coco/coco.json").read_text())["metrics"]["coco_samples"] == 3


def test_a_controlnet_phase_end_runs_no_coco_protocol_and_the_forecast_does_not_count_it(caplog):
    from types import SimpleNamespace

    from sdforge.eval.coco import phase_end_samples
    from sdforge.preflight.forecast import coco_phases

    phases = {"phase7": SimpleNamespace(controlnet=None, init_from="phase6"),
              "phase8_canny": SimpleNamespace(controlnet={"condition": "canny"}, init_from="phase7")}  # fmt: skip
    params = SimpleNamespace(phases=phases, eval=SimpleNamespace(coco=SimpleNamespace(phase_end_samples=5000)))
    with caplog.at_level("INFO", logger="sdforge.eval.coco"):
        assert phase_end_samples(params, "phase7") == 5000 and phase_end_samples(params, "phase8_canny") == 0
    assert "COCO protocol skipped for phase8_canny: a ControlNet phase" in caplog.text and "phase7's" in caplog.text
    full = {"phases": {"phase7": {}, "phase8_canny": {"controlnet": {"condition": "canny"}},
                       "phase9": {"eval_grid": False}}}  # fmt: skip
    assert coco_phases(full) == 1
