"""eval_grid: EMA weights, per-category steps/guidance and fixed seeds, grid + per-category strips,
skipped metrics named by their params key, and the stage's MLflow artifacts."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from PIL import Image

from sdforge.config import Eval, load_params
from sdforge.eval import grid
from sdforge.eval.sampling import generate, load_pipeline
from stages import eval_grid
from tests.fixtures.eval_workspace import REPO, make_workspace, write_params

SHAPES = ["a red circle on a white background", "a blue square on a black background"]
CATS = ["a cat photo"]
CFG = Eval(
    prompts={"shapes": SHAPES, "cats": CATS},
    steps=3,
    guidance_scale=3.0,
    sampling={"cats": {"steps": 2, "guidance_scale": 5.0}},
    seed=1234,
    columns=2,
    batch_size=4,
)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("ws"))


@pytest.fixture(scope="module")
def grid_run(workspace, tmp_path_factory):
    models, ckpt = workspace
    out = tmp_path_factory.mktemp("eval") / "phase1"
    demo = load_params(REPO / "params.yaml").demo
    return eval_grid.run(CFG, demo, models, ckpt, out), out


def _png(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def test_grid_samples_ema_weights_with_each_categorys_settings(workspace, grid_run):
    models, ckpt = workspace
    metrics, out = grid_run
    ema = load_pipeline(models, ckpt, use_ema=True, device="cpu")
    live = load_pipeline(models, ckpt, use_ema=False, device="cpu")
    want_shape = generate(ema, SHAPES[1:], steps=3, guidance_scale=3.0, seeds=[1235])[0]
    want_cat = generate(ema, CATS, steps=2, guidance_scale=5.0, seeds=[1234])[0]  # seed restarts per category
    live_shape = generate(live, SHAPES[1:], steps=3, guidance_scale=3.0, seeds=[1235])[0]
    assert np.array_equal(_png(out / "images/01.png"), want_shape)
    assert np.array_equal(_png(out / "images/02.png"), want_cat)
    assert np.abs(want_shape.astype(int) - live_shape).mean() > 5  # EMA ≠ live, and the grid shows EMA
    assert metrics["images"] == 3 and metrics["categories"] == 2 and metrics["image_size"] == 16
    assert metrics["checkpoint_hash"] == ema.checkpoint_hash != live.checkpoint_hash


def test_grid_and_one_strip_per_category(grid_run):
    _, out = grid_run
    cell, caption = grid.CELL, grid.CAPTION_H
    assert Image.open(out / "grid.png").size == (2 * cell, 2 * (cell + caption))  # 3 images in 2 columns
    assert Image.open(out / "strips/shapes.png").size == (2 * cell, cell + caption)
    assert Image.open(out / "strips/cats.png").size == (cell, cell + caption)
    strip = _png(out / "strips/shapes.png")
    first = Image.fromarray(_png(out / "images/00.png")).resize((cell, cell), Image.NEAREST)
    assert np.array_equal(strip[:cell, :cell], np.asarray(first))


def test_missing_weights_are_skipped_naming_the_params_key(grid_run):
    metrics, _ = grid_run
    assert metrics["clip_score"] is None and metrics["fid"] is None
    assert metrics["clip_score_skipped"] == "eval.clip_model_path is null: clip_score skipped"
    assert metrics["fid_skipped"] == "eval.fid.inception_path is null: fid skipped"


def test_categories_config():
    flat = Eval(prompts=["a", "b"])
    assert flat.prompts == {"all": ["a", "b"]} and flat.all_prompts == ["a", "b"]
    assert CFG.settings("cats") == (2, 5.0) and CFG.settings("shapes") == (3, 3.0)
    with pytest.raises(ValueError, match=r"sampling: unknown categor\(ies\) \['dogs'\]"):
        Eval(prompts={"cats": ["x"]}, sampling={"dogs": {"steps": 2}})
    with pytest.raises(ValueError, match="categories without prompts: \\['cats'\\]"):
        Eval(prompts={"cats": []})


def test_guidance_above_9_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="sdforge.config"):
        Eval(
            prompts={"portrait": ["x"], "city": ["y"]},
            guidance_scale=7.5,
            sampling={"portrait": {"guidance_scale": 11}},
        )
    assert "category 'portrait' samples with guidance_scale 11.0 > 9" in caplog.text
    assert "'city'" not in caplog.text


def test_stage_succeeds_without_weights_and_logs_strips(workspace, tmp_path, monkeypatch, caplog):
    import mlflow

    models, ckpt = workspace
    monkeypatch.chdir(tmp_path)
    params = write_params(tmp_path, models, ckpt.parent, prompts={"shapes": SHAPES[:1], "cats": CATS})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params.write_text(params.read_text().replace("sqlite:///mlflow.db", uri))
    with caplog.at_level(logging.WARNING):
        eval_grid.main(["--params", str(params), "--item", "phase1"])
    assert "eval.clip_model_path is null: clip_score skipped" in caplog.text
    assert "eval.fid.inception_path is null: fid skipped" in caplog.text
    metrics = json.loads((tmp_path / "metrics/eval_grid/phase1.json").read_text())
    assert metrics["clip_score"] is None and metrics["images"] == 2
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.search_runs(
        [client.get_experiment_by_name("sdforge").experiment_id], "attributes.run_name = 'eval_grid'"
    )[0]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "strips")] == [
        "strips/cats.png",
        "strips/shapes.png",
    ]
    assert (tmp_path / "eval/phase1/strips/cats.png").is_file()


def test_full_config_categories_and_reference_run_settings():
    cfg = load_params(REPO / "configs/full/params.yaml").eval
    assert list(cfg.prompts) == [
        "forest", "landscape", "city", "vehicle", "portrait", "full_body", "animal", "architecture", "food",
    ]  # fmt: skip
    assert {c: cfg.settings(c) for c in ("forest", "city", "portrait", "full_body")} == {
        "forest": (100, 7.5), "city": (100, 7.5), "portrait": (100, 8.5), "full_body": (100, 8.5),
    }  # fmt: skip
    assert cfg.clip_model_path is None and cfg.fid.inception_path is None


def test_probe_without_a_demo_vocabulary_reports_no_agreement():
    """Full scale (demo.enabled: false, no colours or shapes): the probe is skipped, not a ZeroDivisionError
    (found by the full-config preflight, issue 15)."""
    demo = load_params(REPO / "configs/full/params.yaml").demo
    images = [np.zeros((64, 64, 3), np.uint8)] * 2
    result = grid.probe_agreement(images, ["a misty pine forest", "a red sports car"], demo)
    assert result["probe_prompts"] == 0 and result["per_prompt"] == []
    assert result["colour_agreement"] is None and result["colour_chance"] is None and result["shape_chance"] is None
