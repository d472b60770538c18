"""prepare_models: output layout, demo tokenizer/VAE, determinism, pretrained path, cross-attention check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from safetensors.torch import load_file
from transformers import CLIPTextModel, CLIPTokenizer

from model.builders import build_tiny_text_encoder, build_tiny_vae
from sdforge.config import ConfigError, DemoData, Eval, Models, load_params
from sdforge.tracking import flush_spool
from stages import prepare_models
from tests.fixtures.training import TINY_UNET

DEMO = DemoData(
    image_size=48,
    colours={"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220)},
    shapes=["circle", "square", "triangle"],
    backgrounds={"white": (245, 245, 245), "black": (15, 15, 15)},
)
EVAL = Eval(prompts=["a red circle on a white background", "a blue square, on black!"], negative_prompt="blurry")
TINY_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}


def tiny_models(**overrides) -> Models:
    data = {
        "source": "build",
        "seed": 0,
        "vae_build": {"block_out_channels": [8, 16], "train_steps": 3, "batch_size": 4},
        "text_encoder_build": TINY_TEXT,
        "unet": TINY_UNET,
    }
    data.update(overrides)
    return Models.model_validate(data)


def _weights(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {str(f.relative_to(root)): load_file(f) for f in sorted(root.rglob("*.safetensors"))}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("build")
    metrics = prepare_models.run(tiny_models(), DEMO, EVAL, root / "models", root / "checkpoints/scratch")
    return root, metrics


def test_output_layout(built):
    root, metrics = built
    models, scratch = root / "models", root / "checkpoints/scratch"
    assert sorted(p.name for p in models.iterdir()) == [
        "scheduler", "text_encoder", "tokenizer", "uncond_embedding.safetensors", "vae"
    ]
    assert sorted(p.name for p in (models / "vae").iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert sorted(p.name for p in (models / "text_encoder").iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in (models / "tokenizer").iterdir()) == [
        "merges.txt", "tokenizer.json", "tokenizer_config.json", "vocab.json"
    ]
    assert sorted(p.name for p in (models / "scheduler").iterdir()) == ["scheduler_config.json"]
    assert sorted(p.name for p in scratch.iterdir()) == ["state.json", "unet", "unet_ema"]
    assert json.loads((scratch / "state.json").read_text()) == {"phase": "scratch", "step": 0}
    assert not list(root.rglob("*.tmp"))
    # unet and unet_ema are the same weights
    live, ema = _weights(scratch / "unet"), _weights(scratch / "unet_ema")
    (name,) = live
    assert all(torch.equal(live[name][k], ema[name][k]) for k in live[name])
    assert not live[name]["conv_out.weight"].any()
    assert metrics["source"] == "build"
    assert metrics["unet_params"] == sum(t.numel() for t in live[name].values())
    assert metrics["pixel_size"] == 16 and metrics["vae_downsample"] == 2
    assert metrics["vae_train_steps"] == 3 and metrics["vae_eval_images"] == 128


def test_saved_components_load_through_from_pretrained(built):
    root, metrics = built
    models = root / "models"
    tok = CLIPTokenizer.from_pretrained(models / "tokenizer")
    te = CLIPTextModel.from_pretrained(models / "text_encoder")
    vae = AutoencoderKL.from_pretrained(models / "vae")
    sched = DDPMScheduler.from_pretrained(models / "scheduler")
    unet = UNet2DConditionModel.from_pretrained(root / "checkpoints/scratch/unet")

    assert tok.model_max_length == 77
    words = ["a", "on", "background", "red", "green", "blue", "circle", "square", "triangle", "white", "black",
             "blurry"]  # caption words, colours/shapes/backgrounds, and the eval negative prompt
    for word in words:
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
    assert metrics["demo_words"] == len(words)
    ids = tok("a red circle on a white background", padding="max_length", max_length=77).input_ids
    assert len(ids) == 77 and ids[0] == tok.bos_token_id and ids[8:] == [tok.eos_token_id] * 69
    assert te.config.vocab_size == len(tok) == metrics["tokenizer_vocab_size"]
    assert te.config.eos_token_id == tok.eos_token_id
    hidden = te(torch.tensor([ids])).last_hidden_state
    assert hidden.shape == (1, 77, unet.config.cross_attention_dim)
    assert vae.config.scaling_factor == pytest.approx(metrics["vae_scaling_factor"])
    assert vae.config.scaling_factor != 1.0
    assert sched.config.beta_schedule == "scaled_linear" and sched.config.clip_sample is False
    x = torch.randn(1, 4, 8, 8)
    assert unet(x, 5, encoder_hidden_states=hidden).sample.abs().max() == 0  # zero-initialised conv_out


def test_uncond_embedding_is_the_empty_prompt_encoded_once(built):
    from model.sampler import encode_prompts

    models = built[0] / "models"
    saved = load_file(models / prepare_models.UNCOND_EMBEDDING)
    tok = CLIPTokenizer.from_pretrained(models / "tokenizer")
    te = CLIPTextModel.from_pretrained(models / "text_encoder")
    with torch.no_grad():
        expected = encode_prompts(tok, te, [""], "cpu")
    assert list(saved) == ["uncond"] and saved["uncond"].shape == (1, 77, TINY_TEXT["hidden_size"])
    assert saved["uncond"].dtype == torch.float32 and torch.equal(saved["uncond"], expected)


def test_trainer_reads_the_uncond_file_and_falls_back_without_it(fresh_workspace):
    from safetensors.torch import save_file

    from model.denoisers import family
    from sdforge.config import load_params
    from sdforge.training.conditioning import Conditioning

    params = load_params(fresh_workspace)
    path = Path(params.paths.models) / prepare_models.UNCOND_EMBEDDING
    computed = load_file(path)["uncond"]
    marker = torch.full_like(computed, 0.25)
    save_file({"uncond": marker}, path)
    models, cpu = Path(params.paths.models), torch.device("cpu")
    assert torch.equal(Conditioning(models, cpu, "fp32", family("unet")).uncond, marker)
    path.unlink()
    assert torch.equal(Conditioning(models, cpu, "fp32", family("unet")).uncond, computed)  # encodes "" itself


def test_two_runs_give_identical_weights_and_replace_stale_outputs(built, tmp_path):
    root, first = built
    (tmp_path / "models/stale").mkdir(parents=True)
    again = prepare_models.run(tiny_models(), DEMO, EVAL, tmp_path / "models", tmp_path / "checkpoints/scratch")
    assert not (tmp_path / "models/stale").exists()
    for sub in ("models", "checkpoints/scratch"):
        a, b = _weights(root / sub), _weights(tmp_path / sub)
        assert sorted(a) == sorted(b)
        for name in a:
            assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    for f in ("vocab.json", "merges.txt", "tokenizer.json"):
        assert (root / "models/tokenizer" / f).read_bytes() == (tmp_path / "models/tokenizer" / f).read_bytes()
    assert {k: v for k, v in first.items() if "seconds" not in k} == {
        k: v for k, v in again.items() if "seconds" not in k
    }


def test_cross_attention_mismatch_names_the_key_and_both_values(tmp_path):
    models = tiny_models(unet={**TINY_UNET, "cross_attention_dim": 48})
    with pytest.raises(ConfigError, match=r"models\.unet\.cross_attention_dim \(48\).*hidden size \(32\)"):
        prepare_models.run(models, DEMO, EVAL, tmp_path / "models", tmp_path / "scratch")


def test_pretrained_source_loads_local_dirs_with_from_pretrained(built, tmp_path):
    """Full scale loads hub ids; local folders go through the same ``from_pretrained`` calls."""
    root, _ = built
    hub_vae, hub_clip = tmp_path / "hub/sd-vae", tmp_path / "hub/clip"
    vae = build_tiny_vae([8, 16], 1, 4, seed=5)
    vae.register_to_config(scaling_factor=0.18215)
    vae.save_pretrained(hub_vae)
    tok = CLIPTokenizer.from_pretrained(root / "models/tokenizer")
    tok.save_pretrained(hub_clip)
    te = build_tiny_text_encoder(len(tok), 32, 64, 1, 4, 77, seed=5)
    te.save_pretrained(hub_clip)

    models = tiny_models(source="pretrained", vae=str(hub_vae), text_encoder=str(hub_clip))
    metrics = prepare_models.run(models, DEMO, EVAL, tmp_path / "models", tmp_path / "scratch")
    out = tmp_path / "models"
    assert metrics["source"] == "pretrained" and "vae_recon_mae" not in metrics
    assert metrics["vae_scaling_factor"] == pytest.approx(0.18215)
    saved_vae = load_file(out / "vae/diffusion_pytorch_model.safetensors")
    assert saved_vae.keys() == vae.state_dict().keys()
    assert all(torch.equal(v, vae.state_dict()[k]) for k, v in saved_vae.items())
    saved_te = load_file(out / "text_encoder/model.safetensors")
    assert all(torch.equal(v, te.state_dict()[k]) for k, v in saved_te.items())
    assert CLIPTokenizer.from_pretrained(out / "tokenizer")("a red circle").input_ids == tok("a red circle").input_ids
    assert (tmp_path / "scratch/unet_ema/config.json").is_file()

    bad = tiny_models(source="pretrained", vae=str(hub_vae), text_encoder=str(hub_clip),
                      unet={**TINY_UNET, "cross_attention_dim": 768})
    with pytest.raises(ConfigError, match=r"cross_attention_dim \(768\).*\(32\)"):
        prepare_models.run(bad, DEMO, EVAL, tmp_path / "models2", tmp_path / "scratch2")


def test_cli_writes_metrics_and_logs_to_mlflow(demo_params, tmp_path):
    """``python -m stages.prepare_models --params params.yaml`` on the tiny demo config (cwd = tmp_path)."""
    import mlflow
    import yaml

    data = yaml.safe_load((tmp_path / "params.yaml").read_text())
    data["models"] = tiny_models().model_dump()
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    prepare_models.main(["--params", "params.yaml"])

    metrics = json.loads((tmp_path / "metrics/prepare_models.json").read_text())
    assert metrics["vae_train_steps"] == 3
    assert (tmp_path / "models/vae/config.json").is_file()
    assert (tmp_path / "checkpoints/scratch/unet/config.json").is_file()
    assert flush_spool(load_params(tmp_path / "params.yaml").tracking) == 1  # spooled (tracking.spool), replayed
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=[data["tracking"]["experiment"]], output_format="list")
    (run,) = [r for r in runs if r.data.tags.get("sdforge.stage") == "prepare_models"]
    assert run.data.metrics["unet_params"] == metrics["unet_params"]
    assert run.data.params["models.source"] == "build"


@pytest.fixture
def empty_hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache, offline (huggingface_hub reads both at import: patch its constants too)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))


def test_missing_weights_random_builds_the_real_vae_clip_l_and_tokenizer(empty_hub, tmp_path, caplog):
    """The full-scale ids with nothing cached: the real architectures, seeded random weights (preflight)."""
    models = tiny_models(source="pretrained", missing_weights="random", unet={**TINY_UNET, "cross_attention_dim": 768})
    assert (models.vae, models.text_encoder) == ("stabilityai/sd-vae-ft-mse", "openai/clip-vit-large-patch14")
    with caplog.at_level("WARNING", logger="stages.prepare_models"):
        metrics = prepare_models.run(models, DEMO, EVAL, tmp_path / "models", tmp_path / "scratch")
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "'stabilityai/sd-vae-ft-mse' is not on this machine" in warned and "never for a real run" in warned
    assert metrics["vae_weights"] == "random" and metrics["text_encoder_weights"] == "random"
    assert metrics["vae_params"] == 83_653_863 and metrics["vae_scaling_factor"] == pytest.approx(0.18215)
    assert metrics["vae_downsample"] == 8 and metrics["pixel_size"] == 64
    assert metrics["text_encoder_params"] == 123_060_480 and metrics["text_hidden_size"] == 768
    assert metrics["tokenizer_vocab_size"] == 49408 and metrics["tokenizer_max_length"] == 77

    out = tmp_path / "models"
    tok = CLIPTokenizer.from_pretrained(out / "tokenizer")
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    te = CLIPTextModel.from_pretrained(out / "text_encoder")
    assert te.config.vocab_size == 49408 and te.config.eos_token_id == 49407
    vae = AutoencoderKL.from_pretrained(out / "vae")
    assert list(vae.config.block_out_channels) == [128, 256, 512, 512]
    assert load_file(out / prepare_models.UNCOND_EMBEDDING)["uncond"].shape == (1, 77, 768)
    unet = UNet2DConditionModel.from_pretrained(tmp_path / "scratch/unet")
    assert unet.config.cross_attention_dim == 768


def _local_clip(built_root: Path, folder: Path) -> Path:
    """The demo tokenizer + text encoder in one folder, as a hub snapshot holds them."""
    CLIPTokenizer.from_pretrained(built_root / "models/tokenizer").save_pretrained(folder)
    CLIPTextModel.from_pretrained(built_root / "models/text_encoder").save_pretrained(folder)
    return folder


def test_missing_weights_random_keeps_the_weights_that_are_local(built, empty_hub, tmp_path):
    """A local text encoder folder is loaded as before; only the VAE that is nowhere is built randomly."""
    local_clip = _local_clip(built[0], tmp_path / "clip")
    models = tiny_models(source="pretrained", missing_weights="random", text_encoder=str(local_clip))
    metrics = prepare_models.run(models, DEMO, EVAL, tmp_path / "models", tmp_path / "scratch")
    assert metrics["text_encoder_weights"] == "pretrained" and metrics["vae_weights"] == "random"
    assert metrics["text_hidden_size"] == TINY_TEXT["hidden_size"]
    assert metrics["tokenizer_vocab_size"] == len(CLIPTokenizer.from_pretrained(local_clip))
    assert metrics["vae_params"] == 83_653_863
    saved = load_file(tmp_path / "models/text_encoder/model.safetensors")
    original = load_file(local_clip / "model.safetensors")
    assert saved.keys() == original.keys() and all(torch.equal(v, original[k]) for k, v in saved.items())


def test_missing_weights_random_without_a_stored_architecture_names_the_key(built, empty_hub, tmp_path):
    models = tiny_models(source="pretrained", missing_weights="random", vae="sdforge-test/no-such-vae",
                         text_encoder=str(_local_clip(built[0], tmp_path / "clip")))
    with pytest.raises(ConfigError, match=r"^models\.vae: .*'sdforge-test/no-such-vae'.*stabilityai/sd-vae-ft-mse"):
        prepare_models.run(models, DEMO, EVAL, tmp_path / "models", tmp_path / "scratch")


def test_missing_weights_error_is_the_default_and_names_the_missing_id(empty_hub, tmp_path):
    models = tiny_models(source="pretrained", text_encoder="sdforge-test/no-such-clip")
    assert models.missing_weights == "error"
    expected = r"(?s)^models\.text_encoder: cannot load 'sdforge-test/no-such-clip'.*missing_weights: random"
    with pytest.raises(ConfigError, match=expected):
        prepare_models.run(models, DEMO, EVAL, tmp_path / "models", tmp_path / "scratch")
