"""eval_grid: EMA weights, per-category steps/guidance and fixed seeds, grid + per-category strips,
skipped metrics named by their params key, and the stage's MLflow artifacts."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import yaml
from PIL import Image
from pydantic import ValidationError

from sdforge.config import Distill, Eval, load_params
from sdforge.eval import grid
from sdforge.eval.sampling import Pipeline, generate, load_pipeline
from sdforge.io import InputError
from sdforge.tracking import flush_spool
from stages import eval_grid
from tests.fixtures.eval_workspace import REPO, make_workspace, write_distilled_phase, write_params

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
EXTRA = CFG.model_copy(update={"extra_sizes": [(12, 20), (20, 12)], "extra_prompts": 2})
"""The tiny model's pixel multiple is 4 (VAE ×2, one UNet downsample): a portrait and a landscape size."""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("ws"))


@pytest.fixture(scope="module")
def grid_run(workspace, tmp_path_factory):
    models, ckpt = workspace
    out = tmp_path_factory.mktemp("eval") / "phase1"
    demo = load_params(REPO / "params.yaml").demo
    return eval_grid.run(CFG, demo, models, ckpt, out), out


@pytest.fixture(scope="module")
def extra_run(workspace, tmp_path_factory):
    models, ckpt = workspace
    out = tmp_path_factory.mktemp("eval") / "phase1"
    demo = load_params(REPO / "params.yaml").demo
    return eval_grid.run(EXTRA, demo, models, ckpt, out), out


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
    assert metrics["unet_calls_per_image"] == 5.33 and "sampling_steps" not in metrics  # per-category settings


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


def test_a_distilled_phase_samples_every_category_with_its_few_steps_and_no_cfg():
    ordinary = Pipeline(None, None, None, {}, "")
    distilled = Pipeline(None, None, None, {}, "", distill=Distill(sampling_steps=4).model_dump())
    assert [grid.category_settings(distilled, CFG, c) for c in ("shapes", "cats")] == [(4, 1.0), (4, 1.0)]
    assert [grid.category_settings(ordinary, CFG, c) for c in ("shapes", "cats")] == [(3, 3.0), (2, 5.0)]
    figures = {"unet_calls_per_image": 4, "sampling_steps": 4, "guidance_scale": 1}
    assert grid.sampling_figures(distilled, CFG) == figures
    # ordinary: shapes 3 steps × 2 (CFG) for 2 prompts, cats 2 × 2 for 1; no single setting to name
    assert grid.sampling_figures(ordinary, CFG) == {"unet_calls_per_image": round((6 + 6 + 4) / 3, 2)}


def test_the_eval_grid_of_a_distilled_phase_records_its_sampling(workspace, tmp_path):
    models, ckpt = workspace
    write_distilled_phase(ckpt, tmp_path / "lcm")
    demo = load_params(REPO / "params.yaml").demo
    metrics = eval_grid.run(CFG, demo, models, tmp_path / "lcm", tmp_path / "eval")
    assert (metrics["sampling_steps"], metrics["guidance_scale"], metrics["unet_calls_per_image"]) == (4, 1.0, 4)
    pipe = load_pipeline(models, tmp_path / "lcm", device="cpu")
    want_cat = generate(pipe, CATS, steps=4, guidance_scale=1.0, seeds=[1234])[0]  # not the cats' 2 steps, CFG 5
    assert np.array_equal(_png(tmp_path / "eval/images/02.png"), want_cat)


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
    with caplog.at_level(logging.INFO):
        eval_grid.main(["--params", str(params), "--item", "phase1"])
    assert "eval.clip_model_path is null: clip_score skipped" in caplog.text
    assert "eval.fid.inception_path is null: fid skipped" in caplog.text
    metrics = json.loads((tmp_path / "metrics/eval_grid/phase1.json").read_text())
    assert metrics["clip_score"] is None and metrics["images"] == 2
    # params.yaml's extra sizes: the first category's one prompt at 24×40 and 40×24, probed apart
    assert metrics["extra_images"] == 2 and {"colour_agreement_24x40", "shape_agreement_40x24"} <= set(metrics)
    assert Image.open(tmp_path / "eval/phase1/images/00_24x40.png").size == (24, 40)
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.search_runs(
        [client.get_experiment_by_name("sdforge").experiment_id], "attributes.run_name = 'eval_grid'"
    )[0]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "strips")] == [
        "strips/cats.png",
        "strips/shapes.png",
    ]
    assert (tmp_path / "eval/phase1/strips/cats.png").is_file()


def test_a_phase_with_eval_grid_false_records_the_skip_and_samples_nothing(workspace, tmp_path, monkeypatch):
    import mlflow

    models, ckpt = workspace
    monkeypatch.chdir(tmp_path)
    params = write_params(tmp_path, models, ckpt.parent, prompts={"shapes": SHAPES[:1]})
    data = yaml.safe_load(params.read_text())
    data["tracking"]["mlflow_uri"] = uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    data["phases"]["phase1"]["eval_grid"] = False
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "eval/phase1/images").mkdir(parents=True)  # an earlier sampled grid: replaced, not kept stale
    eval_grid.main(["--params", str(params), "--item", "phase1"])
    assert sorted(p.name for p in (tmp_path / "eval/phase1").iterdir()) == ["skipped.json"]
    assert json.loads((tmp_path / "eval/phase1/skipped.json").read_text())["why"] == "phases.phase1.eval_grid is false"
    assert json.loads((tmp_path / "metrics/eval_grid/phase1.json").read_text()) == {"sampled": 0}
    assert flush_spool(load_params(params).tracking) == 1  # a skipped grid's run is spooled, then replayed
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.search_runs(
        [client.get_experiment_by_name("sdforge").experiment_id], "attributes.run_name = 'eval_grid'"
    )[0]
    assert run.data.metrics == {"sampled": 0.0} and client.list_artifacts(run.info.run_id) == []


def test_full_config_categories_and_reference_run_settings():
    cfg = load_params(REPO / "configs/full/params.yaml").eval
    assert list(cfg.prompts) == [
        "forest", "landscape", "city", "vehicle", "portrait", "full_body", "animal", "architecture", "food",
    ]  # fmt: skip
    assert {c: cfg.settings(c) for c in ("forest", "city", "portrait", "full_body")} == {
        "forest": (100, 7.5), "city": (100, 7.5), "portrait": (100, 8.5), "full_body": (100, 8.5),
    }  # fmt: skip
    assert cfg.clip_model_path is None and cfg.fid.inception_path is None
    assert cfg.extra_sizes == [(384, 640), (640, 384)] and all(side % 64 == 0 for s in cfg.extra_sizes for side in s)


def test_probe_without_a_demo_vocabulary_reports_no_agreement():
    """Full scale (demo.enabled: false, no colours or shapes): the probe is skipped, not a ZeroDivisionError
    (found by the full-config preflight, issue 15)."""
    demo = load_params(REPO / "configs/full/params.yaml").demo
    images = [np.zeros((64, 64, 3), np.uint8)] * 2
    result = grid.probe_agreement(images, ["a misty pine forest", "a red sports car"], demo)
    assert result["probe_prompts"] == 0 and result["per_prompt"] == []
    assert result["colour_agreement"] is None and result["colour_chance"] is None and result["shape_chance"] is None


def test_extra_sizes_are_sampled_saved_and_the_square_cells_unchanged(workspace, grid_run, extra_run):
    models, ckpt = workspace
    (square_metrics, square_out), (metrics, out) = grid_run, extra_run
    names = sorted(p.name for p in (out / "images").iterdir())
    assert names == ["00.png", "00_12x20.png", "00_20x12.png", "01.png", "01_12x20.png", "01_20x12.png", "02.png"]
    for name in ("00.png", "01.png", "02.png"):  # same samples as without extra sizes
        assert np.array_equal(_png(out / "images" / name), _png(square_out / "images" / name))
    assert _png(out / "images/00_12x20.png").shape == (20, 12, 3)
    assert _png(out / "images/01_20x12.png").shape == (12, 20, 3)
    ema = load_pipeline(models, ckpt, use_ema=True, device="cpu")
    want = generate(ema, SHAPES[1:], steps=3, guidance_scale=3.0, seeds=[1235], width=12, height=20)[0]
    assert np.array_equal(_png(out / "images/01_12x20.png"), want)  # prompt 1 of "shapes": seed 1235, its settings
    assert metrics["images"] == 3 and metrics["extra_images"] == 4 and square_metrics["extra_images"] == 0
    for key in ("colour_agreement", "shape_agreement", "probe_truth_images", "probe_truth_colour"):
        assert metrics[key] == square_metrics[key]  # the square figures are the square cells' alone


def test_grid_has_a_row_per_extra_size_below_the_square_cells(extra_run):
    _, out = extra_run
    # one scale for all, 8 (16 px square → CELL): 12×20 → 96×160, 20×12 → 160×96; every cell 160×160;
    # 3 square cells in 2 columns (2 rows) + 2 prompts per extra size (1 row each)
    side, caption = 160, grid.CAPTION_H
    grid_png = _png(out / "grid.png")
    assert grid_png.shape == (4 * (side + caption), 2 * side, 3)
    top = 2 * (side + caption)  # the 12×20 row: centred, grey either side
    portrait = np.asarray(Image.fromarray(_png(out / "images/00_12x20.png")).resize((96, 160), Image.NEAREST))
    assert np.array_equal(grid_png[top : top + side, 32:128], portrait)
    assert (grid_png[top : top + side, :32] == grid.PAD_COLOUR).all()
    assert (grid_png[top : top + side, 128:160] == grid.PAD_COLOUR).all()
    top += side + caption  # the 20×12 row: grey above and below
    landscape = np.asarray(Image.fromarray(_png(out / "images/01_20x12.png")).resize((160, 96), Image.NEAREST))
    assert np.array_equal(grid_png[top + 32 : top + 128, side:], landscape)
    assert (grid_png[top : top + 32, side:] == grid.PAD_COLOUR).all()
    square = np.asarray(Image.fromarray(_png(out / "images/00.png")).resize((128, 128), Image.NEAREST))
    assert np.array_equal(grid_png[16:144, 16:144], square)  # square cells: 128 px, centred in 160


def test_extra_sizes_are_probed_apart(extra_run):
    metrics, out = extra_run
    probe_json = json.loads((out / "probe.json").read_text())
    for name in ("12x20", "20x12"):
        assert metrics[f"colour_agreement_{name}"] in (0.0, 0.5, 1.0)  # 2 demo prompts each
        assert metrics[f"shape_agreement_{name}"] in (0.0, 0.5, 1.0)
        assert metrics[f"probe_truth_colour_{name}"] == 1.0 and metrics[f"probe_truth_shape_{name}"] == 1.0
        assert [r["prompt"] for r in probe_json["extra_per_prompt"][name]] == SHAPES
    assert "extra_per_prompt" not in metrics


def test_extra_sizes_without_demo_prompts_report_none():
    demo = load_params(REPO / "params.yaml").demo
    extra = {(12, 20): [np.zeros((20, 12, 3), np.uint8)]}
    got = grid.probe_extra_sizes(extra, CATS, demo)
    assert got["colour_agreement_12x20"] is None and got["shape_agreement_12x20"] is None
    assert got["probe_truth_colour_12x20"] is None


def test_bad_extra_size_is_one_clear_error_before_sampling(workspace, tmp_path, monkeypatch):
    models, ckpt = workspace

    def no_sampling(*args, **kwargs):
        raise AssertionError("sampled before the sizes were checked")

    monkeypatch.setattr(grid, "generate", no_sampling)
    cfg = CFG.model_copy(update={"extra_sizes": [(12, 20), (12, 18), (10, 16)]})
    demo = load_params(REPO / "params.yaml").demo
    with pytest.raises(InputError) as err:
        eval_grid.run(cfg, demo, models, ckpt, tmp_path / "phase1")
    assert str(err.value) == (
        "eval.extra_sizes: 12x18, 10x16: width and height must be multiples of 4 px for this model "
        "(its VAE × UNet downsampling); e.g. 12x20"
    )
    assert not (tmp_path / "phase1").exists()


def test_extra_sizes_config():
    assert Eval(prompts=["a"]).extra_sizes == [] and Eval(prompts=["a"]).extra_prompts == 4
    with pytest.raises(ValidationError, match="extra_sizes"):
        Eval(prompts=["a"], extra_sizes=[(0, 16)])
    with pytest.raises(ValidationError, match=r"sizes listed twice: \['16x24'\]"):
        Eval(prompts=["a"], extra_sizes=[(16, 24), (24, 16), (16, 24)])
    demo_cfg = load_params(REPO / "params.yaml").eval
    assert demo_cfg.extra_sizes == [(24, 40), (40, 24)] and demo_cfg.extra_prompts == 4
    assert grid.extra_prompts(demo_cfg) == ("seen", demo_cfg.prompts["seen"][:4])
