"""The preflight's params derivation and forecast arithmetic (fast; the full run is tests/tools/test_preflight.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from sdforge.config import load_params
from sdforge.latents.mix import split_counts
from sdforge.preflight.derive import LOOPBACK, SAMPLES_DIR, Shrink, derive_params, first_prompts, samples_needed
from sdforge.preflight.forecast import (
    Pod,
    StageRun,
    forecast,
    full_images,
    full_optimizer_steps,
    full_train_samples,
    full_val_loss_forwards,
    posthoc_ema_cost,
    table,
)

REPO = Path(__file__).resolve().parents[2]
FULL = yaml.safe_load((REPO / "configs/full/params.yaml").read_text())
KEPT_PHASE_KEYS = ("init_from", "mix", "lr", "warmup_steps", "cfg_dropout", "min_snr_gamma", "with_replacement")


def derived(**shrink) -> dict:
    return derive_params(FULL, Shrink(**shrink), REPO)


def test_derived_params_load_and_keep_the_full_configuration(tmp_path):
    before = copy.deepcopy(FULL)
    params = derived()
    assert FULL == before, "the given params must not be modified"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    typed = load_params(tmp_path / "params.yaml")
    assert typed.models.unet.model_dump() == load_params(REPO / "configs/full/params.yaml").models.unet.model_dump()
    assert params["models"]["noise"] == FULL["models"]["noise"]
    assert params["models"]["missing_weights"] == "random"
    assert list(params["phases"]) == list(FULL["phases"]) == [f"phase{i}" for i in range(0, 8)]
    for name, phase in params["phases"].items():
        assert {k: phase[k] for k in KEPT_PHASE_KEYS} == {k: FULL["phases"][name][k] for k in KEPT_PHASE_KEYS}
    for key in ("mixed_precision", "activation_checkpointing", "channels_last", "ema_decay", "adam_betas", "grad_clip"):
        assert params["train"][key] == FULL["train"][key]
    assert params["encode"] == FULL["encode"]


def test_sources_read_local_samples_in_their_own_kind():
    params = derived(cpus=2)
    assert list(params["sources"]) == list(FULL["sources"])
    for name, source in params["sources"].items():
        full = FULL["sources"][name]
        assert source["repo"] == f"{SAMPLES_DIR}/{name}"
        assert (source["kind"], source.get("filter"), source["allow_patterns"]) == (
            full["kind"], full.get("filter"), full["allow_patterns"]
        )
        assert source["fetch"]["image_size"] == full["fetch"]["image_size"] == 512
        assert source["fetch"].get("processes", 1) <= 2
    assert LOOPBACK in params["sources"]["laion"]["fetch"]["allow_networks"]


@pytest.mark.parametrize(("device", "batch", "accum"), [("cpu", 1, 1), ("cuda", 24, 2)])
def test_every_phase_runs_exactly_the_asked_steps(device, batch, accum):
    params = derived(steps=2, device=device)
    for name, phase in params["phases"].items():
        assert (phase["grad_accum"], phase["epochs"]) == (accum, 1)
        assert phase["samples"] == 2 * phase["batch_size"] * accum
        assert min(split_counts(phase["mix"], phase["samples"]).values()) >= 1, name
    # CPU: batch 1 except where a mix needs more samples for every source to get one
    expected = {"phase6": 2, "phase7": 3} if device == "cpu" else {}
    assert {n: p["batch_size"] for n, p in params["phases"].items()} == {
        n: expected.get(n, batch) for n in params["phases"]
    }
    assert params["train"]["nproc_per_node"] == 1 and params["train"]["checkpoint_s3"] is None
    assert params["train"].get("hang_timeout_s") == (3600.0 if device == "cpu" else None)  # full config: null


def test_eval_keeps_one_prompt_per_category_and_two_steps():
    params = derived()
    prompts = params["eval"]["prompts"]
    assert list(prompts) == list(FULL["eval"]["prompts"]) and len(prompts) == 9
    assert all(len(p) == 1 and p[0] == FULL["eval"]["prompts"][c][0] for c, p in prompts.items())
    assert params["eval"]["steps"] == 2
    assert first_prompts(["a", "b"]) == ["a"]


def test_samples_needed_covers_every_phase_draw():
    params = derived(steps=2, batch_size=4)  # 8 samples per phase (12 for phase7), 2 held out of each source
    need = samples_needed(params)
    assert params["train"]["held_out"] == 2 and params["train"]["val_loss_every"] == 0
    assert params["train"]["posthoc_sigma_rels"] == []  # forecast only: no room for two more UNets on a CPU
    assert need["laion"] == 10 and need["laion_hq"] == 10  # phase1: 1.0 of 8; phase2: 1.0 of 8; + 2
    assert need["journeydb"] == 7  # phase3: 0.58 × 8 = 4.64 → 5; + 2
    assert need["coco"] == 10


def test_forecast_projects_from_the_measured_rates():
    runs = [
        StageRun("prepare_models", 60.0, 6 * 1024**3),
        StageRun("fetch_images@laion", 16.0, 1024**3, {"samples": 2, "success_rate": 1.0}),
        StageRun("encode_latents@laion", 30.0, 2 * 1024**3, {"images_encoded": 10, "images_per_second": 0.5}),
        StageRun("train@phase1", 100.0, 18 * 1024**3, {"world_size": 1}, steps=[(40.0, 1), (25.0, 1)]),
        StageRun("train@phase2", 100.0, 17 * 1024**3, {"world_size": 1}, steps=[(30.0, 1), (25.0, 1)]),
    ]
    pod = Pod(gpus=2, train_img_s=50.0, encode_img_s=200.0, price_per_gpu_hour=2.0)
    rows, totals = forecast(runs, FULL, derived(), pod, cpus=2)
    by_stage = {r.stage: r for r in rows}
    assert [r.stage for r in rows] == ["prepare_models", "fetch_images", "encode_latents", "train"]
    fetch = by_stage["fetch_images"]  # assumed rates: 1,000 img/s per 16-core pod, scaled to 2 cores here
    fetched = 2_329_280 + 6 * 256  # the phases' draws + train.held_out of each of the 6 sources
    assert fetch.rate == pytest.approx(125.0) and fetch.full_work == totals["full_images_fetched"] == fetched
    assert fetch.pod_hours == pytest.approx(round(fetched / 1000 / 3600, 2))
    train = by_stage["train"]
    assert train.rate == pytest.approx(1 / 25)  # first step of each phase dropped
    assert train.full_work == full_train_samples(FULL) == 28_545_948
    assert train.device_hours == pytest.approx(round(28_545_948 * 25 / 3600, 2))
    assert train.pod_hours == pytest.approx(round(28_545_948 / 100 / 3600, 2))
    assert by_stage["encode_latents"].rate == pytest.approx(0.5)
    assert by_stage["prepare_models"].pod_hours is None and train.peak_rss_gib == 18.0
    assert totals["peak_rss_gib"] == 18.0
    assert totals["full_optimizer_steps"] == full_optimizer_steps(FULL, 2) == 297_357
    assert totals["pod_cost"] == pytest.approx(round(totals["pod_hours"] * 2 * 2.0, 0), abs=1)
    text = table(rows, totals, "cpu")
    assert text.count("\n| ") == 4 and "assumed figures" in text
    assert totals["posthoc_ema"] is None and "post-hoc EMA: off" in text  # no train run named the UNet's size


def test_validation_loss_and_posthoc_ema_are_forecast_from_the_full_config():
    tiny = {"train": {"held_out": 10, "val_loss_every": 4, "val_loss_timesteps": 8},
            "phases": {"a": {"samples": 64, "epochs": 1, "batch_size": 8, "mix": {"x": 0.5, "y": 0.5}},
                       "b": {"samples": 32, "epochs": 1, "batch_size": 8, "mix": {"x": 1.0}}}}  # fmt: skip
    # a: 8 steps on 1 GPU -> measured at 4 and 8 (the end); b: 4 steps -> at 4
    assert full_val_loss_forwards(tiny, 1) == 10 * 2 * 8 * 2 + 10 * 1 * 8 * 1
    tiny["train"]["val_loss_every"] = 0  # only at the ends
    assert full_val_loss_forwards(tiny, 1) == 10 * 2 * 8 + 10 * 8
    assert posthoc_ema_cost(FULL, None) is None and FULL["train"]["posthoc_sigma_rels"] == [0.05, 0.10]
    cost = posthoc_ema_cost(FULL, 859_520_964)  # SD1.5's UNet: two fp32 copies, 8 snapshots of both
    assert cost == {"memory_gib": round(2 * 859_520_964 * 4 / 2**30, 2),
                    "disk_per_phase_gib": round(16 * 859_520_964 * 4 / 2**30, 1)}  # fmt: skip
    runs = [StageRun("train@phase1", 100.0, 18 * 1024**3, {"world_size": 1, "unet_params": 859_520_964},
                     steps=[(40.0, 1), (25.0, 1)])]  # fmt: skip
    rows, totals = forecast(runs, FULL, derived(), Pod(), cpus=2)
    assert totals["posthoc_ema"] == cost and totals["val_loss_forwards"] == full_val_loss_forwards(FULL, 2) > 0
    assert f"{cost['disk_per_phase_gib']} GiB of snapshots per phase" in table(rows, totals, "cpu")
    # 20 bytes per parameter replicated; halved over the full config's 2 GPUs (bench.fsdp_memory measured 16.01 / 8.00)
    assert totals["parallel_state"] == {"ddp_gib": 16.01, "fsdp_gib": 8.0, "gpus": 2, "setting": "auto"}
    assert "DDP 16.01 GiB, FSDP over 2 GPUs 8.0 GiB" in table(rows, totals, "cpu")


def test_captioning_is_projected_only_for_recaptioned_sources():
    off = [StageRun("caption_images@laion", 3.0, 1024**3, {"enabled": False, "shards_removed": 0})]
    rows, _ = forecast(off, FULL, derived(), Pod(), cpus=2)
    assert rows[0].note.startswith("fixed") and rows[0].device_hours is None
    full = {**FULL, "sources": {**FULL["sources"], "laion": {**FULL["sources"]["laion"], "recaption": {"model": "m"}}}}
    on = [StageRun("caption_images@laion", 30.0, 1024**3, {"enabled": True, "run.captioned": 40, "seconds": 20.0})]
    (row,), _ = forecast(on, full, derived(), Pod(), cpus=2)
    laion = full_images(full)["laion"]
    assert row.rate == pytest.approx(2.0) and row.full_work == laion
    assert row.device_hours == pytest.approx(round(laion / 2.0 / 3600, 2)) == row.pod_hours


def test_the_coco_protocol_runs_on_the_preflight_sample_and_is_forecast_per_image(tmp_path):
    from sdforge.eval.coco import reference_image, select_prompts
    from sdforge.preflight.derive import COCO_DIR, PREFLIGHT_COCO_SAMPLES
    from sdforge.preflight.samples import COCO_SIDE, write_coco_val

    coco = derived()["eval"]["coco"]
    assert FULL["eval"]["coco"]["phase_end_samples"] == 5000 and PREFLIGHT_COCO_SAMPLES == 2
    assert coco["captions"] == f"{COCO_DIR}/annotations/captions_val2014.json" and coco["phase_end_samples"] == 2
    assert coco["images"] == f"{COCO_DIR}/val2014" and coco["steps"] is None  # eval.steps: the preflight's 2
    captions = write_coco_val(tmp_path, 3, COCO_SIDE, seed=0)
    prompts = select_prompts(captions, 3, seed=2014)
    assert sorted(p.image_id for p in prompts) == [1, 2, 3] and all(p.caption for p in prompts)
    assert reference_image(tmp_path / "val2014" / prompts[0].file_name, 512).shape == (512, 512, 3)
    runs = [StageRun("eval_grid@phase7", 300.0, 20 * 1024**3,
                     {"coco_samples": 2, "coco_seconds": 120.0, "coco_steps": 2, "coco_guidance_scale": 7.5})]
    pod = Pod(gpus=2, train_img_s=50.0)
    rows, totals = forecast(runs, FULL, derived(), pod, cpus=2)
    row = {r.stage: r for r in rows}["eval_coco"]
    calls = FULL["eval"]["steps"] * 2  # CFG: two UNet calls per step
    work = 5000 * len(FULL["phases"]) * calls
    assert (row.rate, row.full_work, row.wall_s, row.unit) == (pytest.approx(8 / 120, abs=1e-4), work, 120.0,
                                                               "UNet calls/s")  # 2 images x 2 steps x 2  # fmt: skip
    assert row.device_hours == pytest.approx(round(work * 15 / 3600, 2))
    assert row.pod_hours == pytest.approx(round(work / (3 * 50.0 * 2) / 3600, 2))
    assert "| eval_coco |" in table(rows, totals, "cpu")
    no_coco = copy.deepcopy(FULL)
    no_coco["eval"]["coco"]["phase_end_samples"] = 0
    assert "eval_coco" not in {r.stage for r in forecast(runs, no_coco, derived(), pod)[0]}


def test_a_distill_phase_gets_its_own_train_row():
    """configs/full/distill.yaml's LCM phase: its train run is measured and projected apart (its samples at its own
    rate; on the pod half the training rate), the other phases' samples stay in the ``train`` row."""
    full = copy.deepcopy(FULL)
    full["phases"]["phase8_lcm"] = {**full["phases"]["phase7"], "samples": 96_000, "epochs": 1,
                                    "distill": {"method": "lcm"}}  # fmt: skip
    runs = [
        StageRun("train@phase7", 100.0, 18 * 1024**3, {"world_size": 1}, steps=[(40.0, 1), (25.0, 1)]),
        StageRun("train@phase8_lcm", 150.0, 19 * 1024**3, {"world_size": 1}, steps=[(60.0, 1), (50.0, 1)]),
    ]
    rows, _ = forecast(runs, full, derived(), Pod(gpus=2, train_img_s=50.0), cpus=2)
    by_stage = {r.stage: r for r in rows}
    assert [r.stage for r in rows] == ["train", "train_distill"]
    assert by_stage["train"].full_work == full_train_samples(FULL) and by_stage["train"].rate == pytest.approx(1 / 25)
    lcm = by_stage["train_distill"]
    assert lcm.full_work == 96_000 and lcm.rate == pytest.approx(1 / 50)
    assert lcm.pod_hours == pytest.approx(round(96_000 / 50 / 3600, 2))  # 2 GPUs × 50 img/s ÷ 2


def test_a_controlnet_phase_is_evaluated_on_two_held_out_conditions_and_a_smaller_setting_is_kept():
    from sdforge.preflight.derive import PREFLIGHT_CONTROL_SAMPLES

    assert PREFLIGHT_CONTROL_SAMPLES == 2 and "control_samples" not in FULL["eval"]  # the default: 8
    assert derived()["eval"]["control_samples"] == 2
    one = {**FULL, "eval": {**FULL["eval"], "control_samples": 1}}
    assert derive_params(one, Shrink(), REPO)["eval"]["control_samples"] == 1
