"""bench.demo_quality's params: outputs under the work dir, inputs from the repo, overrides, phases kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.demo_quality import OUTPUTS, seed_params

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


def test_the_probe_scores_the_first_phase_the_last_full_one_and_the_adapter(tmp_path):
    from bench.demo_quality import evaluated_phases

    params = seed_params(REPO_PARAMS, tmp_path, seed=0, quick=False)
    assert evaluated_phases(params) == {"first": "phase0", "base": "phase7", "adapter": "phase8"}
    (tmp_path / "q").mkdir()
    quick = seed_params(REPO_PARAMS, tmp_path / "q", seed=0, quick=True)
    assert evaluated_phases(quick) == {"first": "phase0", "base": "phase0"}
