"""``sdforge generate`` / ``sdforge export`` on a tiny demo-format workspace, on the CPU."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import sdforge.eval.export
from sdforge.config import load_params
from sdforge.eval.grid import probe_agreement
from sdforge.eval.sampling import generate, load_pipeline
from stages import eval_grid
from tests.fixtures.eval_workspace import make_workspace, write_controlnet_phase, write_distilled_phase, write_params
from tools.cli import main

PROMPT = "a red circle on a white background"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    models, ckpt = make_workspace(root)
    params = write_params(
        root, models, ckpt.parent, prompts={"shapes": [PROMPT], "cats": ["a cat photo"]},
        sampling={"cats": {"steps": 2, "guidance_scale": 5.0}},
    )  # fmt: skip
    return root, params, ckpt


def _cli(capsys, command: str, *argv: str) -> list[str]:
    """Run ``sdforge <command> --checkpoint <tiny phase1> ...``; return the printed paths."""
    ckpt = [a for a in argv if a.endswith("params.yaml")][0].replace("params.yaml", "checkpoints/phase1")
    with pytest.raises(SystemExit) as exit_:
        main([command, "--checkpoint", ckpt, *argv])
    assert exit_.value.code == 0
    return capsys.readouterr().out.split()


def test_generate_writes_png_text_chunks_and_the_eval_grids_pixels(project, capsys):
    root, params, ckpt = project
    paths = _cli(capsys, "generate", "--params", str(params), "--prompt", PROMPT, "--negative", "blurry",
                 "--seed", "1234", "--device", "cpu", "--out", str(root / "gen"))  # fmt: skip
    assert paths == [str(root / "gen/000-seed1234.png")]
    png = Image.open(paths[0])
    assert {k: v for k, v in png.text.items()} == {
        "sdforge:prompt": PROMPT,
        "sdforge:negative_prompt": "blurry",
        "sdforge:seed": "1234",
        "sdforge:steps": "3",
        "sdforge:guidance_scale": "3.0",
        "sdforge:checkpoint": str(ckpt),
        "sdforge:checkpoint_hash": load_pipeline(root / "models", ckpt).checkpoint_hash,
        "sdforge:weights": "ema",
    }
    # the eval grid samples the same prompt/seed/settings with the same EMA weights → same pixels, same probe
    p = load_params(params)
    eval_cfg = p.eval.model_copy(update={"negative_prompt": "blurry"})
    metrics = eval_grid.run(eval_cfg, p.demo, root / "models", ckpt, root / "eval/phase1")
    grid_img = np.asarray(Image.open(root / "eval/phase1/images/00.png"))
    assert np.array_equal(np.asarray(png.convert("RGB")), grid_img)
    probe = probe_agreement([np.asarray(png.convert("RGB"))], [PROMPT], p.demo)
    assert probe["colour_agreement"] == probe_agreement([grid_img], [PROMPT], p.demo)["colour_agreement"]
    assert metrics["probe_prompts"] == 1  # "a cat photo" is not a demo caption: not probed


def test_generate_takes_a_categorys_steps_and_guidance(project, capsys):
    root, params, _ = project
    paths = _cli(capsys, "generate", "--params", str(params), "--prompt", "a cat photo", "--category", "cats",
                 "--num-images", "2", "--device", "cpu", "--out", str(root / "gen-cat"))  # fmt: skip
    texts = [Image.open(p).text for p in paths]
    assert [(t["sdforge:steps"], t["sdforge:guidance_scale"], t["sdforge:seed"]) for t in texts] == [
        ("2", "5.0", "0"),
        ("2", "5.0", "1"),
    ]


@pytest.mark.slow  # ~15 s on the 2-core CI machine; tests/sdforge/eval/test_export.py checks the same equality faster
def test_exported_pipeline_reproduces_generate(project, capsys, monkeypatch):
    from diffusers import StableDiffusionPipeline
    root, params, _ = project
    registered = []
    monkeypatch.setattr(sdforge.eval.export, "register", lambda *a: registered.append(a[1]) or {"model_version": 1})
    out = root / "sd-export"
    assert _cli(capsys, "export", "--params", str(params), "--out", str(out), "--mlflow-register", "demo") == [
        str(out)
    ]
    assert registered == ["demo"]
    [png_path] = _cli(capsys, "generate", "--params", str(params), "--prompt", PROMPT, "--seed", "5",
                      "--steps", "4", "--guidance", "2.5", "--device", "cpu", "--out", str(root / "gen-5"))  # fmt: skip
    ours = np.asarray(Image.open(png_path).convert("RGB")).astype(int)
    sd = StableDiffusionPipeline.from_pretrained(out)
    sd.set_progress_bar_config(disable=True)
    theirs = sd(PROMPT, negative_prompt="", num_inference_steps=4, guidance_scale=2.5,
                generator=torch.Generator().manual_seed(5)).images[0]  # fmt: skip
    assert np.abs(ours - np.asarray(theirs).astype(int)).max() == 0  # measured: identical pixels


def _pickle_only(weights: Path) -> None:
    """``weights``' safetensors replaced by a pickled ``.bin`` that also holds a non-tensor object."""
    st = weights / "diffusion_pytorch_model.safetensors"
    torch.save({**load_file(st), "extra": Path("/not/a/tensor")}, st.with_suffix(".bin"))
    st.unlink()


def _truncated(weights: Path) -> None:
    st = weights / "diffusion_pytorch_model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])


DAMAGE = {
    "pickled .bin only": (_pickle_only, "no .safetensors weights"),
    "truncated safetensors": (_truncated, "cannot be loaded"),
}


@pytest.mark.parametrize("command", ["generate", "export"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_an_unloadable_checkpoint_is_one_line_naming_it(project, tmp_path, caplog, capsys, command, damage):
    root, params, ckpt = project
    bad = tmp_path / "phase1"
    shutil.copytree(ckpt, bad)
    spoil, reason = DAMAGE[damage]
    spoil(bad / "unet_ema")
    args = ["--prompt", PROMPT, "--device", "cpu"] if command == "generate" else []
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exit_:
        main([command, "--checkpoint", str(bad), "--params", str(params), "--out", str(tmp_path / "out"), *args])
    assert exit_.value.code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith(f"{bad / 'unet_ema'}: {reason}") and "pass another checkpoint" in errors[0]
    everything = caplog.text + "".join(capsys.readouterr())
    assert "weights_only" not in everything and "Traceback" not in everything
    assert not (tmp_path / "out").exists()


def test_report_writes_the_page_for_the_phases_finished_so_far(project, capsys):
    root, params_file, _ = project
    params = load_params(params_file)
    metrics = Path(params.paths.metrics)
    (metrics / "train").mkdir(parents=True, exist_ok=True)
    (metrics / "train" / "phase1.json").write_text('{"steps": 7, "final_loss": 0.4321}')
    with pytest.raises(SystemExit) as exit_:
        main(["report", "--params", str(params_file)])
    assert exit_.value.code == 0
    out = Path(params.paths.eval) / "report.html"
    assert capsys.readouterr().out.split() == [str(out)]
    page = out.read_text()
    phases = params.phase_names()
    assert "<td>0.4321</td>" in page and page.count("not run yet") == len(phases) - 1


def test_generate_at_a_non_square_size_and_refuses_a_bad_one(project, capsys, caplog):
    root, params, _ = project
    paths = _cli(capsys, "generate", "--params", str(params), "--prompt", PROMPT, "--width", "24", "--height", "16",
                 "--steps", "2", "--device", "cpu", "--out", str(root / "wide"))  # fmt: skip
    assert Image.open(paths[0]).size == (24, 16)
    ckpt = str(params).replace("params.yaml", "checkpoints/phase1")
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        main(["generate", "--checkpoint", ckpt, "--params", str(params), "--prompt", PROMPT, "--width", "18",
              "--device", "cpu", "--out", str(root / "bad")])  # fmt: skip
    assert exit_.value.code == 2
    assert "--width/--height: image size 18×16: width and height must be multiples of 4 px" in caplog.text
    assert not (root / "bad").exists()


def _run(*argv: str) -> int:
    """``sdforge <argv>``'s exit status."""
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    return exit_.value.code


def test_generate_on_a_distilled_phase_defaults_to_its_few_steps_without_cfg(project, tmp_path, capsys, caplog):
    root, params, ckpt = project
    lcm = tmp_path / "lcm"
    write_distilled_phase(ckpt, lcm)
    common = ["--checkpoint", str(lcm), "--params", str(params), "--prompt", PROMPT, "--device", "cpu"]
    assert _run("generate", *common, "--out", str(tmp_path / "default")) == 0
    assert _run("generate", *common, "--fuse-lora", "--out", str(tmp_path / "fused")) == 0
    assert _run("generate", *common, "--steps", "2", "--guidance", "2.0", "--out", str(tmp_path / "given")) == 0
    [default, fused, given] = [Image.open(p) for p in capsys.readouterr().out.split()]
    assert (default.text["sdforge:steps"], default.text["sdforge:guidance_scale"]) == ("4", "1.0")  # not eval's 3, 3.0
    assert (given.text["sdforge:steps"], given.text["sdforge:guidance_scale"]) == ("2", "2.0")  # flags win
    for png, fuse in ((default, False), (fused, True)):
        want = generate(load_pipeline(root / "models", lcm, fuse_adapter=fuse), [PROMPT], steps=4, guidance_scale=1.0,
                        seeds=[0])[0]  # fmt: skip
        assert np.array_equal(np.asarray(png.convert("RGB")), want)
    with caplog.at_level(logging.ERROR):
        assert _run("generate", *common, "--steps", "51", "--out", str(tmp_path / "bad")) == 2
    assert "--steps 51: this distilled phase samples at most 50 steps (distill.num_ddim_timesteps)" in caplog.text


def test_export_lora_file_needs_an_unmerged_adapter(project, tmp_path, caplog):
    root, params, ckpt = project
    with caplog.at_level(logging.ERROR):
        code = _run("export", "--checkpoint", str(ckpt), "--params", str(params), "--lora-file", "--out",
                    str(tmp_path / "sd"))  # fmt: skip
    assert code == 2 and "no unmerged adapter to keep as a LoRA file" in caplog.text
    assert not (tmp_path / "sd").exists()


def test_generate_on_a_controlnet_phase_draws_under_each_prompts_control_image(project, tmp_path, capsys, caplog):
    root, params, ckpt = project
    phase = tmp_path / "controlnet"
    write_controlnet_phase(ckpt, phase)
    rng = np.random.default_rng(0)
    files = []
    for i in range(2):
        edges = ((rng.random((16, 16)) < 0.2) * 255).astype(np.uint8)
        files.append(tmp_path / f"edges{i}.png")
        Image.fromarray(edges).save(files[-1])  # greyscale: read as RGB, as the diffusers pipeline reads it
    prompts = ["--prompt", PROMPT, "--prompt", "a blue square on a black background"]
    common = ["--checkpoint", str(phase), "--params", str(params), "--device", "cpu", *prompts]
    controls = ["--control-image", str(files[0]), "--control-image", str(files[1])]
    assert _run("generate", *common, *controls, "--out", str(tmp_path / "out")) == 0
    drawn = [np.asarray(Image.open(p).convert("RGB")) for p in capsys.readouterr().out.split()]
    images = [np.asarray(Image.open(f).convert("RGB")) for f in files]
    want = generate(load_pipeline(root / "models", phase), [PROMPT, "a blue square on a black background"], steps=3,
                    guidance_scale=3.0, seeds=[0, 1], control_images=images)  # fmt: skip
    assert len(drawn) == 2 and all(np.array_equal(a, b) for a, b in zip(drawn, want, strict=True))
    with caplog.at_level(logging.ERROR):
        assert _run("generate", *common, "--out", str(tmp_path / "none")) == 2
        gone = ["--control-image", str(tmp_path / "gone.png")]
        assert _run("generate", *common, *gone, "--out", str(tmp_path / "x")) == 2
    assert "needs one conditioning image per image (2); got 0" in caplog.text
    assert "--control-image: no such file" in caplog.text
    assert not (tmp_path / "none").exists()
