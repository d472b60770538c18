"""``sdforge``'s flags (issue 55, item 3): a flag out of its range — negative, zero, non-finite, a seed torch cannot
take, an image larger than the model's bound, an ``--out`` that is a file — is one line naming the flag and status
2, before any model is loaded where the rule does not need the model, and nothing is written."""

from __future__ import annotations

import logging
import os

import pytest

import sdforge.eval.coco
import sdforge.eval.sampling
from sdforge.config.arguments import MAX_SIZE_FACTOR
from tests.fixtures.eval_workspace import make_workspace, write_params
from tools.cli import main

PROMPT = "a red circle on a white background"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_arguments")
    models, ckpt = make_workspace(root)
    return root, write_params(root, models, ckpt.parent, prompts={"shapes": [PROMPT]}), ckpt


def refused(caplog, capsys, *argv: str) -> str:
    """Run ``sdforge <argv>``; assert status 2, one error line and no traceback; return the line."""
    caplog.clear()
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert "Traceback" not in capsys.readouterr().err
    return errors[0]


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: these flags are refused before."""

    def load_pipeline(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(sdforge.eval.sampling, "load_pipeline", load_pipeline)  # the CLI imports it when it runs


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "-5"], "--steps: input should be greater than or equal to 1; got -5"),
        (["--steps", "0"], "--steps: input should be greater than or equal to 1; got 0"),
        (["--width", "-32"], "--width: input should be greater than or equal to 1; got -32"),
        (["--height", "0"], "--height: input should be greater than or equal to 1; got 0"),
        (["--batch-size", "0"], "--batch-size: input should be greater than or equal to 1; got 0"),
        (["--num-images", "-1"], "--num-images: input should be greater than or equal to 1; got -1"),
        (["--num-images", "0"], "--num-images: input should be greater than or equal to 1; got 0"),
        (["--seed", "-1"], "--seed: input should be greater than or equal to 0; got -1"),
        (["--seed", str(10**20)], f"--seed: input should be less than or equal to {2**63 - 1}; got {10**20}"),
        (["--seed", str(2**63 - 1), "--num-images", "2"], f"--seed {2**63 - 1}: image i is sampled with seed + i"),
        (["--guidance", "inf"], "--guidance: input should be a finite number; got inf"),
        (["--guidance=-inf"], "--guidance: input should be a finite number; got -inf"),
        (["--guidance", "nan"], "--guidance: input should be a finite number; got nan"),
        (["--guidance", "0.5"], "--guidance: input should be greater than or equal to 1; got 0.5"),
    ],
)
def test_generate_refuses_a_flag_out_of_range_naming_it_before_loading_a_model(
    project, tmp_path, caplog, capsys, no_model, flags, message
):
    root, params, ckpt = project
    out = tmp_path / "out"
    line = refused(caplog, capsys, "generate", "--params", str(params), "--checkpoint", str(ckpt), "--prompt", PROMPT,
                   "--device", "cpu", "--out", str(out), *flags)  # fmt: skip
    assert line.startswith(message), line
    assert not out.exists()


@pytest.mark.parametrize("under", [False, True])
def test_generate_refuses_an_out_that_is_a_file_and_leaves_it_as_it_was(
    project, tmp_path, caplog, capsys, no_model, under
):
    root, params, ckpt = project
    existing = tmp_path / "notes.txt"
    existing.write_bytes(b"my notes\n")
    before = os.stat(existing)
    out = existing / "images" if under else existing
    line = refused(caplog, capsys, "generate", "--params", str(params), "--checkpoint", str(ckpt), "--prompt", PROMPT,
                   "--device", "cpu", "--out", str(out))  # fmt: skip
    assert line.startswith(f"--out: {existing} is a file, not a folder"), line
    assert existing.read_bytes() == b"my notes\n" and os.stat(existing).st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize(("flag", "side"), [("--width", "64"), ("--height", "48"), ("--width", "65536")])
def test_generate_refuses_an_image_side_above_the_models_trained_side_times_the_factor(
    project, tmp_path, caplog, capsys, flag, side
):
    root, params, ckpt = project
    out = tmp_path / "out"
    line = refused(caplog, capsys, "generate", "--params", str(params), "--checkpoint", str(ckpt), "--prompt", PROMPT,
                   "--device", "cpu", "--steps", "1", "--out", str(out), flag, side)  # fmt: skip
    # the tiny workspace's UNet: 8×8 latents, VAE down factor 2 → trained at 16 px
    bound = f"at most {16 * MAX_SIZE_FACTOR} px for this model (its trained 16 px × MAX_SIZE_FACTOR {MAX_SIZE_FACTOR})"
    assert line == f"{flag} {side}: {bound}", line
    assert not out.exists()


def test_generate_at_the_size_bound_still_samples(project, tmp_path, capsys):
    root, params, ckpt = project
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--params", str(params), "--checkpoint", str(ckpt), "--prompt", PROMPT, "--device", "cpu",
              "--steps", "1", "--width", str(16 * MAX_SIZE_FACTOR), "--num-images", "2",
              "--out", str(tmp_path)])  # fmt: skip
    assert exit_.value.code == 0
    assert [p.rsplit("/", 1)[-1] for p in capsys.readouterr().out.split()] == ["000-seed0.png", "001-seed1.png"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--samples", "1"], "--samples: input should be greater than or equal to 2; got 1"),
        (["--samples", "0"], "--samples: input should be greater than or equal to 2; got 0"),
        (["--phase", "../elsewhere"], "--phase: not a safe name"),
    ],
)
def test_evaluate_refuses_a_flag_out_of_range_naming_it(project, caplog, capsys, monkeypatch, flags, message):
    root, params, ckpt = project
    monkeypatch.setattr(sdforge.eval.coco, "run_protocol", lambda *a, **k: pytest.fail("evaluated despite a bad flag"))
    line = refused(caplog, capsys, "evaluate", "--params", str(params), "--checkpoint", str(ckpt), *flags)
    assert line.startswith(message), line


def test_evaluate_refuses_an_out_that_is_a_file(project, tmp_path, caplog, capsys, monkeypatch):
    root, params, ckpt = project
    monkeypatch.setattr(sdforge.eval.coco, "run_protocol", lambda *a, **k: pytest.fail("evaluated despite a bad flag"))
    existing = tmp_path / "coco.json"
    existing.write_text("{}")
    line = refused(caplog, capsys, "evaluate", "--params", str(params), "--checkpoint", str(ckpt), "--samples", "4",
                   "--out", str(existing))  # fmt: skip
    assert line.startswith(f"--out: {existing} is a file, not a folder"), line
    assert existing.read_text() == "{}"


def test_runs_refuses_a_phase_that_is_not_a_name(project, caplog, capsys):
    root, params, _ = project
    line = refused(caplog, capsys, "runs", "clean", "--phase", "../..", "--yes", "--params", str(params))
    assert line.startswith("--phase: not a safe name"), line


def test_generate_replaces_its_own_images_but_never_a_users_file_of_the_same_name(project, tmp_path, caplog, capsys):
    root, params, ckpt = project
    argv = ["generate", "--params", str(params), "--checkpoint", str(ckpt), "--prompt", PROMPT, "--device", "cpu",
            "--steps", "1", "--num-images", "2", "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    with pytest.raises(SystemExit) as exit_:  # its own earlier images: replaced
        main(argv)
    assert exit_.value.code == 0
    mine = tmp_path / "001-seed1.png"
    mine.write_bytes(b"my drawing\n")  # a user's file where image 1 would go
    capsys.readouterr()
    line = refused(caplog, capsys, *argv)
    assert line == f"{mine}: exists and is not an image sdforge generate wrote; pick another --out (nothing written)"
    assert mine.read_bytes() == b"my drawing\n"
