"""End to end: the real DAG (`dvc repro`) on a shrunken demo in a temp project.

Asserts concrete outputs of every stage, that a second `dvc repro` runs nothing, and that
changing one phase's LR reruns only that phase's train/eval (and later phases').
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from PIL import Image
from safetensors import safe_open

from tools.tiny_demo import free_port, shrink

REPO = Path(__file__).resolve().parents[1]
COPY = ["stages", "sdforge", "model", "dvc.yaml", "params.yaml", "pyproject.toml"]


def _env() -> dict:
    env = dict(os.environ)
    env.update(NO_ALBUMENTATIONS_UPDATE="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", DVC_NO_ANALYTICS="1",
               SDFORGE_PROGRESS="0", PYTHONPATH=str(REPO))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def dvc(project: Path, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, env=_env(), capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def ran_stages(output: str) -> list[str]:
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("e2e")
    for name in COPY:
        src = REPO / name
        shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir() \
            else shutil.copy(src, root / name)
    params = shrink(yaml.safe_load((REPO / "params.yaml").read_text()), free_port())
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    dvc(root, "init", "-q")
    first = dvc(root, "repro")
    (root / "first_run.log").write_text(first)
    return root


def metrics(project: Path, stage: str, item: str | None = None) -> dict:
    path = project / "metrics" / stage / f"{item}.json" if item else project / "metrics" / f"{stage}.json"
    return json.loads(path.read_text())


def test_every_stage_ran_once(project):
    ran = ran_stages((project / "first_run.log").read_text())
    # demo, 3 data stages × 3 sources, models, captions×3 (no recaption: nothing to caption), encode×3, conditions×3
    # (no conditions.kinds: nothing to make), 3×2 phases, report
    assert len(ran) == len(set(ran)) == 1 + 3 * 3 + 1 + 3 + 3 + 3 + 3 * 2 + 1
    assert ran.index("train@phase1") < ran.index("train@phase2")
    assert ran[-1] == "report"


def test_filter_drops_exactly_the_injected_bad_rows(project):
    params = yaml.safe_load((project / "params.yaml").read_text())["demo"]
    m = metrics(project, "filter_metadata", "laion")
    bad = sum(params[k] for k in ("low_aesthetic_rows", "watermark_rows", "nsfw_rows", "small_rows",
                                  "duplicate_rows"))
    assert m["rows_in"] == params["laion_rows"] + bad + params["missing_rows"]
    assert m["rows_out"] == params["laion_rows"] + params["missing_rows"]
    rows = pl.read_parquet(project / "data/filtered/laion/filtered.parquet")
    assert rows.height == m["rows_out"]


def test_fetch_shards_and_samples(project):
    params = yaml.safe_load((project / "params.yaml").read_text())
    m = metrics(project, "fetch_images", "laion")
    assert m["successes"] == params["demo"]["laion_rows"]
    assert m["failed_to_download"] == params["demo"]["missing_rows"]
    assert len(list((project / "data/shards/laion").glob("*.tar"))) == m["shards"] >= 1
    assert metrics(project, "fetch_images", "diffusiondb")["successes"] == params["demo"]["archive_images"]


def test_latents_per_resolution_and_bucket(project):
    params = yaml.safe_load((project / "params.yaml").read_text())
    m = metrics(project, "encode_latents", "laion")
    rows = params["demo"]["laion_rows"]
    assert m["px24.samples"] == m["px32.samples"] == m["samples"] == rows
    # the demo's 48×48, 48×32 and 32×48 canvases, fetched with the shorter side at 32 px, land in one bucket each
    assert set(m["px32.buckets"]) == {"24x40", "32x32", "40x24"} and sum(m["px32.buckets"].values()) == rows
    assert set(m["px24.buckets"]) == {"20x28", "24x24", "28x20"}
    assert m["px24.buckets"]["24x24"] == m["px32.buckets"]["32x32"]
    manifest = pl.read_parquet(project / "data/latents/laion/px32/manifest.parquet")
    assert manifest.height == rows and manifest["key"].n_unique() == rows
    wide = manifest.filter(pl.col("bucket_width") == 40)
    assert set(zip(wide["width"], wide["height"], strict=True)) == {(48, 32)}  # fetched keep_ratio: aspect kept
    assert set(wide["resized_height"]) == {27} and set(wide["crop_top"]) == {1} and set(wide["crop_bottom"]) == {25}
    for path in sorted((project / "data/latents/laion/px32").glob("shard-*.safetensors")):
        width, height = (int(v) for v in path.stem.split("-")[-1].split("x"))
        with safe_open(str(path), framework="pt") as f:
            lat, ids = f.get_tensor("latents"), f.get_tensor("input_ids")
        assert str(lat.dtype) == "torch.float16" and tuple(lat.shape[1:]) == (4, height // 2, width // 2)
        assert tuple(ids.shape[1:]) == (params["models"]["text_encoder_build"]["max_position_embeddings"],) == (16,)


def test_mix_composition(project):
    m = metrics(project, "mix_phase", "phase2")
    assert m["samples"] == 48 and m["samples.laion"] == 24 and m["samples.concept"] == 24
    assert (m["held_out"], m["held_out.laion"], m["held_out.concept"]) == (8, 4, 4)  # tiny demo: train.held_out 4
    held_out = pl.read_parquet(project / "data/mixes/phase2.held_out.parquet")
    index = pl.read_parquet(project / "data/mixes/phase2.parquet")
    pairs = {(s, k) for s, k in index.select("source", "key").iter_rows()}
    assert held_out.height == 8 and not {(s, k) for s, k in held_out.select("source", "key").iter_rows()} & pairs
    concept = yaml.safe_load((project / "params.yaml").read_text())["demo"]["concept"]
    assert metrics(project, "fetch_images", "concept")["successes"] == concept["images"]


def test_the_adapter_phase_trains_a_lora_on_the_low_resolution_phase(project):
    m = metrics(project, "train", "phase2")
    assert m["resolution"] == "px32" and 0 < m["trainable_params"] < 0.05 * m["unet_params"]
    state = json.loads((project / "checkpoints/phase2/state.json").read_text())
    assert state["adapter"]["type"] == "lora" and state["adapter"]["merge"] is True
    for sub in ("adapter", "adapter_ema"):
        assert (project / "checkpoints/phase2" / sub / "pytorch_lora_weights.safetensors").stat().st_size > 0
    from safetensors.torch import load_file

    words = load_file(project / "checkpoints/phase2/adapter_ema/learned_embeds.safetensors")  # the demo's new word
    assert state["adapter"]["words"] == list(words) == ["orange"]
    concept = metrics(project, "eval_grid", "phase2")
    assert concept["probe_prompts_concept"] == 2 and concept["colour_agreement_concept"] is not None


def test_checkpoint_keys_and_steps(project):
    from safetensors.torch import load_file

    m = metrics(project, "train", "phase1")
    assert m["resolution"] == "px24" and metrics(project, "train", "phase2")["resolution"] == "px32"
    trained = sum(v for k, v in m.items() if k.startswith("bucket.") and k.endswith(".samples"))
    assert m["steps"] == m["total_steps"] == trained // 16 and trained % 16 == 0  # full one-bucket batches only
    assert {k.split(".")[1] for k in m if k.startswith("bucket.")} == {"20x28", "24x24", "28x20"}
    live = load_file(project / "checkpoints/phase1/unet/diffusion_pytorch_model.safetensors")
    ema = load_file(project / "checkpoints/phase1/unet_ema/diffusion_pytorch_model.safetensors")
    assert live.keys() == ema.keys() and "conv_out.weight" in live
    assert any(not (live[k] == ema[k]).all() for k in live)  # EMA differs from live weights
    state = json.loads((project / "checkpoints/phase1/state.json").read_text())
    assert state["phase"] == "phase1" and state["step"] == m["steps"]


def test_eval_grid_image(project):
    m = metrics(project, "eval_grid", "phase2")
    assert m["images"] == 6 and m["image_size"] == 32 and m["extra_images"] == 2 * 2  # 2 prompts × 24x40, 40x24
    grid = Image.open(project / "eval/phase2/grid.png")
    # 3 square rows + one row per extra size; one scale (32 px → 128), cells padded to the largest (40 px → 160)
    assert grid.size == (2 * 160, 5 * (160 + 28))
    assert Image.open(project / "eval/phase2/images/00_24x40.png").size == (24, 40)
    assert 0 <= m["colour_agreement"] <= 1 and m["colour_chance"] == round(1 / 6, 4)  # 5 colours + the concept


def test_mlflow_has_phase_run_with_grid(project):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sdforge")
    runs = client.search_runs([exp.experiment_id], "tags.`sdforge.stage` = 'eval_grid'")
    parents = {client.get_run(r.data.tags["mlflow.parentRunId"]).info.run_name for r in runs}
    assert parents == {"phase1", "phase2"}
    grid_run = next(r for r in runs if client.get_run(r.data.tags["mlflow.parentRunId"]).info.run_name == "phase2")
    assert "grid.png" in [a.path for a in client.list_artifacts(grid_run.info.run_id)]
    every = client.search_runs([exp.experiment_id], "tags.`sdforge.stage` != ''", max_results=1000)
    stages = {r.data.tags["sdforge.stage"].split("@")[0] for r in every}
    assert stages == {"make_demo_data", "download_metadata", "filter_metadata", "fetch_images", "prepare_models",
                      "caption_images", "encode_latents", "condition_images", "mix_phase", "train", "eval_grid",
                      "report"}
    train_runs = client.search_runs([exp.experiment_id], "tags.`sdforge.stage` = 'train'")
    assert {len(client.get_metric_history(r.info.run_id, "loss")) > 0 for r in train_runs} == {True}


def test_phase_parent_run_summarises_its_stages(project):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sdforge")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    (parent,) = client.search_runs([exp.experiment_id], "tags.`sdforge.parent` = 'phase2'")
    train, ev, mix = (metrics(project, s, "phase2") for s in ("train", "eval_grid", "mix_phase"))
    got = parent.data.metrics
    assert got["train.final_loss"] == train["final_loss"] and got["train.steps"] == train["steps"]
    assert got["train.mean_loss"] == train["mean_loss"] and got["mix_phase.samples"] == mix["samples"]
    assert got["train.final_val_loss"] == train["final_val_loss"] and train["val_loss_samples"] == 8
    assert got["eval_grid.shape_agreement_seen"] == ev["shape_agreement_seen"]
    assert parent.data.params["phase.init_from"] == "phase1" and "phase.lr" in parent.data.params
    note = parent.data.tags["mlflow.note.content"]
    assert note.index("**Data**") < note.index("**Training**") < note.index("**Weights**") < note.index("**Eval**")
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"grid.png", "strips"}
    curve = (project / "metrics/train_loss/phase2.csv").read_text().splitlines()
    assert curve[0] == "step,loss,lr,val_loss" and len(curve) == 1 + train["steps"]
    measured = [int(line.split(",")[0]) for line in curve[1:] if line.split(",")[3]]  # val_loss_every 2 + the end
    assert measured == sorted({*range(2, train["steps"] + 1, 2), train["steps"]})
    (data,) = client.search_runs([exp.experiment_id], "tags.`sdforge.parent` = 'data'")
    filtered = metrics(project, "filter_metadata", "laion")
    assert data.data.metrics["filter_metadata.laion.rows_out"] == filtered["rows_out"]
    assert "fetch `laion`" in data.data.tags["mlflow.note.content"]


def test_report_compares_the_phases_and_is_logged(project):
    page = (project / "eval/report.html").read_text()
    phases = page.split('<table id="phases">')[1].split("</table>")[0]
    rows = [r for r in phases.split("<tr>")[2:]]
    assert [r.split("</td>")[0].removeprefix("<td>") for r in rows] == ["phase1", "phase2"]
    # the loss chart + one strip per eval category (seen, held_out, concept)
    assert page.count("data:image/png;base64,") == 1 + 3
    assert metrics(project, "report") == {"phases": 2, "phases_reported": 2, "images": 4, "bytes": len(page.encode())}
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sdforge")
    (report,) = client.search_runs([exp.experiment_id], "tags.`sdforge.parent` = 'report'")
    assert {a.path for a in client.list_artifacts(report.info.run_id)} == {"report.html", "loss.png", "strips"}
    assert report.data.metrics["report.phase2.final_loss"] == metrics(project, "train", "phase2")["final_loss"]
    val = metrics(project, "train", "phase2")["final_val_loss"]
    assert "<th>val loss</th>" in page and report.data.metrics["report.phase2.final_val_loss"] == val
    first = metrics(project, "train", "phase1")  # post-hoc EMA: a snapshot per step (< 8), 6 candidates + the fixed
    scores = [k for k in first if k.startswith("posthoc_ema.val_loss.")]
    assert first["posthoc_ema.snapshots"] == min(8, first["steps"]) and len(scores) == 7
    assert first["posthoc_ema.missing_snapshots"] == 0
    table = page.split('<table id="posthoc">')[1].split("</table>")[0]
    assert table.count("<tr>") == 2 and "<td>phase1</td>" in table and table.count("<b>") == 1


def test_mlflow_ui_pages_in_a_browser(project, tmp_path):
    """The pages a user opens, in headless Chromium over ``mlflow server``: runs table, phase run, grid, report."""
    if not Path("/usr/bin/chromium").exists():
        if os.environ.get("SDFORGE_REQUIRE_BROWSER") == "1":
            pytest.fail("SDFORGE_REQUIRE_BROWSER=1 but /usr/bin/chromium is missing (apt-get install chromium)")
        pytest.skip("no /usr/bin/chromium (apt-get install chromium; .ci/run installs it)")
    proc = subprocess.run([sys.executable, "-m", "tools.browser_check", "--out", str(tmp_path)], cwd=project,
                          env=_env(), capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert len([line for line in lines if line.startswith("PASS ")]) == 7 and not any("FAIL" in x for x in lines)
    shots = sorted(p.name for p in tmp_path.glob("*.png"))
    assert shots == ["1-experiment.png", "2-phase-run.png", "3-grid-artifact.png", "4-report.png"]
    assert all(Image.open(tmp_path / s).size[0] == 1600 for s in shots)


def test_second_repro_runs_nothing_and_an_lr_change_reruns_that_phase_and_later(project):
    again = dvc(project, "repro")
    assert ran_stages(again) == []
    # what an LR change reruns, without rerunning it (issue 40: the suite's time; ~60 s saved): --dry lists the
    # stages whose own inputs changed, --force-downstream adds their descendants in the DAG (DVC's graph, as a
    # real repro would reach them through the checkpoint they read). The reruns themselves: tests/stages.
    params_file = project / "params.yaml"
    kept = params_file.read_text()
    params = yaml.safe_load(kept)
    params["phases"]["phase1"]["lr"] = params["phases"]["phase1"]["lr"] / 2
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        changed = dvc(project, "repro", "--dry", "--force-downstream")
    finally:
        params_file.write_text(kept)
    # mix_phase depends on the whole phase (its controlnet decides the conditions record): it reruns, cheaply, and
    # writes equal files
    assert sorted(ran_stages(changed)) == [
        "eval_grid@phase1", "eval_grid@phase2", "mix_phase@phase1", "report", "train@phase1", "train@phase2"
    ]
    assert ran_stages(dvc(project, "repro", "--dry")) == []  # the dry run changed nothing
