"""The cross-phase report: the table's values, one loss chart on a shared step axis, the category strips
stacked per phase, a phase not run yet, byte-identical rebuilds."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

from PIL import Image

from sdforge.eval.report import build_report, moving_average

CONFIGS = {
    "phase1": {"mix": {"laion": 1.0}, "init_from": "scratch", "lr": 1e-4, "warmup_steps": 50, "cfg_dropout": 0.1,
               "min_snr_gamma": None},
    "phase2": {"mix": {"laion": 0.6, "coco": 0.4}, "init_from": "phase1", "lr": 2e-5, "warmup_steps": 5,
               "cfg_dropout": 0.15, "min_snr_gamma": 5.0},
    "phase3": {"mix": {"coco": 1.0}, "init_from": "phase2", "lr": 1e-6, "warmup_steps": 0, "cfg_dropout": 0.15,
               "min_snr_gamma": 5.0},
}
STRIP_SIZES = {"seen": (256, 40), "held_out": (128, 40)}


def _workspace(root: Path) -> tuple[Path, Path]:
    metrics, evals = root / "metrics", root / "eval"
    figures = {
        "phase1": ({"samples": 480}, {"steps": 30, "final_loss": 0.0876, "mean_loss": 0.2, "seconds": 468.6,
                                      "samples_per_s": 51.2},
                   {"colour_agreement_seen": 1.0, "shape_agreement_seen": 0.9375}),
        "phase2": ({"samples": 300}, {"steps": 10, "final_loss": 0.0912, "mean_loss": 0.1, "seconds": 20.0,
                                      "samples_per_s": 48.0},
                   {"colour_agreement_seen": 1.0, "shape_agreement_seen": 1.0}),
    }
    for phase, (mix, train, ev) in figures.items():
        for stage, values in (("mix_phase", mix), ("train", train), ("eval_grid", ev)):
            (metrics / stage).mkdir(parents=True, exist_ok=True)
            (metrics / stage / f"{phase}.json").write_text(json.dumps(values))
        (metrics / "train_loss").mkdir(exist_ok=True)
        rows = "".join(f"{s},{1.0 / s:.4f},0.0001\n" for s in range(1, train["steps"] + 1))
        (metrics / "train_loss" / f"{phase}.csv").write_text("step,loss,lr\n" + rows)
        (evals / phase / "strips").mkdir(parents=True)
        for category, size in STRIP_SIZES.items():
            Image.new("RGB", size, (200, 30, 30)).save(evals / phase / "strips" / f"{category}.png")
    return metrics, evals


def _images(page: str) -> dict[str, Image.Image]:
    found = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)">', page)
    return {alt: Image.open(io.BytesIO(base64.b64decode(data))) for alt, data in found}


def test_report_lays_out_every_phase_the_loss_chart_and_strips(tmp_path):
    metrics, evals = _workspace(tmp_path)
    report = build_report("t", CONFIGS, list(STRIP_SIZES), metrics, evals)
    rows = re.findall(r"<tr>(.*?)</tr>", report.page)
    cells = [re.findall(r"<td>(.*?)</td>", r) for r in rows[1:]]
    header = re.findall(r"<th>(.*?)</th>", rows[0])
    assert header[:7] == ["phase", "data mix", "init", "peak LR", "warmup", "CFG drop", "Min-SNR γ"]
    # columns no phase has (held-out agreement, CLIP, FID) are left out
    assert header[7:] == ["samples", "steps", "final loss", "mean loss", "train s", "samples/s", "colour seen",
                          "shape seen"]
    assert cells[0] == ["phase1", "laion 100%", "scratch", "0.0001", "50", "0.1", "off", "480", "30", "0.0876",
                        "0.2000", "469", "51.2", "100%", "94%"]
    assert cells[1][:7] == ["phase2", "laion 60%, coco 40%", "phase1", "2e-05", "5", "0.15", "5"]
    assert cells[2][7] == "not run yet"
    assert (report.phases, report.phases_reported) == (3, 2)
    assert report.per_phase["phase1.final_loss"] == 0.0876 and report.per_phase["phase2.shape_agreement_seen"] == 1
    assert not any(k.startswith("phase3.") for k in report.per_phase)

    images = _images(report.page)
    assert set(images) == {"loss curves of all phases", "seen", "held_out"}
    # two phases' strips stacked, each right of its label column
    assert images["seen"].size == (90 + 256, 2 * 40) and images["held_out"].size == (90 + 128, 2 * 40)
    assert images["seen"].getpixel((90 + 10, 10)) == (200, 30, 30)
    assert set(report.images) == {"loss.png", "strips/seen.png", "strips/held_out.png"}


def test_report_is_byte_identical_when_rebuilt_and_opens_without_network(tmp_path):
    metrics, evals = _workspace(tmp_path)
    first = build_report("t", CONFIGS, list(STRIP_SIZES), metrics, evals)
    second = build_report("t", CONFIGS, list(STRIP_SIZES), metrics, evals)
    assert first.page == second.page and first.images == second.images
    assert "http://" not in first.page and "https://" not in first.page  # self-contained: nothing to fetch


def test_report_before_any_phase_ran_has_no_chart_and_lists_every_phase(tmp_path):
    report = build_report("t", CONFIGS, ["seen"], tmp_path / "metrics", tmp_path / "eval")
    assert report.phases_reported == 0 and report.images == {} and report.per_phase == {}
    assert report.page.count("not run yet") == 3 and "No loss curve yet." in report.page


def test_moving_average_is_a_trailing_mean():
    assert moving_average([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([4.0]) == [4.0]


def test_the_post_hoc_ema_table_lists_every_candidate_and_bolds_the_choice(tmp_path):
    metrics, evals = _workspace(tmp_path)
    assert 'id="posthoc"' not in build_report("t", CONFIGS, ["seen"], metrics, evals).page  # no phase chose
    train = json.loads((metrics / "train" / "phase1.json").read_text())
    train.update({"posthoc_ema.val_loss.fixed": 0.10125, "posthoc_ema.val_loss.0.05": 0.1001,
                  "posthoc_ema.val_loss.0.1": 0.10052, "posthoc_ema.sigma_rel": 0.05})  # fmt: skip
    (metrics / "train" / "phase1.json").write_text(json.dumps(train))
    page = build_report("t", CONFIGS, ["seen"], metrics, evals).page
    table = re.search(r'<table id="posthoc">(.*?)</table>', page).group(1)
    rows = [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", table)[1:]]
    assert rows == [["phase1", "0.05", "fixed: 0.10125 · <b>0.05: 0.10010</b> · 0.1: 0.10052"]]


def test_a_phase_sampled_with_one_setting_shows_its_steps_and_unet_calls(tmp_path):
    """A distilled phase's eval grid records ``sampling_steps`` / ``unet_calls_per_image``: the table shows them
    and its strip rows are labelled with the steps (its 4-step strips under the teacher's 15-step ones)."""
    from sdforge.eval.report import PhaseResults, strip_label

    metrics, evals = _workspace(tmp_path)
    for phase, steps, calls in (("phase1", 15, 30.0), ("phase2", 4, 4.0)):
        path = metrics / "eval_grid" / f"{phase}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "sampling_steps": steps,
                                    "unet_calls_per_image": calls}))  # fmt: skip
    report = build_report("t", CONFIGS, list(STRIP_SIZES), metrics, evals)
    rows = re.findall(r"<tr>(.*?)</tr>", report.page)
    header = re.findall(r"<th>(.*?)</th>", rows[0])
    cells = [re.findall(r"<td>(.*?)</td>", r) for r in rows[1:]]
    at = header.index("sampler steps")
    assert header[at + 1] == "UNet calls/img" and [c[at : at + 2] for c in cells[:2]] == [["15", "30.0"], ["4", "4.0"]]
    assert strip_label(PhaseResults("phase2", {}, {"eval_grid": {"sampling_steps": 4}})) == "phase2\n4 steps"
    assert strip_label(PhaseResults("phase3", {})) == "phase3"
