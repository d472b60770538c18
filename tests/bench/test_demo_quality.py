"""bench.demo_quality's params: outputs under the work dir, inputs from the repo, overrides, phases kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.demo_quality import OUTPUTS, seed_params, train_seed

REPO_PARAMS = Path(__file__).resolve().parents[2] / "params.yaml"


def test_seed_params_redirects_outputs_and_applies_overrides(tmp_path):
    params = seed_params(REPO_PARAMS, tmp_path, seed=2, quick=False, phases=2, overrides=["phases.phase1.lr=1e-3"])
    paths = params.paths.model_dump()
    for key, value in paths.items():
        root = tmp_path if key in OUTPUTS else REPO_PARAMS.parent
        assert Path(value).is_absolute() and Path(value).is_relative_to(root), key
    assert Path(paths["runs"]) == tmp_path / "runs"
    assert Path(paths["latents"]) == REPO_PARAMS.parent / "data" / "latents"
    assert params.train.seed == 2 and params.train.validation_every == 0 and not params.tracking.enabled
    assert list(params.phases) == ["phase0", "phase1"] and params.phases["phase1"].lr == 1e-3
    assert (tmp_path / "params.yaml").is_file()


def test_quick_keeps_one_epoch_of_the_first_phase(tmp_path):
    params = seed_params(REPO_PARAMS, tmp_path, seed=0, quick=True)
    assert list(params.phases) == ["phase0"] and params.phases["phase0"].epochs == 1


def test_an_override_of_a_missing_section_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no section 'nope'"):
        seed_params(REPO_PARAMS, tmp_path, seed=0, quick=False, overrides=["nope.lr=1"])


def test_the_probe_scores_the_first_phase_the_last_full_one_the_adapter_and_the_distilled_one(tmp_path):
    from bench.demo_quality import evaluated_phases

    params = seed_params(REPO_PARAMS, tmp_path, seed=0, quick=False)
    assert evaluated_phases(params) == {"first": "phase0", "base": "phase7", "adapter": "phase8", "distilled": "phase9"}
    (tmp_path / "q").mkdir()
    quick = seed_params(REPO_PARAMS, tmp_path / "q", seed=0, quick=True)
    assert evaluated_phases(quick) == {"first": "phase0", "base": "phase0"}


def test_bar_ratio_is_the_lowest_figure_over_its_bar_and_names_each_miss():
    from bench.demo_quality import bar_ratio

    tags = {"first": "phase0", "base": "phase7", "adapter": "phase8"}
    good = {"seed": 0, "draw": 0, "tags": tags, "base_colour_agreement_seen": 1.0, "base_shape_agreement_seen": 0.875,
            "base_colour_agreement_held_out": 1.0, "base_shape_agreement_held_out": 0.75,
            "adapter_colour_agreement_concept_on_white": 0.75, "adapter_colour_agreement_concept_on_black": 1.0,
            "adapter_colour_agreement_seen": 1.0}
    assert bar_ratio([good]) == (1.0, [])  # shape seen 14/16 and orange on white 6/8 sit exactly on their bars
    bad = {**good, "seed": 2, "draw": 1, "adapter_colour_agreement_concept_on_white": 0.375}
    ratio, misses = bar_ratio([good, bad])
    assert ratio == 0.5
    assert misses == ["seed 2 text encoder 1: phase8 colour_agreement_concept_on_white 0.375 < 0.750"]


def test_another_text_encoder_draw_is_built_beside_the_shared_models(tmp_path):
    from safetensors.torch import load_file
    from transformers import CLIPTextModel

    from bench.demo_quality import use_text_encoder_draw
    from model.denoisers import family
    from model.text_stack import TextStack
    from sdforge.config import load_params
    from sdforge.demo.models import build_demo_text_encoder
    from stages.prepare_models import save_uncond_embedding

    base = tmp_path / "params.yaml"
    base.write_text(REPO_PARAMS.read_text())
    p = load_params(base)
    models = tmp_path / "models"
    tokenizer, encoder, _ = build_demo_text_encoder(p.models, p.demo, p.eval, models / "tokenizer")
    encoder.save_pretrained(models / "text_encoder")
    shipped = save_uncond_embedding(TextStack(family("unet"), [tokenizer], [encoder]),
                                    models / "uncond_embedding.safetensors")
    (tmp_path / "w0").mkdir()
    same = seed_params(base, tmp_path / "w0", seed=0, quick=False)
    assert use_text_encoder_draw(base, same, tmp_path / "w0") is same  # params' own draw: the shared folder
    work = tmp_path / "w1"
    work.mkdir()
    other = seed_params(base, work, seed=0, quick=False, overrides=["models.text_encoder_build.seed=7"])
    drawn = use_text_encoder_draw(base, other, work)
    assert Path(drawn.paths.models) == work / "models" and drawn.models.text_encoder_build.seed == 7
    new = CLIPTextModel.from_pretrained(work / "models" / "text_encoder").state_dict()
    old = CLIPTextModel.from_pretrained(models / "text_encoder").state_dict()
    assert new.keys() == old.keys() and any(not (new[k] == old[k]).all() for k in new)
    uncond = load_file(work / "models" / "uncond_embedding.safetensors")["uncond"]
    assert uncond.shape == shipped.shape and not (uncond == shipped).all()
    assert (models / "text_encoder").is_dir()  # the shared folder is left as it was


def test_from_phase_and_rescore_continue_only_an_earlier_run(tmp_path):
    with pytest.raises(SystemExit, match="--from-phase phase8: no earlier run in .*seed-0"):
        train_seed(REPO_PARAMS, tmp_path, 0, False, from_phase="phase8")
    with pytest.raises(SystemExit, match="--rescore: no earlier run in .*seed-0"):
        train_seed(REPO_PARAMS, tmp_path, 0, False, rescore=True)
    assert not (tmp_path / "seed-0" / "checkpoints").exists()  # nothing trained, nothing deleted


def test_few_step_fields_compare_the_student_with_its_teacher():
    from bench.demo_quality import few_step_fields

    def f(colour, shape, steps, calls):
        return {"colour": colour, "shape": shape, "steps": steps, "guidance": 3.0, "unet_calls": calls,
                "ms_per_image": 1.0}

    study = {"teacher": "phase7", "teacher_many": f(1.0, 0.96, 50, 100), "teacher_few": f(1.0, 0.97, 4, 8),
             "teacher_same_calls": f(0.9, 0.6, 2, 4), "student": f(1.0, 0.88, 4, 4)}  # fmt: skip
    fields = few_step_fields([{"seed": 0, "draw": 0, "few_step": study}])
    assert fields["distilled_share_of_teacher50_min"] == pytest.approx(0.88 / 0.96)
    assert fields["distilled_beats_teacher_same_steps"] == "0/1"
    assert fields["distilled_beats_teacher_same_unet_calls"] == "1/1"
    assert few_step_fields([{"seed": 0}]) == {}


def test_the_distilled_phase_has_issue_42s_bar():
    from bench.demo_quality import bar_ratio

    def f(colour, shape):
        return {"colour": colour, "shape": shape}

    study = {"teacher_many": f(1.0, 1.0), "student": f(1.0, 0.81)}
    ratio, misses = bar_ratio([{"seed": 1, "draw": 0, "tags": {"distilled": "phase9"}, "few_step": study}])
    assert ratio == pytest.approx(0.81 / 0.9) and misses == [
        "seed 1 text encoder 0: phase9 keeps 0.810 < 0.9 of its teacher's 50-step probe"
    ]
